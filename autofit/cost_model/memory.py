"""Peak memory of one training process: model states, activations and runtime buffers.

The peak is the largest of four phases (docs/design.md, "Memory, measured": from model
construction through the measured steps):

* **init** -- the model as built on the device, plus what ``deepspeed.initialize``
  copies while it flattens and partitions parameters (ZeRO keeps the old and the new
  storage alive together for a moment). Where the model is built depends on the
  stage: ZeRO 0-2 build the fp32 model on the host and DeepSpeed casts it to the
  working precision there and moves it (engine.py ``_configure_distributed_model``),
  so a GPU sees ``w x Psi``; ZeRO-3 builds under ``deepspeed.zero.Init``, which
  partitions each module's parameters as soon as its ``__init__`` returns
  (partition_parameters.py ``Init._post_init_method``), so a rank holds its
  partition plus one module whole. A CPU device is the process that builds the
  fp32 model (ZeRO 0-2: ``4 x Psi`` in it). 16-bit ZeRO-0 ends ``initialize`` with
  one optimizer step on zero gradients (``initialize_optimizer_states``), so its
  states exist already. Of the runtime's own memory only the communicator's is held
  yet (``Coefficients.runtime_at_init_bytes``).
* **backward** -- resident states (parameters, fp32 master copy, optimizer
  states, gradient buffers DeepSpeed keeps) plus the traced peak of live
  activations and gradients during forward+backward.
* **reduce** -- ZeRO-3 only: the end of backward, when the last gradient bucket is
  reduce-scattered through a flat copy of itself (:func:`stage3_reduce_scratch_bytes`).
* **step** -- resident states plus every gradient, plus the largest temporary of
  the optimizer step: DeepSpeed's flattened gradient bucket or fp32 gradient
  partition, or the optimizer's own scratch (``transient_bytes_per_element``).

Model-state bytes per parameter follow the ZeRO paper (Rajbhandari et al. 2020,
sec. 3 and 5: 2Psi + 2Psi + K*Psi with K = 12 for mixed-precision Adam, the
optimizer part divided by N_d under P_os, gradients too under P_os+g, and
everything under P_os+g+p). DeepSpeed's concrete buffers on top of the paper are
named where they are added; their sources are deepspeed/runtime/zero/stage_1_and_2.py,
stage3.py and fp16/fused_optimizer.py. Each was measured by reading a probe's resident
memory phase by phase (build, ``initialize``, forward, backward, step) against
:func:`memory_phases`, on the rows of benchmarks/accuracy/memory_accuracy.py: docs/results/memory.md
("What changed") gives each reading, and tests/probe/test_probe.py checks the init and
ZeRO-3 reduce phases against a probe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from autofit.core.config import WORKING_BYTES, Config
from autofit.core.hardware import Hardware
from autofit.cost_model.allocation_sequence import reserve_bytes
from autofit.cost_model.coefficients import Coefficients
from autofit.cost_model.cuda_runtime import (
    cublas_workspace_bytes,
    outside_allocator_bytes,
    runtime_bytes,
    training_workspace_bytes,
)
from autofit.cost_model.facts import ModelFacts, footprint_key
from autofit.cost_model.fp8 import fp8_cast_bytes
from autofit.cost_model.long_context import any_long_context, long_context_activation_bytes
from autofit.cost_model.states import model_states


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device at the peak, by what holds them. ``total`` is their sum."""

    params: int
    """Model parameters in the working precision (the shard under ZeRO-3, plus gathered ones)."""
    grads: int
    """Gradients and DeepSpeed's gradient buffers (buckets, fp32 partitions)."""
    optimizer: int
    """Optimizer states, the fp32 master copy for 16-bit training, and the step's scratch."""
    activations: int
    """Tensors saved for backward and the temporaries of forward/backward, from the trace."""
    other: int
    """The runtime: CUDA context, allocator and thread-pool overhead, the model's buffers; on a GPU, what the caching
    allocator holds cached at its peak beyond the live tensors."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def to_dict(self) -> dict[str, int]:
        """The parts by name, in field order: ``dataclasses.asdict`` without its deep copy (once a candidate)."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other}


