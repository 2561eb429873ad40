"""A model's kernel footprint on a CPU device, measured in a fresh process (autofit.probe.footprint), and
how the plan prices it. Real subprocesses, real kernels: no mocks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from autofit.core.recipe import Recipe
from autofit.core.space import space_from_dict
from autofit.cost_model import Coefficients, predict
from autofit.machine.device import get_hardware
from autofit.planning.plan import Plan, with_kernel_footprints
from autofit.probe.footprint import measured_footprint_bytes
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
    assert set(measured) == {"fp32"}
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
