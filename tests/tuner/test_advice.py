"""The advice when nothing fits: the nearest ways to fit, fastest predicted first, the recipe's substitutes named."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import pytest

from autofit.core.hardware import Hardware
from autofit.core.software import Software
from autofit.core.space import SearchSpace, space_from_dict
from autofit.machine.device import get_hardware
from autofit.planning.plan import Plan
from autofit.tuner.advice import nothing_fits

MIB = 2**20
SPACE = space_from_dict({"global_batch_size": 16, "micro_batch_size": [1], "precision": ["bf16"],
                         "optimizer": ["adamw"], "zero_stage": [0], "attention": ["sdpa"], "checkpoint_ratio": [1.0]},
                        name="adamw-only")


@pytest.mark.slow
def test_nothing_fits_offers_the_8bit_substitute_where_it_alone_fits(
        big_plan: Callable[[Hardware, SearchSpace], Plan]) -> None:
    plan = replace(big_plan(get_hardware("h100-80gb"), SPACE), software=Software())  # bitsandbytes counted in
    (config, adamw), = plan.price()
    eight_bit = plan.predict(config.with_(optimizer="adamw8bit"))
    assert eight_bit.peak_bytes < adamw.peak_bytes  # the budget between them: only the substitute fits
    budget = (eight_bit.peak_bytes + adamw.peak_bytes) // 2
    usable = plan.with_memory(budget)
    message = nothing_fits([], usable, usable.uncalibrated(), usable.hardware, 0.0)
    assert "--allow adamw8bit" in message and "changes the recipe's optimizer" in message, message
    ideas = message.split("fastest predicted first) ", 1)[1].split("; or ")
    speeds = [float(re.search(r"([\d.e+]+) samples/s", idea).group(1)) for idea in ideas]
    assert speeds == sorted(speeds, reverse=True), message


@pytest.mark.slow
def test_nothing_fits_does_not_offer_a_substitute_already_allowed(
        big_plan: Callable[[Hardware, SearchSpace], Plan]) -> None:
    plan = big_plan(get_hardware("h100-80gb", 64 * MIB), SPACE)
    allowed = replace(plan, software=Software(), recipe=replace(plan.stated_recipe, allow=("adamw8bit",)))
    message = nothing_fits([], allowed, allowed.uncalibrated(), allowed.hardware, 0.0)
    assert "--allow adamw8bit" not in message