def activation_peak_bytes(config: Config, facts: ModelFacts, keep_grads: bool) -> float:
    """Peak live bytes of forward+backward from the trace, at this micro-batch and checkpoint ratio.

    Checkpointing the first k of L layers is interpolated between the traces with
    none, some (the space's middle ratio) and all layers checkpointed, at the config's granularity
    (the whole block, or only its attention: that granularity's own traces; :meth:`ModelFacts.at_checkpointed`).
    ``keep_grads``: gradients stay where autograd puts them (plain PyTorch, ZeRO 0/1)
    rather than being moved out as they are produced (ZeRO-2/3).
    """
    grads = "with_grads" if keep_grads else "without_grads"
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    def at(part: str) -> float:
        return facts.at_checkpointed(config.trace_dtype, config.attention, n_ckpt, config.micro_batch_size,
                                     f"{part}peak_{grads}_bytes", config.checkpoint_granularity)

    if not any_long_context(config):
        return at("")
    # SP, tiling, offload (cost_model/long_context.py): the head's and the layers' parts only where they are used
    return long_context_activation_bytes(config, facts, at(""), at("head_"), at("body_"))


def accumulated_grad_bytes(config: Config, facts: ModelFacts, world_size: int) -> float:
    """Gradient bytes held from one micro-batch through the next ones' forward and backward (accumulation).

    ZeRO 0 and 1: autograd's ``.grad`` of every parameter (ZeRO-1 reduces only at the accumulation boundary;
    stage_1_and_2.py ``use_grad_accum_attribute`` is off when the gradients are in the working precision);
    ZeRO-2: the rank's partition ``grads_in_partition`` (``copy_grads_in_partition``, in the working precision);
    ZeRO-3: its gradient partition is resident already (``grads_resident``)."""
    w = WORKING_BYTES[config.precision]
    psi = float(facts.n_trainable_params)
    if config.zero_stage in (0, 1):
        return w * psi
    if config.zero_stage == 2:
        return w * psi / world_size
    return 0.0


def predict_memory(
    config: Config, facts: ModelFacts, hardware: Hardware, world_size: int, coefficients: Coefficients
) -> MemoryBreakdown:
    """The peak over the init, backward and step phases, split by what holds the bytes. On a GPU the caching
    allocator's reserve at its peak (:func:`autofit.cost_model.allocation_sequence.reserve_bytes`) is part of
    ``other``: NVML sees the allocator's reserved peak, the allocated peak plus what it holds cached there."""
    return bounded_memory(config, facts, hardware, world_size, coefficients, None)[0]


def bounded_memory(
    config: Config, facts: ModelFacts, hardware: Hardware, world_size: int, coefficients: Coefficients,
    exact_within_bytes: int | None, representatives: Mapping[tuple[object, ...], Config] | None = None,
) -> tuple[MemoryBreakdown, bool]:
    """:func:`predict_memory`, and whether it is only a lower bound: on a GPU, a config whose peak without the
    allocator's reserve is already past ``exact_within_bytes`` is not replayed (None: every config is), and its peak
    is that one. The reserve is never negative (a reserved peak holds the allocated one) and the calibration's
    scaling grows with the bytes it scales, so the true peak is past them too: a plan judges what fits exactly and
    replays only the reserves of configs near its budget (docs/results/planning.md); ``representatives``:
    :func:`~autofit.cost_model.allocation_sequence.reserve_bytes`'."""
    peak = max(memory_phases(config, facts, hardware, world_size, coefficients).values(), key=lambda m: m.total)

    def scaled(breakdown: MemoryBreakdown) -> MemoryBreakdown:
        if coefficients.memory_scale == 1.0:
            return breakdown
        fixed = runtime_bytes(hardware, world_size, coefficients.outside_allocator_bytes)  # CUDA's offset; CPU: 0
        return _scaled(breakdown, coefficients.memory_scale, fixed)

    if hardware.kind != "cuda":
        return scaled(peak), False
    if exact_within_bytes is not None and (bound := scaled(peak)).total > exact_within_bytes:
        return bound, True
    reserve = reserve_bytes(config, facts, world_size, workspace=cublas_workspace_bytes(hardware),
                            representatives=representatives)
    return scaled(replace(peak, other=peak.other + reserve)), False


