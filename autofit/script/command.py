"""The user's command line, and the DeepSpeed JSON it is given: a candidate's, with an ``autotuning`` section."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autofit.core.errors import AutofitError

PLACEHOLDER = "{config}"


@dataclass(frozen=True)
class ScriptCommand:
    """``python train.py --deepspeed_config {config}``: what each rank runs, with the JSON's path in it."""

    template: str
    """The command as given; ``{config}`` marks where the DeepSpeed JSON's path goes."""

    def __post_init__(self) -> None:
        if PLACEHOLDER not in self.template:
            raise AutofitError(
                f"--script must say where the DeepSpeed JSON goes with {PLACEHOLDER}, but got {self.template!r}"
            )
        try:
            words = shlex.split(self.template)
        except ValueError as exc:
            raise AutofitError(f"--script {self.template!r} cannot be split into words: {exc}") from None
        if not words or words[0] == PLACEHOLDER:
            raise AutofitError(f"--script must start with a program, but got {self.template!r}")

    def argv(self, config_path: Path) -> list[str]:
        """The command's words with ``{config}`` replaced (no shell: a word stays one argument)."""
        return [word.replace(PLACEHOLDER, str(config_path)) for word in shlex.split(self.template)]

    @property
    def name(self) -> str:
        """A short name for the study and the report: the script's file name, else the program."""
        words = shlex.split(self.template)
        scripts = [w for w in words if w.endswith(".py")]
        return f"script:{Path(scripts[0] if scripts else words[0]).name}"


def with_model_info_profile(ds: dict[str, Any], model_info_path: Path) -> dict[str, Any]:
    """``ds`` set to profile the model and stop: the engine counts parameters at initialize, measures the
    memory one forward allocates (``activation_mem_per_gpu``), writes both to ``model_info_path`` and exits
    inside that forward (deepspeed/runtime/engine.py, ``autotuning_profile_model_info``)."""
    return dict(ds, autotuning={"enabled": True, "model_info": {"profile": True}, "model_info_path": str(model_info_path)})


def with_metric(ds: dict[str, Any], metric_path: Path, warmup_steps: int, steps: int) -> dict[str, Any]:
    """``ds`` set to time ``steps`` optimizer steps after ``warmup_steps`` and stop.

    The engine's global timers record forward, backward and step from ``start_profile_step``; once
    ``end_profile_step + 1`` steps are done it writes their means (microseconds), ``latency``,
    ``throughput`` and ``FLOPS_per_gpu`` (the flops profiler's count at the first profiled step, x3 for
    the backward) to ``metric_path`` and exits (engine.py, ``_autotuning_exit``).
    """
    section = {
        "enabled": True,
        "metric": "throughput",
        "metric_path": str(metric_path),
        "start_profile_step": warmup_steps,
        "end_profile_step": warmup_steps + steps - 1,
    }
    return dict(ds, autotuning=section)
