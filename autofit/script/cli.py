"""``autofit run --script``: the plan and the prober of a script search, for the CLI's ``run``."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import click

from autofit.planning.plan import Plan
from autofit.script.command import ScriptCommand
from autofit.script.prober import script_prober
from autofit.script.profile import script_plan
from autofit.tuner.driver import Prober


def script_plan_and_prober(setup: Any, script: str, stack: contextlib.ExitStack) -> tuple[Plan, Prober]:
    """Profile the script (``setup``: the CLI's parsed device and space options) and make its prober; the
    JSONs, metric files and logs live in a temporary folder that ``stack`` removes."""
    command = ScriptCommand(script)
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="autofit-script-")))
    click.echo(f"autofit: profiling {command.name} (DeepSpeed's model-info profile, then one metric run)", err=True)
    plan = script_plan(command, setup.hardware, setup.space, world_size=setup.world_size,
                       global_batch=setup.global_batch, fixed=setup.fixed, workdir=workdir / "profile",
                       software=setup.software, recipe=setup.recipe)
    click.echo(f"autofit: {plan.facts.n_params:,} parameters", err=True)
    return plan, script_prober(command, setup.hardware, setup.world_size, workdir / "probes", software=setup.software)