def kernel_footprint_bytes(config: Config, facts: ModelFacts, hardware: Hardware, coefficients: Coefficients) -> int:
    """What the model's kernels hold resident on a CPU device (code pages, oneDNN primitives): the model's own,
    measured (:mod:`autofit.probe.footprint`), else the coefficients' default; nothing on a GPU, whose memory
    holds no code (its context is :attr:`Hardware.context_bytes`).

    A config that checkpoints any layer takes the footprint measured with its layers checkpointed: non-reentrant
    checkpointing (torch/utils/checkpoint.py) stops each recompute by raising ``_StopRecomputationError`` through
    libtorch's C++ frames, which maps the unwinder's tables into the process (:mod:`autofit.probe.footprint`);
    where only the plain run was measured, :attr:`Coefficients.checkpoint_footprint_bytes` is added to it."""
    if hardware.kind != "cpu":
        return 0
    checkpointed = config.checkpointed_layers(facts.n_layers) > 0
    unwinder = coefficients.checkpoint_footprint_bytes if checkpointed else 0
    measured = facts.kernel_footprint_bytes.get(footprint_key(config.trace_dtype, checkpointed))
    if measured is not None:
        return measured
    plain = facts.kernel_footprint_bytes.get(config.trace_dtype)
    if plain is not None:
        return plain + unwinder
    return (coefficients.kernel_footprint_bytes + unwinder
            + (coefficients.runtime_16bit_extra_bytes if config.precision != "fp32" else 0))


#: what ``torch.compile`` (inductor) keeps resident on a CPU device: dynamo, inductor and the compiled graphs' code.
#: Measured with the probe (tests/probe/probe_workloads.py, compile on against off, one gloo rank): ``tiny``
#: (0.6 M parameters) +50 MB at micro-batches 2 and 8 (ZeRO-0, fp32), +41 MB bf16 ZeRO-2, +38 MB bf16 ZeRO-1 half
#: checkpointed; ``medium`` (34 M) +34 MB at 2 and 8 -- a fixed cost, not one that grows with the model or the
#: batch; the largest is taken ...
COMPILED_CPU_RUNTIME_BYTES = 50 * 10**6
#: ... and under ZeRO-3, whose hooks break the graph into more compiled pieces: ``tiny`` at micro-batch 4 +72 MB,
#: +81 MB fully checkpointed
COMPILED_CPU_RUNTIME_BYTES_ZERO3 = 81 * 10**6


def compile_bytes(config: Config, hardware: Hardware) -> int:
    """What ``compile=on`` adds to the runtime: the compiler's resident memory on a CPU device
    (:data:`COMPILED_CPU_RUNTIME_BYTES`, more under ZeRO-3). On a GPU nothing: inductor's graph holds no tensors eager does not
    (its partitioner saves for backward no more than the traced eager step, and fusion frees intermediates),
    so the eager trace is priced as an upper bound and the search's correction learns the compiled family
    apart (``compile`` is one of :data:`autofit.cost_model.memory_correction.FAMILY_KEYS`)."""
    if config.compile != "on" or hardware.kind != "cpu":
        return 0
    return COMPILED_CPU_RUNTIME_BYTES_ZERO3 if config.zero_stage == 3 else COMPILED_CPU_RUNTIME_BYTES


