"""What fits: the one rule every command judges a prediction by (docs/design.md, "What fits").

A config fits a device when its predicted peak is within the *usable* budget, ``(1 - margin) x`` the device
memory, and its host peak within the node's host memory (:func:`autofit.cost_model.predict`, given the device
with its usable budget by :func:`usable_hardware`). The margin is the share of the device memory left free for
what the model does not predict (the memory model's miss, a fragmenting allocator, a longer batch): ``autofit
run`` verifies its winner's *measured* peak against the same usable budget, so a config ``autofit estimate``
says fits is one the search may keep. ``estimate``, ``probe``, ``ladder``, ``run`` and ``schedule add`` all take
``--margin`` (default :data:`DEFAULT_MARGIN`) and price through :meth:`autofit.planning.plan.Plan.predict`,
which applies it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autofit.core.hardware import Hardware
from autofit.core.units import finite, format_bytes

#: the share of the device memory a config must leave free, where the user gives no ``--margin``
DEFAULT_MARGIN = 0.10
#: the most ``--margin`` may be: a tenth of the device is the least a plan is priced against
MAX_MARGIN = 0.9
#: how far past the usable budget a plan prices every candidate's peak exactly
#: (:meth:`autofit.planning.plan.Plan.price`): the search reads peaks up to its memory band past the budget
#: (:attr:`autofit.tuner.settings.SearchSettings.memory_band_cap`, at most this), and past it a GPU peak may stop at
#: what already rules the config out (:func:`autofit.cost_model.memory.bounded_memory`)
EXACT_PAST_BUDGET = 0.25


def exact_within_bytes(budget_bytes: int) -> int:
    """The peak up to which a plan priced against ``budget_bytes`` prices every candidate exactly."""
    return int(budget_bytes * (1.0 + EXACT_PAST_BUDGET))


def check_margin(margin: object) -> float:
    """``margin`` as a float within ``[0, MAX_MARGIN]``; anything else is one :class:`AutofitError` naming it."""
    return finite("margin", margin, 0.0, MAX_MARGIN)


def usable_bytes(memory_bytes: int, margin: float) -> int:
    """The usable budget: ``(1 - margin) x memory_bytes``, rounded down (a prediction fits when it is at most this)."""
    return int((1.0 - check_margin(margin)) * memory_bytes)


def usable_hardware(hardware: Hardware, margin: float) -> Hardware:
    """``hardware`` with its memory cut to the usable budget: what a prediction is judged against."""
    return replace(hardware, memory_bytes=usable_bytes(hardware.memory_bytes, margin))


def memory_for(need_bytes: int, margin: float) -> int:
    """The least device memory whose usable budget holds ``need_bytes`` (what ``--memory`` would have to be)."""
    least = max(1, int(need_bytes / (1.0 - check_margin(margin))))
    while usable_bytes(least, margin) < need_bytes:  # the float round trip may land a byte either side
        least += 1
    while least > 1 and usable_bytes(least - 1, margin) >= need_bytes:
        least -= 1
    return least


def budget_dict(memory_bytes: int, margin: float) -> dict[str, Any]:
    """The budget as the JSON documents state it: the device memory, the margin and the usable budget."""
    return {"memory_bytes": memory_bytes, "margin": check_margin(margin),
            "usable_bytes": usable_bytes(memory_bytes, margin)}


def budget_text(memory_bytes: int, margin: float) -> str:
    """The budget in words: ``423.00 MiB usable ((1 - 0.1) x 470.00 MiB: a 10% safety margin)``."""
    return (f"{format_bytes(usable_bytes(memory_bytes, margin))} usable "
            f"((1 - {check_margin(margin):g}) x {format_bytes(memory_bytes)}: a {margin:.0%} safety margin)")
