"""Calibration of the cost model from probe observations: pure, hand-made facts, no torch."""

from __future__ import annotations

import pytest
from toy_facts import CONFIGS, CPU, FACTS, PRIOR

from autofit.core.config import Config
from autofit.cost_model import Coefficients, predict
from autofit.cost_model.calibrate import (
    Calibration,
    Observation,
    calibrate,
    fit_memory,
    fit_time,
    time_terms,
)
from autofit.cost_model.memory_correction import SCALE_RANGE


def _truth() -> Coefficients:
    """A device the prior knows nothing about: slow fp32, bf16 ten times slower still, big per-micro overhead."""
    return PRIOR.with_(
        compute_efficiency={"fp32": 0.08, "bf16": 0.008, "fp16": 0.35},
        micro_batch_overhead_s=0.03,
        step_overhead_s=0.01,
        memory_scale=1.4,
    )


def _observe(config: Config, truth: Coefficients, status: str = "ok") -> Observation:
    p = predict(config, FACTS, CPU, 1, truth)
    return Observation(config, status, p.peak_bytes, p.step_time_s if status == "ok" else 0.0, CPU.memory_bytes)


def test_time_terms_reproduce_the_prediction() -> None:
    for config in CONFIGS:
        t = time_terms(config, FACTS, CPU, 1, PRIOR)
        again = (
            t.work_s / PRIOR.efficiency(t.dtype)
            + t.n_micro * PRIOR.micro_batch_overhead_s
            + t.n_steps * PRIOR.step_overhead_s
            + t.optimizer_bytes / PRIOR.optimizer_bytes_per_s
            + t.rest_s
        )
        assert again == pytest.approx(predict(config, FACTS, CPU, 1, PRIOR).step_time_s, rel=1e-6)
        assert t.n_micro == pytest.approx(config.grad_accum_steps)


def test_no_observation_keeps_the_prior() -> None:
    assert calibrate([], FACTS, CPU, 1, PRIOR).coefficients == PRIOR


def test_enough_observations_recover_the_truth() -> None:
    truth = _truth()
    observations = [_observe(c, truth) for c in CONFIGS]
    fitted = calibrate(observations, FACTS, CPU, 1, PRIOR)
    for config in CONFIGS:
        want = predict(config, FACTS, CPU, 1, truth)
        got = fitted.predict(config, FACTS, CPU, 1)
        assert got.step_time_s == pytest.approx(want.step_time_s, rel=0.05), config.label()
        assert got.peak_bytes == pytest.approx(want.peak_bytes, rel=0.01)