def memory_phases(
    config: Config, facts: ModelFacts, hardware: Hardware, world_size: int, coefficients: Coefficients
) -> dict[str, MemoryBreakdown]:
    """The bytes held at the worst moment of each phase (``init``, ``backward``, ``reduce``, ``step``; module
    docstring)."""
    states = model_states(config, facts, world_size, hardware.kind)
    # CUDA: the context, NCCL's buffers and cuBLAS's workspaces (forward's and backward's), priced or learned
    # (cost_model/cuda_runtime.py); the workspaces come with the first matmuls, after initialize. CPU: the preset's
    # context (0)
    outside = hardware.context_bytes
    workspace = 0
    if hardware.kind == "cuda":
        outside = outside_allocator_bytes(hardware, world_size, coefficients.outside_allocator_bytes)
        workspace = training_workspace_bytes(hardware)
    runtime = int(outside + workspace + coefficients.runtime_overhead_bytes + facts.buffer_bytes
                  + kernel_footprint_bytes(config, facts, hardware, coefficients)
                  + compile_bytes(config, hardware))
    runtime_at_init = int(outside + min(coefficients.runtime_at_init_bytes,
                                        coefficients.runtime_overhead_bytes) + facts.buffer_bytes)
    # plain autograd keeps each gradient where it is produced (ZeRO 0; ZeRO-1, which reduces them only after
    # backward); on a CPU, ZeRO-2's reduce bucket is written as gradients arrive, so it too grows with them
    # while the activations free (a GPU's bucket is reserved whole: grads_resident). With accumulation the
    # first micro-batch's gradients are held through every later forward and backward
    grads_grow = config.zero_stage in (0, 1) or (config.zero_stage == 2 and hardware.kind == "cpu")
    keep_grads = grads_grow and config.grad_accum_steps == 1
    held_grads = accumulated_grad_bytes(config, facts, world_size) if config.grad_accum_steps > 1 else 0.0
    activations = activation_peak_bytes(config, facts, keep_grads)
    return {
        "init": MemoryBreakdown(
            params=int(states.built), grads=0, optimizer=int(states.init_extra), activations=0, other=runtime_at_init
        ),
        "backward": MemoryBreakdown(
            params=int(states.params + states.secondary_params + states.gathered_params),
            grads=int(states.grads_resident + held_grads),
            optimizer=int(states.master + states.optimizer),
            activations=int(activations + fp8_cast_bytes(config, facts)),
            other=runtime,
        ),
        # ZeRO-3's last gradient bucket is reduced when backward is over (stage3.py
        # independent_gradient_partition_epilogue): the activations are freed and so are the gathered
        # parameters, each module's after its own backward (parameter_offload.py post_sub_module_backward_function),
        # but the last module's (states.gathered_at_reduce)
        "reduce": MemoryBreakdown(
            params=int(states.params + states.secondary_params + states.gathered_at_reduce),
            grads=int(states.grads_resident + held_grads + states.reduce_scratch),
            optimizer=int(states.master + states.optimizer),
            activations=0,
            other=runtime,
        ),
        "step": MemoryBreakdown(
            params=int(states.params + states.secondary_params),
            grads=int(states.grads_resident + states.grads_step),
            optimizer=int(states.master + states.optimizer + states.step_scratch),
            activations=0,
            other=runtime,
        ),
    }


def _scaled(breakdown: MemoryBreakdown, scale: float, fixed: int = 0) -> MemoryBreakdown:
    """Calibration applies to the activations and runtime, the parts the formulas know least. ``fixed``: an
    additive term the ratio does not scale (CUDA's runtime, :mod:`autofit.cost_model.cuda_runtime`)."""
    extra = (scale - 1.0) * max(0, breakdown.total - fixed)
    return MemoryBreakdown(
        params=breakdown.params,
        grads=breakdown.grads,
        optimizer=breakdown.optimizer,
        activations=max(0, int(breakdown.activations + extra)),
        other=breakdown.other,
    )
