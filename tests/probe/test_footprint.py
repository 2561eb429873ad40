"""A model's kernel footprint on a CPU device, measured in a fresh process (autofit.probe.footprint), and
how the plan prices it. Real subprocesses, real kernels: no mocks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.core.recipe import Recipe
from autofit.core.space import space_from_dict
from autofit.cost_model import Coefficients, predict
from autofit.cost_model.facts import footprint_key
from autofit.machine.device import get_hardware
from autofit.planning.plan import Plan, trace_for, with_kernel_footprints
from autofit.probe.footprint import forget_measured, measured_footprint_bytes, measured_footprints
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec
from autofit.workload.entry import load_workload

#: the recipe the tests' space is written for
SGD_FP32 = Recipe("sgd", "fp32")

HERE = Path(__file__).resolve().parent
MIB = 2**20

pytestmark = pytest.mark.slow


def entry(name: str) -> str:
    return f"{HERE / 'probe_workloads.py'}:{name}"


def fp32_sgd_space() -> dict:
    return {"global_batch_size": 4, "micro_batch_size": [4], "checkpoint_ratio": [0.0], "precision": ["fp32"],
            "optimizer": ["sgd"], "zero_stage": [0], "attention": ["sdpa"]}


def test_a_convolution_leaves_more_kernel_code_resident_than_a_multilayer_perceptron() -> None:
    mlp = measured_footprint_bytes(entry("tiny"), "fp32", "sdpa")
    convnet = measured_footprint_bytes(entry("convnet"), "fp32", "sdpa")
    assert mlp is not None and convnet is not None
    # a first matmul forward and backward maps MiBs of MKL's and libtorch's code; oneDNN's convolutions more
    assert mlp > MIB
    assert convnet > mlp + MIB


def test_a_cpu_plan_prices_the_models_measured_footprint_in_place_of_the_default() -> None:
    workload = load_workload(entry("convnet"))
    space = space_from_dict(fp32_sgd_space(), name="fp32")
    cpu = get_hardware("cpu")
    plan = Plan.make(entry("convnet"), workload, cpu, space, recipe=SGD_FP32)
    measured = plan.facts.kernel_footprint_bytes
    assert "fp32" in measured and set(measured) <= {"fp32", footprint_key("fp32", True)}
    config = plan.candidates[0]
    unmeasured = replace(plan.facts, kernel_footprint_bytes={})
    default = Coefficients.for_hardware(cpu).kernel_footprint_bytes
    moved = predict(config, plan.facts, cpu, 1).peak_bytes - predict(config, unmeasured, cpu, 1).peak_bytes
    assert moved == measured["fp32"] - default


def test_a_gpu_plan_measures_no_footprint_and_a_failed_measurement_keeps_the_default() -> None:
    workload = load_workload(entry("tiny"))
    space = space_from_dict(fp32_sgd_space(), name="fp32")
    gpu_plan = Plan.make(entry("tiny"), workload, get_hardware("h100-80gb"), space, recipe=SGD_FP32)
    assert gpu_plan.facts.kernel_footprint_bytes == {}
    # an entry point that cannot load: the measurement fails, and the facts stay as they were
    assert measured_footprint_bytes(entry("broken"), "fp32", "sdpa") is None
    assert with_kernel_footprints(gpu_plan.facts, entry("broken"), list(gpu_plan.candidates)) == gpu_plan.facts


def test_checkpointing_leaves_the_unwinders_pages_resident_beside_the_models_kernels() -> None:
    """Non-reentrant checkpointing ends each recompute by raising ``_StopRecomputationError`` through libtorch's C++
    frames (torch/utils/checkpoint.py, early stop); the unwinder's tables it reads stay mapped, so the same model
    run checkpointed after its plain run leaves more resident, though it calls no kernel the plain run did not."""
    found = measured_footprints(entry("tiny"), "fp32", "sdpa")
    assert found is not None
    assert found[footprint_key("fp32", True)] > found[footprint_key("fp32", False)] + MIB


def test_checkpointing_moves_the_predicted_peak_as_much_as_the_measured_one() -> None:
    """The tiny MLP probed at ZeRO-0 with and without checkpointing: its activations are a few KiB, so what
    checkpointing changes in the measured peak is the runtime beside the tensors (the unwinder's pages, above),
    and the prediction must move with it. Priced with the plain run's footprint for both, it moved by the
    activations alone, and a runtime constant fitted over checkpointed and plain rows alike overpriced every
    plain one (issue 39's small copies: ZeRO-0 without checkpointing 10-16% over)."""
    cpu = get_hardware("cpu")
    configs = [Config(precision="fp32", zero_stage=0, optimizer="adamw", micro_batch_size=4, checkpoint_ratio=ratio,
                      attention="sdpa") for ratio in (0.0, 1.0)]
    facts = with_kernel_footprints(trace_for(load_workload(entry("tiny")), configs), entry("tiny"), configs)
    measured = []
    for config in configs:
        result = run_probe(probe_spec(entry("tiny"), config, cpu, 1, steps=1, warmup_steps=1), timeout_s=300.0)
        assert result.status == "ok", result.message
        measured.append(result.peak_bytes)
    predicted = [predict(config, facts, cpu, 1).peak_bytes for config in configs]
    assert measured[1] - measured[0] > MIB  # what checkpointing costs here is not the activations'
    assert predicted[1] - predicted[0] == pytest.approx(measured[1] - measured[0], abs=MIB)


def test_a_footprint_is_kept_in_the_cache_and_read_back_for_the_same_model(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured once a model and machine: a plan of the same model reads it back instead of measuring again (the
    entry is edited here to tell a read from a measurement); another model is measured."""
    import json

    from autofit.probe.footprint import footprints_for

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOFIT_NO_CACHE", "0")  # the tests' default is off
    forget_measured()
    first = footprints_for(entry("tiny"), ("fp32",), "sdpa", model_digest="a")
    entries = list((tmp_path / "traces").glob("footprint-*.json"))
    assert first and len(entries) == 1
    kept = json.loads(entries[0].read_text())
    assert kept["footprints"] == first
    kept["footprints"] = {key: value + 1 for key, value in first.items()}
    entries[0].write_text(json.dumps(kept))
    forget_measured()
    assert footprints_for(entry("tiny"), ("fp32",), "sdpa", model_digest="a") == kept["footprints"]
    assert footprints_for(entry("tiny"), ("fp32",), "sdpa", model_digest="b") != kept["footprints"]  # measured
    assert len(list((tmp_path / "traces").glob("footprint-*.json"))) == 2


def test_a_plans_footprints_are_measured_while_its_trace_runs_and_none_outlives_the_plan() -> None:
    """The trace starts the measurement (its ``before_tracing``) before its own steps: when it returns, the process
    has been running beside it; what it measures is what a measurement after the trace finds (the same kernels), and
    one never taken is killed when the plan ends."""
    import psutil

    from autofit.probe.footprint import PendingFootprints
    from autofit.trace import trace_workload

    workload = load_workload(entry("convnet"))
    forget_measured()  # what an earlier test measured in this process would not be measured again
    with PendingFootprints(entry("convnet"), ("fp32", "bf16"), "sdpa", most_params=10**9) as pending:
        trace_workload(workload, before_tracing=pending.start)
        assert pending.has("fp32", "sdpa") and pending.has("bf16", "sdpa") and not pending.has("fp32", "eager")
        beside = pending.take("fp32", "sdpa")
        assert len(psutil.Process().children()) == 1  # bf16's, not taken
    assert psutil.Process().children() == []
    with PendingFootprints(entry("convnet"), ("fp32",), "sdpa", most_params=10**9) as again:
        again.start(n_params=1)
        assert not again.has("fp32", "sdpa")  # measured in this process already: nothing started
    forget_measured()
    after = measured_footprints(entry("convnet"), "fp32", "sdpa")
    assert beside is not None and after is not None and beside.keys() == after.keys()
    for key, value in after.items():
        assert beside[key] == pytest.approx(value, abs=MIB)


def test_a_model_past_the_footprints_parameter_limit_is_not_built_for_real() -> None:
    """The measuring process counts the model's parameters on the meta device before it builds it: past the limit
    it measures nothing (a plan started it before its trace knew the model's size)."""
    from autofit.probe.footprint import PendingFootprints

    forget_measured()  # what an earlier test measured in this process would not be measured again
    with PendingFootprints(entry("convnet"), ("fp32",), "sdpa", most_params=10) as pending:
        pending.start(n_params=1)  # what the caller said: within the limit; the process counts for itself
        assert pending.has("fp32", "sdpa") and pending.take("fp32", "sdpa") is None
    with PendingFootprints(entry("convnet"), ("fp32",), "sdpa", most_params=10) as pending:
        pending.start(n_params=11)  # past it: nothing starts
        assert not pending.has("fp32", "sdpa")
