"""The host side of a CUDA step (autofit/cost_model/dispatch.py): the trace counts the ops a real step dispatches,
the host constants are what the committed GPU micro-benchmark gives, and a CUDA plan is host-bound where the GPU's
work is short (issue 48: ZeRO-3 at micro-batch 4 ran 5x under the device-only prediction on an H100)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autofit.core.config import Config
from autofit.cost_model.dispatch import MEASURED_H200_MACHINE, fit_host_constants, host_step_time
from autofit.planning.target import Target, prepare
from autofit.trace.step import trace_step
from autofit.trace.traffic import _is_matmul, _moves_nothing
from autofit.workload.entry import load_workload

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


class Dispatched(TorchDispatchMode):
    """Counts the ops a step dispatches on real tensors, and those that run a kernel (not a view or allocation)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        self.kernels += int(_is_matmul(func) or not _moves_nothing(func))
        return func(*args, **(kwargs or {}))


def test_the_trace_counts_the_ops_and_kernels_an_eager_step_dispatches() -> None:
    """On fake tensors the trace sees metadata queries (``prim.device``) a real step never dispatches: counted as they
    were, a Qwen2 layer's 116 kernels read as 600. The trace's counts are the real step's."""
    workload = load_workload(f"hf:{EXAMPLES}/hf_configs/llama_gqa?seq_len=64")
    traced = trace_step(workload, 1, "fp32", "sdpa", (0.0, "block"), "fake")
    model = workload.build_model(attention="sdpa")
    batch = workload.batch(1)
    counter = Dispatched()
    with counter:
        workload.compute_loss(model, batch).backward()
    assert traced.kernels == pytest.approx(counter.kernels, rel=0.03)
    assert traced.dispatched_ops == pytest.approx(counter.ops, rel=0.03)
    assert traced.kernels < traced.dispatched_ops


def test_the_host_constants_are_what_the_committed_gpu_micro_benchmark_gives() -> None:
    """MEASURED_H200_MACHINE is fit_host_constants of the committed H200 run, with the ops a layer of its stack
    dispatches counted here as the trace counts them."""
    run = json.loads((ROOT / MEASURED_H200_MACHINE.source).read_text())
    bench = run["steps"]["host"]["result"]
    per_layer = []
    for depth in (16, 64):
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers).to(torch.bfloat16)
        counter = Dispatched()
        with counter:
            model(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        per_layer.append(counter.ops)
    ops_per_layer = (per_layer[1] - per_layer[0]) / 48
    fitted = fit_host_constants(bench, ops_per_layer, MEASURED_H200_MACHINE.source)
    assert fitted.op_s == pytest.approx(MEASURED_H200_MACHINE.op_s, rel=1e-3)
    assert fitted.module_s == pytest.approx(MEASURED_H200_MACHINE.module_s, rel=1e-3)
    for stage in range(4):
        assert fitted.optimizer_tensor_s[stage] == pytest.approx(MEASURED_H200_MACHINE.optimizer_tensor_s[stage],
                                                                 rel=1e-3, abs=1e-9)
        assert fitted.backward_tensor_s[stage] == pytest.approx(MEASURED_H200_MACHINE.backward_tensor_s[stage],
                                                                rel=1e-3, abs=1e-9)


@pytest.fixture(scope="module")
def h100_plan():  # type: ignore[no-untyped-def]
    target = Target(entry=f"hf:{EXAMPLES}/hf_configs/llama_gqa", seq_len=64, hardware="h100-80gb", gpus=1,
                    global_batch=1, optimizer="adamw", precision="bf16",
                    set_values=("attention=sdpa", "compile=off", "offload_optimizer=none", "offload_params=none"))
    return prepare(target).plan()


@pytest.mark.slow
def test_a_small_micro_batch_on_a_gpu_is_bound_by_the_host_and_zero3_pays_its_module_hooks(h100_plan) -> None:  # type: ignore[no-untyped-def]
    def priced(stage: int) -> object:
        config = Config(micro_batch_size=1, precision="bf16", zero_stage=stage, optimizer="adamw", attention="sdpa")
        return h100_plan.predict(config)

    z0, z3 = priced(0), priced(3)
    assert z0.time_breakdown["host"] > z0.time_breakdown["compute"]  # a tiny model's step: the host is the bound
    assert z3.step_time_s > z0.step_time_s  # ZeRO-3's fetch and release hooks, one set a module
    facts = h100_plan.facts
    config = Config(micro_batch_size=1, precision="bf16", zero_stage=3, optimizer="adamw", attention="sdpa")
    hooks = facts.n_param_modules * MEASURED_H200_MACHINE.module_s
    assert host_step_time(config, facts, MEASURED_H200_MACHINE).forward_backward_s > hooks > 0


@pytest.mark.slow
def test_the_host_adds_nothing_on_the_cpu() -> None:
    target = Target(entry=f"{EXAMPLES}/mlp.py:workload", hardware="cpu", gpus=1, global_batch=4,
                    set_values=("zero_stage=0", "micro_batch_size=4"))
    plan = prepare(target).plan()
    assert all(plan.predict(c).time_breakdown["host"] == 0.0 for c in plan.candidates[:5])
