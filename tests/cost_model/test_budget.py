"""The usable budget (autofit/cost_model/budget.py): what every command judges a prediction against."""

from __future__ import annotations

import pytest

from autofit.core.errors import AutofitError
from autofit.cost_model.budget import (
    DEFAULT_MARGIN,
    MAX_MARGIN,
    budget_dict,
    budget_text,
    check_margin,
    memory_for,
    usable_bytes,
    usable_hardware,
)
from autofit.machine.device import get_hardware

GIB = 2**30


@pytest.mark.parametrize("margin", [0.0, DEFAULT_MARGIN, 0.25, MAX_MARGIN])
def test_the_usable_budget_leaves_the_margin_free(margin: float) -> None:
    memory = 3 * GIB + 7
    usable = usable_bytes(memory, margin)
    assert usable <= memory and memory - usable >= int(margin * memory)
    assert usable_bytes(memory, 0.0) == memory
    assert usable_hardware(get_hardware("cpu", memory), margin).memory_bytes == usable
    assert budget_dict(memory, margin) == {"memory_bytes": memory, "margin": margin, "usable_bytes": usable}


@pytest.mark.parametrize("need", [1, 999, 470 * 2**20, 79 * GIB + 3])
@pytest.mark.parametrize("margin", [0.0, DEFAULT_MARGIN, 0.33])
def test_memory_for_is_the_least_device_that_holds_a_need(need: int, margin: float) -> None:
    memory = memory_for(need, margin)
    assert usable_bytes(memory, margin) >= need > usable_bytes(memory - 1, margin)


def test_the_budget_in_words_names_the_usable_part_and_the_margin() -> None:
    assert budget_text(1000 * 2**20, 0.1) == "900.00 MiB usable ((1 - 0.1) x 1000.00 MiB: a 10% safety margin)"


@pytest.mark.parametrize("margin", [-0.01, MAX_MARGIN + 0.01, float("nan"), float("inf"), "much", True])
def test_a_margin_out_of_range_is_one_error(margin: object) -> None:
    with pytest.raises(AutofitError, match="^margin must be"):
        check_margin(margin)
