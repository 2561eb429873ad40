"""A GPU plan replays the caching allocator only for candidates near its budget: what fits is judged exactly as
one-by-one pricing judges it, a peak within the exact range is the same, and one past it is a lower bound that says
so."""

from __future__ import annotations

import pytest

from autofit.core.space import space_from_dict
from autofit.cost_model.allocation_sequence import reserve_memo
from autofit.cost_model.budget import exact_within_bytes
from autofit.planning.plan import Plan
from autofit.workload.types import Workload
from tests.cost_model.test_allocation_sequence import DECODER
from tests.planning.test_reserve_cache import H100, _read_back

GIB = 2**30


@pytest.fixture(autouse=True)
def no_cache(monkeypatch):
    monkeypatch.setenv("AUTOFIT_NO_CACHE", "1")


def _plan(memory_bytes: int) -> Plan:
    """The decoder on 8 H100s cut to ``memory_bytes``, micro-batches 1 to 32 (peaks 1.5 to 2.4 GiB)."""
    space = space_from_dict({"micro_batch_size": [1, 8, 32], "zero_stage": [0, 3], "checkpoint_ratio": [0.0, 1.0],
                             "precision": ["bf16"], "attention": ["sdpa"]}, name="bounded")
    workload = Workload(name="decoder", model=lambda **_: None, batch=lambda n: None)
    plan = Plan.make("decoder", workload, H100, space, world_size=8, global_batch=256, facts=_read_back(DECODER))
    return plan.with_memory(memory_bytes)


def test_past_the_exact_range_a_peak_is_a_lower_bound_and_what_fits_is_the_same() -> None:
    plan = _plan(int(1.9 * GIB))
    within = exact_within_bytes(plan.usable_bytes)
    priced = plan.price()
    bounded = [(c, p) for c, p in priced if p.peak_is_lower_bound]
    exact = [(c, p) for c, p in priced if not p.peak_is_lower_bound]
    assert bounded and exact and any(p.fits for _, p in exact) and any(not p.fits for _, p in exact)
    for config, prediction in priced:
        alone = plan.predict(config)
        assert prediction.fits == alone.fits and prediction.samples_per_s == alone.samples_per_s
        if prediction.peak_is_lower_bound:
            assert within < prediction.peak_bytes < alone.peak_bytes and not alone.peak_is_lower_bound
            assert prediction.reason is not None and "more than" in prediction.reason
        else:
            assert prediction.peak_bytes == alone.peak_bytes and prediction.reason == alone.reason


def test_a_budget_that_holds_every_candidate_replays_every_reserve_and_an_exact_peak_is_the_budgets_alike() -> None:
    plan = _plan(8 * GIB)
    priced = plan.price()
    assert all(p.fits and not p.peak_is_lower_bound for _, p in priced)
    fewer = _plan(int(1.9 * GIB))
    bounded = fewer.price()
    assert 0 < len(reserve_memo(fewer.facts)) < len(reserve_memo(plan.facts))
    whole = {c: p.peak_bytes for c, p in priced}
    assert all(p.peak_bytes == whole[c] for c, p in bounded if not p.peak_is_lower_bound)