def test_one_slow_bf16_probe_makes_every_bf16_prediction_slow() -> None:
    """A CPU without native bf16 is learned: after one bf16 probe, bf16 ranks below fp32."""
    truth = _truth()
    fp32 = Config(micro_batch_size=4, grad_accum_steps=4)
    bf16 = fp32.with_(precision="bf16")
    # before: the prior prices them the same (no assumption about bf16)
    before = calibrate([_observe(fp32, truth)], FACTS, CPU, 1, PRIOR)
    assert before.predict(bf16, FACTS, CPU, 1).step_time_s <= 1.1 * before.predict(fp32, FACTS, CPU, 1).step_time_s
    after = calibrate([_observe(fp32, truth), _observe(bf16, truth)], FACTS, CPU, 1, PRIOR)
    assert after.coefficients.efficiency("bf16") < 0.3 * after.coefficients.efficiency("fp32")
    for m in (1, 2, 8):
        other_fp32 = Config(micro_batch_size=m, grad_accum_steps=16 // m)
        other_bf16 = other_fp32.with_(precision="bf16")
        assert (
            after.predict(other_bf16, FACTS, CPU, 1).step_time_s
            > 2 * after.predict(other_fp32, FACTS, CPU, 1).step_time_s
        )


def test_a_device_faster_than_its_nominal_flops_is_learned() -> None:
    """A CPU whose nominal FLOP/s counts AVX2 FMAs runs bf16 on AVX-512-BF16 units several times faster: the
    fitted efficiency goes past 1 (achieved over nominal) and the probes are predicted as they ran."""
    truth = PRIOR.with_(compute_efficiency={"fp32": 0.9, "bf16": 2.3, "fp16": 0.35})
    observed = [_observe(c, truth) for c in CONFIGS] + [_observe(c.with_(precision="bf16"), truth) for c in CONFIGS]
    fitted = calibrate(observed, FACTS, CPU, 1, PRIOR)
    assert fitted.coefficients.efficiency("bf16") > 1.0
    for config in (CONFIGS[0].with_(precision="bf16"), CONFIGS[-1].with_(precision="bf16")):
        want = predict(config, FACTS, CPU, 1, truth).step_time_s
        assert fitted.predict(config, FACTS, CPU, 1).step_time_s == pytest.approx(want, rel=0.05), config.label()


def test_unmeasured_dtype_moves_with_the_measured_one() -> None:
    fitted = fit_time([_observe(CONFIGS[0], _truth())], FACTS, CPU, 1, PRIOR)
    ratio = fitted.efficiency("fp32") / PRIOR.efficiency("fp32")
    assert ratio < 0.9
    assert fitted.efficiency("bf16") / PRIOR.efficiency("bf16") == pytest.approx(ratio)


def test_memory_scale_is_a_robust_ratio() -> None:
    truth = _truth()
    observations = [_observe(c, truth) for c in CONFIGS[:5]]
    # one wild measurement does not move the median much
    wild = observations[0]
    observations[0] = Observation(wild.config, "ok", wild.peak_bytes * 10, wild.step_time_s, wild.budget_bytes)
    fitted = fit_memory(observations, FACTS, CPU, 1, PRIOR)
    assert fitted.global_scale == pytest.approx(1.4, rel=0.02)


def test_memory_scale_is_clamped() -> None:
    config = CONFIGS[0]
    p = predict(config, FACTS, CPU, 1, PRIOR)
    huge = Observation(config, "ok", p.peak_bytes * 1000, 1.0, CPU.memory_bytes)
    assert fit_memory([huge], FACTS, CPU, 1, PRIOR).scale_for(config) == SCALE_RANGE[1]


def test_an_oom_makes_its_config_and_bigger_ones_not_fit() -> None:
    """The prior says it fits; the probe ran out of memory: afterwards it and larger configs are pruned."""
    config = Config(micro_batch_size=4, grad_accum_steps=4)
    budget = int(predict(config, FACTS, CPU, 1, PRIOR).peak_bytes * 1.2)
    small = CPU.with_memory(budget)
    assert predict(config, FACTS, small, 1, PRIOR).fits
    oom = Observation(config, "oom", budget, 0.0, budget)
    fitted = calibrate([oom], FACTS, small, 1, PRIOR)
    assert not fitted.predict(config, FACTS, small, 1).fits
    assert not fitted.predict(config.with_(micro_batch_size=8, grad_accum_steps=2), FACTS, small, 1).fits


def test_two_ooms_of_one_family_do_not_condemn_another() -> None:
    """bf16 + Lion ran out of memory twice; fp32 SGD, another family, still fits as predicted."""
    lion = Config(micro_batch_size=4, grad_accum_steps=4, precision="bf16", optimizer="lion")
    sgd = Config(micro_batch_size=4, grad_accum_steps=4, precision="fp32", optimizer="sgd")
    budget = int(max(predict(c, FACTS, CPU, 1, PRIOR).peak_bytes for c in (lion, sgd)) * 1.2)
    small = CPU.with_memory(budget)
    ooms = [Observation(lion, "oom", budget, 0.0, budget),
            Observation(lion.with_(micro_batch_size=2, grad_accum_steps=8), "oom", budget, 0.0, budget)]
    fitted = calibrate(ooms, FACTS, small, 1, PRIOR)
    assert not fitted.predict(lion, FACTS, small, 1).fits
    assert fitted.predict(sgd, FACTS, small, 1).fits
    # a neighbour differing in one key (bf16 SGD) is raised part of the way, not all of it
    base = predict(sgd.with_(precision="bf16"), FACTS, small, 1, PRIOR).peak_bytes
    raised = fitted.predict(sgd.with_(precision="bf16"), FACTS, small, 1).peak_bytes
    assert base < raised


def test_a_measured_family_is_corrected_and_an_unmeasured_one_moves_toward_the_global_ratio() -> None:
    adamw = [Config(micro_batch_size=m, grad_accum_steps=16 // m) for m in (1, 2, 4)]
    sgd = Config(micro_batch_size=2, grad_accum_steps=8, optimizer="sgd")
    # AdamW's peaks run 30% over the model; one SGD probe runs 10% under it
    observed = [_observe_scaled(c, 1.3) for c in adamw] + [_observe_scaled(sgd, 0.9)]
    fitted = calibrate(observed, FACTS, CPU, 1, PRIOR)

    def ratio(config: Config) -> float:
        return fitted.predict(config, FACTS, CPU, 1).peak_bytes / predict(config, FACTS, CPU, 1, PRIOR).peak_bytes

    assert ratio(adamw[0].with_(micro_batch_size=8, grad_accum_steps=2)) == pytest.approx(1.3, rel=0.03)
    assert ratio(sgd.with_(micro_batch_size=4, grad_accum_steps=4)) == pytest.approx(0.9, abs=0.1)
    lion = sgd.with_(optimizer="lion")  # never probed: between its neighbours, near the global median 1.3
    assert 0.9 < ratio(lion) <= 1.3


def _observe_scaled(config: Config, scale: float) -> Observation:
    p = predict(config, FACTS, CPU, 1, PRIOR)
    return Observation(config, "ok", int(p.peak_bytes * scale), p.step_time_s, CPU.memory_bytes)


def test_errors_and_timeouts_without_a_bound_carry_no_information() -> None:
    bad = [Observation(c, s, 0, 0.0, CPU.memory_bytes) for c, s in zip(CONFIGS, ("error", "timeout"), strict=False)]
    result = calibrate(bad, FACTS, CPU, 1, PRIOR)
    assert result.coefficients == PRIOR
    assert result.n_observations == 0


def test_a_timeout_of_an_unmeasured_dtype_makes_it_at_least_that_slow() -> None:
    """fp32 measured, then a bf16 probe timed out (a CPU that emulates bf16): every bf16 config is priced at
    least as slow as the timeout proves, fp32 stays as measured; a timeout beside measured fp32 steps moves nothing."""
    fp32 = [c for c in CONFIGS if c.precision == "fp32"]
    bf16 = next(c for c in CONFIGS if c.precision == "bf16")
    measured = [_observe(c, PRIOR) for c in fp32]
    bound = 100 * predict(bf16, FACTS, CPU, 1, PRIOR).step_time_s
    timeout = Observation(bf16, "timeout", 0, 0.0, CPU.memory_bytes, time_lower_bound_s=bound)
    without, with_ = (calibrate(measured + extra, FACTS, CPU, 1, PRIOR) for extra in ([], [timeout]))
    assert with_.predict(bf16, FACTS, CPU, 1).step_time_s == pytest.approx(bound, rel=1e-6)
    for c in fp32:
        assert with_.predict(c, FACTS, CPU, 1).step_time_s == pytest.approx(without.predict(c, FACTS, CPU, 1).step_time_s)
    fp32_timeout = Observation(fp32[0], "timeout", 0, 0.0, CPU.memory_bytes, time_lower_bound_s=100 * bound)
    assert calibrate(measured + [fp32_timeout], FACTS, CPU, 1, PRIOR).coefficients == without.coefficients


def test_observation_round_trips_through_a_dict() -> None:
    obs = _observe(CONFIGS[3], _truth())
    data = {
        "config": obs.config.to_dict(),
        "status": "ok",
        "peak_bytes": obs.peak_bytes,
        "step_time_s": obs.step_time_s,
        "budget_bytes": obs.budget_bytes,
    }
    assert Observation.from_dict(data) == obs


def _observe_split(config: Config, truth: Calibration) -> Observation:
    """A probe that timed the update apart: ``truth`` prices the step, its update is the optimizer term."""
    p = truth.predict(config, FACTS, CPU, 1)
    update = p.time_breakdown["optimizer"]
    return Observation(config, "ok", p.peak_bytes, p.step_time_s, CPU.memory_bytes, update)


def test_a_timed_update_calibrates_that_optimizer_alone() -> None:
    """One probe of a slow optimizer (a Python Lion on a CPU) makes Lion slow, and only Lion."""
    truth = Calibration(coefficients=_truth(), time_factors={"lion": 8.0})
    adamw = Config(micro_batch_size=4, grad_accum_steps=4)
    lion = Config(micro_batch_size=1, grad_accum_steps=16, optimizer="lion")
    fitted = calibrate([_observe_split(adamw, truth), _observe_split(lion, truth)], FACTS, CPU, 1, PRIOR)
    for m in (1, 2, 8):
        for optimizer in ("adamw", "lion"):
            config = Config(micro_batch_size=m, grad_accum_steps=16 // m, optimizer=optimizer)
            want = truth.predict(config, FACTS, CPU, 1).step_time_s
            assert fitted.predict(config, FACTS, CPU, 1).step_time_s == pytest.approx(want, rel=0.05), config.label()
    # an optimizer no probe ran moves with the measured ones
    assert "sgd" not in fitted.time_factors
    lion, adamw = fitted.time_factors["lion"], fitted.time_factors["adamw"]
    assert fitted.default_time_factor == pytest.approx((lion * adamw) ** 0.5)


def test_the_optimizer_factor_moves_only_the_update() -> None:
    calibration = Calibration(coefficients=PRIOR, time_factors={"adamw": 3.0})
    config = Config(micro_batch_size=2, grad_accum_steps=8)
    plain = predict(config, FACTS, CPU, 1, PRIOR)
    scaled = calibration.predict(config, FACTS, CPU, 1)
    assert scaled.time_breakdown["optimizer"] == pytest.approx(3.0 * plain.time_breakdown["optimizer"])
    assert scaled.time_breakdown["compute"] == plain.time_breakdown["compute"]
    assert scaled.step_time_s == pytest.approx(plain.step_time_s + 2.0 * plain.time_breakdown["optimizer"])
    assert scaled.samples_per_s == pytest.approx(16 / scaled.step_time_s)
