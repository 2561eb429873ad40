"""Verification: which leaders are probed again, and which wins (pure: records made by hand)."""

from __future__ import annotations

from autofit.core.config import Config
from autofit.probe.result import ProbeResult
from autofit.tuner.records import TrialRecord
from autofit.tuner.settings import SearchSettings
from autofit.tuner.verify import contenders, verify

A, B, C, D = (Config(micro_batch_size=m, grad_accum_steps=16 // m) for m in (1, 2, 4, 8))


def _record(config: Config, phase: str, samples_per_s: float, within: bool = True) -> TrialRecord:
    measured = ProbeResult(config, "ok", 0, 0.0, samples_per_s, None, None, 0.0)
    return TrialRecord(0, config, phase, "ok", measured, {}, within_margin=within)


def test_close_runners_up_are_verified_with_the_leader() -> None:
    records = [_record(A, "search", 10.0), _record(B, "search", 8.5), _record(C, "search", 7.0), _record(D, "search", 9.9)]
    # D (within 20%) and B (within 20%) join A; C (30% slower) does not; at most 3 contenders
    assert contenders(records, set(), SearchSettings()) == [A, D, B]
    assert contenders(records, set(), SearchSettings(contender_within=0.05)) == [A, D]


def test_the_higher_mean_wins_and_a_leader_past_the_margin_is_dropped() -> None:
    records = [_record(A, "search", 10.0), _record(B, "search", 9.0), _record(C, "search", 5.0)]
    runs = {A: (6.0, True), B: (9.5, True), C: (5.0, True)}
    probed = []

    def probe(config: Config) -> TrialRecord:
        probed.append(config)
        samples, within = runs[config]
        records.append(_record(config, "verify", samples, within))
        return records[-1]

    winner = verify(records, probe, SearchSettings())
    assert probed == [A, B]  # C is not close enough to A to be verified
    assert winner is not None and winner.config == B  # mean 9.25 beats A's 8.0

    # the leader runs past the margin on its verification: it cannot win, the next round verifies C
    records = [_record(A, "search", 10.0), _record(C, "search", 5.0)]
    runs[A] = (10.0, False)
    probed.clear()
    failed_rounds = []
    winner = verify(records, probe, SearchSettings(), lambda: failed_rounds.append(1))
    assert probed == [A, C] and failed_rounds == [1]
    assert winner is not None and winner.config == C
