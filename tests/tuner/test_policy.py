"""The search policy: what it probes first, what it may skip, when it stops (pure, no probes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from toy_facts import CPU, FACTS, PRIOR

from autofit.core.boundary import Status
from autofit.core.config import Config
from autofit.core.space import space_from_dict
from autofit.cost_model import MemoryBreakdown, Prediction, predict
from autofit.cost_model.calibrate import Observation
from autofit.planning.plan import Plan
from autofit.probe.result import ProbeResult
from autofit.tuner.policy import (
    SearchState,
    by_expected_speed,
    common_error,
    error_chance,
    is_outlier,
    next_probe,
    should_stop,
    stop_margin,
    unexplored,
)
from autofit.tuner.records import TrialRecord, observations
from autofit.tuner.settings import SearchSettings


def _prediction(step_s: float, update_s: float, peak: int = 5) -> Prediction:
    memory = MemoryBreakdown(params=peak - 4, grads=1, optimizer=1, activations=1, other=1)
    return Prediction(
        peak_bytes=memory.total,
        breakdown=memory,
        step_time_s=step_s,
        samples_per_s=8 / step_s,
        tokens_per_s=None,
        fits=True,
        time_breakdown={"compute": step_s - update_s, "optimizer": update_s},
    )


def _record(config: Config, status: Status, samples_per_s: float = 0.0, message: str | None = None) -> TrialRecord:
    return TrialRecord(
        number=0,
        config=config,
        phase="search",
        status=status,
        measured=ProbeResult(config, status, 0, 0.0, samples_per_s, None, message, 0.0),
        predicted=None,
        within_margin=status == "ok",
    )


ADAMW = Config(micro_batch_size=8)
LION = ADAMW.with_(optimizer="lion")
SGD = ADAMW.with_(optimizer="sgd")
BF16 = ADAMW.with_(precision="bf16")


def test_each_optimizer_and_precision_is_probed_once_fastest_first() -> None:
    todo = [(LION, _prediction(1.0, 0.1)), (SGD, _prediction(1.1, 0.1)), (BF16, _prediction(1.2, 0.1))]
    best = _record(ADAMW, "ok", 6.0)
    assert [c for c, _ in unexplored(todo, [best], best, 0.05)] == [LION, SGD, BF16]
    # once Lion has run, only SGD and bf16 are left; a Lion config of another micro-batch is not new
    other_lion = LION.with_(micro_batch_size=4, grad_accum_steps=2)
    todo = [(other_lion, _prediction(0.9, 0.1)), *todo[1:]]
    done = [best, _record(LION, "ok", 6.0)]
    assert [c for c, _ in unexplored(todo, done, best, 0.05)] == [SGD, BF16]


def test_an_optimizer_that_cannot_win_even_with_a_free_update_is_not_probed() -> None:
    best = _record(ADAMW, "ok", 10.0)  # 0.8 s per step
    # SGD: 1.0 s, of which the update is 0.1 s: at best 0.9 s, slower than the best measured by more than 5%
    assert unexplored([(SGD, _prediction(1.0, 0.1))], [best], best, 0.05) == []
    # ... but not by more than the model's doubt: then it is probed
    assert unexplored([(SGD, _prediction(1.0, 0.1))], [best], best, 0.15) != []
    # an unmeasured precision has no such bound: it is probed
    assert unexplored([(BF16, _prediction(1.0, 0.1))], [best], best, 0.05) != []


def test_an_oom_leaves_its_optimizer_unexplored_an_error_does_not() -> None:
    smaller = LION.with_(micro_batch_size=4, grad_accum_steps=2)
    todo = [(smaller, _prediction(1.0, 0.5))]
    assert unexplored(todo, [_record(LION, "oom")], None, 0.05) == todo
    assert unexplored(todo, [_record(LION, "error")], None, 0.05) == []


def test_a_candidate_predicted_past_the_budget_is_probed_only_when_its_speed_makes_up_for_it() -> None:
    usable = 100
    fits = (ADAMW, _prediction(1.0, 0.1, peak=90))
    just_over = (LION, _prediction(0.8, 0.1, peak=101))  # 1% over with a 10% band: 90% likely to fit
    far_over = (SGD, _prediction(0.5, 0.1, peak=109))  # twice as fast, but 90% of the way across the band: 10% likely
    too_far = (BF16, _prediction(0.1, 0.1, peak=111))  # past the band: never probed
    ranked = by_expected_speed([fits, just_over, far_over, too_far], usable, 0.10)
    assert [c for c, _ in ranked] == [just_over[0], fits[0], far_over[0]]


def test_stop_margin_is_the_floor_when_the_model_explains_held_out_probes() -> None:
    configs = [Config(micro_batch_size=m) for m in (1, 2, 4, 8)]
    exact = [
        Observation(c, "ok", 1, predict(c, FACTS, CPU, 1).step_time_s, CPU.memory_bytes) for c in configs
    ]
    assert stop_margin(exact, FACTS, CPU, 1, None, 0.05) == pytest.approx(0.05)
    # one measurement 3x off what the others imply: its held-out miss widens the margin (capped)
    noisy = exact[:3] + [Observation(configs[3], "ok", 1, 3 * exact[3].step_time_s, CPU.memory_bytes)]
    assert stop_margin(noisy, FACTS, CPU, 1, None, 0.05, cap=0.30) == pytest.approx(0.30)


def _state(records: list[TrialRecord], ranked: list, n_done: int, tolerance: float = 0.05, timed_out: bool = False):  # noqa: ANN202
    plan = Plan(entry="toy", name="toy", hardware=CPU.with_memory(100), space=space_from_dict({}, name="toy"),
                world_size=1, global_batch=None, fixed={}, candidates=tuple(c for c, _ in ranked), rejected=(),
                facts=FACTS, coefficients=PRIOR)
    return SearchState(plan, records, ranked, usable_bytes=100, band=0.10, tolerance=tolerance, n_done=n_done,
                       timed_out=timed_out)


SETTINGS = SearchSettings(trials=6, timeout_s=60.0, min_probes=2)


def test_the_stop_rule_names_each_reason_in_order() -> None:
    ranked = [(ADAMW.with_(micro_batch_size=4, grad_accum_steps=2), _prediction(1.0, 0.1))]
    assert should_stop(_state([], ranked, n_done=6), SETTINGS) == "reached --trials 6"
    assert should_stop(_state([], ranked, n_done=1, timed_out=True), SETTINGS) == "reached --time-budget 60 s"
    probed = _record(ranked[0][0], "ok", 8.0)
    assert should_stop(_state([probed], ranked, n_done=1), SETTINGS) == "every candidate predicted to fit has been probed"


def test_it_stops_once_nothing_left_could_beat_the_best_even_with_the_models_doubt() -> None:
    best = _record(ADAMW, "ok", 10.0)
    # AdamW at micro-batch 4: predicted 8 samples/s; 10% doubt cannot make it beat 10
    slower = (ADAMW.with_(micro_batch_size=4, grad_accum_steps=2), _prediction(1.0, 0.1))
    assert should_stop(_state([best, best], [slower], n_done=2), SETTINGS).startswith("no candidate left could beat")
    # ... before min_probes it goes on, and with a 30% doubt 8 x 1.3 > 10 may still win
    assert should_stop(_state([best], [slower], n_done=1), SETTINGS) is None
    assert should_stop(_state([best, best], [slower], n_done=2, tolerance=0.30), SETTINGS) is None
    assert next_probe(_state([best], [slower], n_done=1), SETTINGS) == slower


def test_an_unexplored_optimizer_is_probed_before_the_stop_rule_may_fire() -> None:
    best = _record(ADAMW, "ok", 10.0)
    fast_adamw = (ADAMW.with_(micro_batch_size=4, grad_accum_steps=2), _prediction(0.7, 0.1))
    lion = (LION, _prediction(0.79, 0.3))  # slower predicted, but its update is unmeasured and large
    state = _state([best, best], [fast_adamw, lion], n_done=2)
    assert should_stop(state, SETTINGS) is None
    assert next_probe(state, SETTINGS) == lion


def test_before_nothing_fits_the_smallest_of_each_unmeasured_family_is_probed() -> None:
    candidates = (ADAMW, ADAMW.with_(micro_batch_size=1, grad_accum_steps=8), SGD,
                  SGD.with_(micro_batch_size=1, grad_accum_steps=8), SGD.with_(micro_batch_size=2, grad_accum_steps=4))
    oom = _record(ADAMW, "oom")
    # nothing measured fits and nothing is left predicted to fit (the calibrated todo list is empty): AdamW has
    # an OOM, so SGD's smallest (as the uncorrected model prices it on the whole budget) is the one probed
    state = _state([oom], [], n_done=1)
    state = replace(state, usable=replace(state.usable, candidates=candidates, hardware=CPU), usable_bytes=CPU.memory_bytes)
    assert [c for c, _ in state.last_resort] == [candidates[3]]
    assert should_stop(state, SETTINGS) is None
    assert next_probe(state, SETTINGS)[0] == candidates[3]
    # once every family has been measured out of memory, it stops
    done = replace(state, records=[oom, _record(candidates[3], "oom")])
    assert done.last_resort == [] and should_stop(done, SETTINGS) == "every candidate predicted to fit has been probed"


def _failed(config: Config, message: str) -> TrialRecord:
    return _record(config, "error", message=message)


def test_the_same_error_with_every_setting_stops_the_search_with_that_error() -> None:
    ranked = [(ADAMW, _prediction(1.0, 0.1)), (LION, _prediction(1.1, 0.1))]
    same = [_failed(ADAMW, "ImportError: no module named foo\ntraceback..."), _failed(LION, "ImportError: no module named foo")]
    assert common_error(same, [ADAMW, LION]) == "ImportError: no module named foo"
    assert should_stop(_state(same, ranked, n_done=2), SETTINGS).endswith("ImportError: no module named foo")
    # one family's error does not stop the others, and keeps that family out of the todo list
    one = [_failed(LION, "FusedLion: no CUDA")]
    assert common_error(one, [ADAMW, LION]) is None and common_error([*one, _failed(ADAMW, "other")], [ADAMW, LION]) is None
    ranked = [(LION.with_(micro_batch_size=4, grad_accum_steps=2), _prediction(0.5, 0.1)), (SGD, _prediction(1.0, 0.1))]
    assert [c for c, _ in _state(one, ranked, n_done=1).todo] == [SGD]


def test_an_error_of_one_precision_in_two_zero_stages_leaves_the_other_precision_to_be_measured() -> None:
    # a BatchNorm model in bf16 at ZeRO 0 and 1: the same error twice, in two families, fp32 never probed
    bf16_z1 = BF16.with_(zero_stage=1)
    errors = [_failed(BF16, "RuntimeError: expected scalar type BFloat16 but found Float"),
              _failed(bf16_z1, "RuntimeError: expected scalar type BFloat16 but found Float")]
    faster_bf16 = (BF16.with_(zero_stage=2), _prediction(0.5, 0.1))
    fp32 = (SGD, _prediction(1.0, 0.1))
    state = _state(errors, [faster_bf16, fp32], n_done=2)
    assert common_error(errors, [c for c, _ in state.ranked]) is None
    assert should_stop(state, SETTINGS) is None
    # the next probe tries the most of what no probe has had (fp32 and SGD), before the faster-predicted bf16 ZeRO-2
    assert next_probe(state, SETTINGS) == fp32


def test_a_candidate_nearer_an_errored_family_than_one_that_ran_is_probed_after_the_others() -> None:
    bf16_error = _failed(BF16, "RuntimeError: expected scalar type BFloat16 but found Float")
    fp32_ran = _record(ADAMW, "ok", 4.0)
    bf16_lion, fp32_lion = BF16.with_(optimizer="lion"), LION
    # bf16 Lion is one key from the errored bf16 AdamW and two from the fp32 AdamW that ran; fp32 Lion the reverse
    assert error_chance(bf16_lion, [bf16_error, fp32_ran]) == 1.0
    assert error_chance(fp32_lion, [bf16_error, fp32_ran]) == 0.0
    # equally near both: even odds; nothing measured: no doubt
    assert error_chance(BF16.with_(optimizer="lion", zero_stage=1), [bf16_error, _record(LION, "ok", 4.0)]) == 0.5
    assert error_chance(bf16_lion, []) == 0.0
    faster_bf16 = (bf16_lion, _prediction(0.5, 0.1))
    slower_fp32 = (fp32_lion, _prediction(1.0, 0.1))
    assert [c for c, _ in by_expected_speed([faster_bf16, slower_fp32], 100, 0.1, [bf16_error, fp32_ran])] == \
        [fp32_lion, bf16_lion]


def test_a_probe_far_from_the_model_and_its_neighbours_is_an_outlier_and_its_repeat_replaces_it() -> None:
    def probed(config: Config, measured: float, predicted: float, phase: str = "search") -> TrialRecord:
        record = _record(config, "ok", measured)
        record.phase = phase
        record.predicted = replace(_prediction(8 / predicted, 0.0).record(), samples_per_s=predicted)
        return record

    neighbours = [probed(ADAMW, 2.0, 2.2), probed(SGD, 1.8, 2.0)]
    slow = probed(LION, 0.27, 2.1)  # 7x slower than the model and its neighbours say
    assert is_outlier(slow, [*neighbours, slow], 2.0)
    assert not is_outlier(neighbours[0], [*neighbours, slow], 2.0)
    assert not is_outlier(slow, [neighbours[0], slow], 2.0)  # one neighbour is not enough to judge
    # judged by one model: the neighbours' stored predictions came from an uncalibrated prior (2.4x off), the
    # model that predicted the new probe explains them all, and the new probe ran as it predicted
    early = [probed(ADAMW, 2.0, 0.83), probed(SGD, 1.8, 0.75)]
    on_time = probed(LION, 2.1, 2.1)
    assert is_outlier(on_time, [*early, on_time], 2.0)
    now = {ADAMW.key(): 2.0, SGD.key(): 1.8}
    assert not is_outlier(on_time, [*early, on_time], 2.0, lambda c: now[c.key()])
    again = probed(LION, 1.9, 2.1, phase="repeat")
    used = observations([*neighbours, slow, again], 2**30)
    assert [o.config for o in used] == [ADAMW, SGD, LION] and used[-1].step_time_s == again.observation(2**30).step_time_s


def test_a_timeout_bounds_its_step_by_its_time_less_the_longest_start_up_over_its_steps() -> None:
    ran = TrialRecord(0, Config(), "search", "ok", ProbeResult(Config(), "ok", 0, 2.0, 1.0, None, None, 10.0), {},
                      within_margin=True, wall_s=20.0)
    slow_config, unknown_config = Config(precision="bf16"), Config(precision="bf16", optimizer="sgd")
    slow = TrialRecord(1, slow_config, "search", "timeout", ProbeResult(slow_config, "timeout", 0, 0.0, 0.0, None, None, 0.0),
                       {}, wall_s=100.0, planned_steps=3)
    unknown = TrialRecord(2, unknown_config, "search", "timeout",
                          ProbeResult(unknown_config, "timeout", 0, 0.0, 0.0, None, None, 0.0), {}, wall_s=100.0)
    bounds = {o.config.key(): o.time_lower_bound_s for o in observations([ran, slow, unknown], CPU.memory_bytes)}
    assert bounds == {ran.config.key(): 0.0, slow.config.key(): pytest.approx(30.0), unknown.config.key(): 0.0}
