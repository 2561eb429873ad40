"""The helpers of benchmarks/peers/compare_*.py (no probe, no peer tool: those run in the benchmarks themselves)."""

from __future__ import annotations

import pytest

from benchmarks import common as cc
from benchmarks.peers import compare_scale, compare_search


@pytest.mark.parametrize(("found", "micro", "accum"), [(1, 1, 4), (2, 2, 2), (3, 2, 2), (4, 4, 1), (64, 4, 1), (0, 1, 4)])
def test_a_found_batch_becomes_a_divisor_of_the_global_batch_with_accumulation_keeping_it(found, micro, accum):
    config = compare_search.user_config(found)
    assert (config.micro_batch_size, config.grad_accum_steps) == (micro, accum)
    assert config.micro_batch_size * config.grad_accum_steps == compare_search.GLOBAL_BATCH


def test_errors_are_relative_to_the_measured_peak_and_missing_estimates_stay_missing():
    assert cc.relative_error(110, 100) == pytest.approx(0.10)
    assert cc.relative_error(None, 100) is None
    stats = cc.error_summary([0.10, -0.30, None, 0.02])
    assert stats["n"] == 3
    assert stats["median_abs"] == pytest.approx(0.10)
    assert stats["worst_abs"] == pytest.approx(0.30)
    assert stats["worst_under"] == pytest.approx(-0.30)
    assert cc.error_summary([None])["median_abs"] is None


def test_the_cache_computes_a_key_once_and_keeps_it_on_disk(tmp_path):
    calls = []
    cache = cc.JsonCache(tmp_path / "probes.json")
    assert cache.get_or_compute("a", lambda: calls.append(1) or {"peak": 5}) == {"peak": 5}
    assert cache.get_or_compute("a", lambda: calls.append(1) or {"peak": 6}) == {"peak": 5}
    assert cc.JsonCache(tmp_path / "probes.json").get_or_compute("a", lambda: {"peak": 7}) == {"peak": 5}
    assert calls == [1]


def test_the_candidate_ladder_grows_to_about_a_hundred_thousand_configs():
    sizes = [space.size() for _, space in compare_scale.ladder_spaces()]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert sizes[0] == 7
    assert 300_000 <= sizes[-1] <= 500_000  # before the hardware rules; ~100,000 candidates remain on h100 x 8
