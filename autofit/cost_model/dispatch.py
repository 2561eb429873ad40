"""The host side of a CUDA step: what the CPU spends dispatching it, which bounds the step where the GPU's work is
short (on an H200, ZeRO-3 at micro-batch 1 of a 0.5 B model takes 0.5 s a step for 4 ms of matmuls;
docs/results/gpu-truth.md).

PyTorch runs eagerly: every op the step dispatches costs the host its Python, its dispatch and (most) a kernel
launch before the GPU can run it, and the GPU never waits on work the host has not queued. So each phase takes the
longer of the two (:func:`autofit.cost_model.time.predict_step_time`): the device's kernels, or the host's dispatch:

* **forward and backward**: every op the traced step dispatched (:attr:`PeakPoint.dispatched_ops`, recompute
  included) at :attr:`HostConstants.op_s`; DeepSpeed's gradient hooks, one a trainable tensor
  (:attr:`HostConstants.backward_tensor_s`, by ZeRO stage); under ZeRO-3 the fetch and release hooks of every
  module that holds parameters, in forward and backward (partitioned_param_coordinator.py ``fetch_sub_module`` and
  ``release_sub_module``, :attr:`HostConstants.module_s`);
* **optimizer**: ``engine.step``'s work per trainable tensor (the 16-bit optimizer's copies, the clipping norm, the
  fused optimizer's per-tensor launches; :attr:`HostConstants.optimizer_tensor_s`) and its fixed part.

The constants are measured on the GPU machine by a micro-benchmark of their own (``benchmarks/gpu/gpu_check_host.py``:
stacks of small Linear + ReLU layers at two depths, plain autograd and through ``deepspeed.initialize`` at ZeRO 0-3;
the slope between the depths is the cost a layer, the intercept the fixed part), never fitted to the training rows
they are judged on (:func:`fit_host_constants`). Per op, the slope of plain autograd over the ops such a layer
dispatches, counted as the trace counts them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autofit.core.config import Config
from autofit.cost_model.facts import ModelFacts


@dataclass(frozen=True)
class HostConstants:
    """Host seconds of one CUDA machine's CPU (with its PyTorch and DeepSpeed), each from the micro-benchmark."""

    op_s: float
    """An op dispatched in forward or backward: Python, autograd, the dispatcher, the launch."""
    backward_tensor_s: Mapping[int, float]
    """DeepSpeed's backward work a trainable tensor, by ZeRO stage (its gradient hooks)."""
    optimizer_tensor_s: Mapping[int, float]
    """``engine.step``'s work a trainable tensor, by ZeRO stage."""
    optimizer_fixed_s: Mapping[int, float]
    """``engine.step``'s fixed part, by ZeRO stage."""
    module_s: float
    """ZeRO-3's fetch and release hooks of one parameter-holding module, forward and backward together."""
    source: str
    """Where the measurement is."""


@dataclass(frozen=True)
class HostTime:
    """Host seconds of one optimizer step, by phase."""

    forward_backward_s: float
    optimizer_s: float


def host_step_time(config: Config, facts: ModelFacts, constants: HostConstants) -> HostTime:
    """The host's seconds of one optimizer step of ``config`` (module docstring); 0 where the trace counted no op."""
    ops = dispatched_ops(config, facts)
    if ops <= 0:
        return HostTime(0.0, 0.0)
    stage = config.zero_stage
    per_micro = ops * constants.op_s + facts.n_param_tensors * constants.backward_tensor_s.get(stage, 0.0)
    if stage == 3:
        per_micro += facts.n_param_modules * constants.module_s
    optimizer = (facts.n_param_tensors * constants.optimizer_tensor_s.get(stage, 0.0)
                 + constants.optimizer_fixed_s.get(stage, 0.0))
    return HostTime(forward_backward_s=config.grad_accum_steps * per_micro, optimizer_s=optimizer)


def dispatched_ops(config: Config, facts: ModelFacts) -> float:
    """Ops one micro-batch dispatches at ``config``'s checkpointing (the same at every micro-batch: read at the first
    traced size, where no extrapolation scales it)."""
    dtype, granularity = config.trace_dtype, config.checkpoint_granularity
    try:
        profile = facts.profile(dtype, config.attention, False, granularity)
    except KeyError:
        return 0.0
    traced = profile.points[0].micro_batch_size
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    return facts.at_checkpointed(dtype, config.attention, n_ckpt, traced, "dispatched_ops", granularity)


def fit_host_constants(bench: Mapping[str, Any], ops_per_layer: float, source: str) -> HostConstants:
    """The constants of :func:`host_step_time` from one run of ``benchmarks/gpu/gpu_check_host.py`` (its JSON ``bench``):
    slopes between the two depths of its stacks; ``ops_per_layer``: the ops one of its layers dispatches in forward
    and backward, counted as the trace counts them. A negative slope (noise) is 0."""
    depths = sorted(int(d) for d in bench["mlp"])
    short, long = depths[0], depths[-1]
    span = long - short
    tensors = bench["mlp"][str(long)]["tensors"] / long  # trainable tensors a layer (weight, bias)

    def slope(values: Mapping[int, float]) -> float:
        return (values[long] - values[short]) / span

    autograd = slope({d: bench["mlp"][str(d)]["step_s"] for d in depths})
    backward: dict[int, float] = {}
    optimizer: dict[int, float] = {}
    fixed: dict[int, float] = {}
    module = 0.0
    for stage in (0, 1, 2, 3):
        runs = {d: bench["engine"][f"z{stage}_L{d}"] for d in depths}
        step = slope({d: r["step_s"] for d, r in runs.items()})
        opt = slope({d: r["optimizer_s"] for d, r in runs.items()})
        hooks = max(0.0, step - opt - autograd)
        optimizer[stage] = max(0.0, opt) / tensors
        fixed[stage] = max(0.0, runs[short]["optimizer_s"] - short * opt)
        if stage == 3:
            module, backward[stage] = hooks, 0.0  # one module a layer: its hooks are the module's
        else:
            backward[stage] = hooks / tensors
    return HostConstants(op_s=autograd / ops_per_layer, backward_tensor_s=backward, optimizer_tensor_s=optimizer,
                         optimizer_fixed_s=fixed, module_s=module, source=source)


#: the benchmark's run on an H200 machine of 16 CPU cores (PyTorch 2.11+cu130, DeepSpeed 0.19.8), the results file
#: ``source`` names (steps.host.result), through :func:`fit_host_constants` with the 16 ops a layer of the benchmark
#: dispatches (tests/cost_model/test_dispatch.py derives both again; docs/results/gpu-truth.md). No other machine's
#: CPU is measured: these constants stand for every CUDA machine until one is.
MEASURED_H200_MACHINE = HostConstants(
    op_s=8.278e-06,
    backward_tensor_s={0: 1.399e-05, 1: 2.857e-04, 2: 4.661e-04, 3: 0.0},
    optimizer_tensor_s={0: 1.267e-04, 1: 2.067e-04, 2: 1.062e-04, 3: 6.377e-05},
    optimizer_fixed_s={0: 2.181e-03, 1: 0.0, 2: 6.015e-03, 3: 1.498e-03},
    module_s=2.277e-03,
    source="benchmarks/results/gpu_check/h200_2026-11-28_run2.json",
)
