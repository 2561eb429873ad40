"""Step time: compute, recompute, communication, offload traffic and fixed overheads.

Per optimizer step of ``a`` micro-batches on ``N_d`` data-parallel ranks:

* compute = a x (FLOPs(micro-batch) / (peak FLOP/s[dtype] x efficiency[dtype]) + bytes / achieved bandwidth):
  a roofline of the step's kernels (Williams et al. 2009), the matmuls bound by FLOP/s, the kernels that do no
  matmul (elementwise, norms, softmax, casts; their bytes traced) by memory bandwidth where
  ``memory_bound_bytes_per_s`` is set (on CUDA; a CPU folds them into its efficiency); under ``compile`` their
  bytes as inductor fuses them (:mod:`autofit.trace.traffic`). FLOPs are counted
  on the traced model (``torch.utils.flop_counter``), so the recompute that checkpointing adds is in them:
  a whole block's forward again, or only its attention's at ``checkpoint_granularity=attention``.
  fp8 speeds up only the Linear layers torchao converts, and adds their casts, memory-bound passes that only
  ``compile`` fuses (:mod:`autofit.cost_model.fp8`).
* communication (ZeRO paper sec. 7): data parallelism all-reduces gradients, 2 Psi elements per
  step (reduce-scatter + all-gather); ZeRO-2 reduce-scatters every micro-batch and all-gathers
  the updated parameters once; ZeRO-3 moves 3 Psi per micro-batch (all-gather in forward, again
  in backward, reduce-scatter of gradients). A ring moves (N_d - 1)/N_d of that per rank, on the
  intra-node links within a node and hierarchically across nodes (:mod:`autofit.cost_model.comm`). ZeRO++'s qwZ and
  qgZ move their quantized bytes instead, and add their quantize and dequantize kernels to the compute.
* offload (ZeRO-Offload, Ren et al. 2021): gradients down and parameters up once per step over
  PCIe (or NVMe), and the optimizer runs on the host; parameter offload streams the parameters
  in for forward and backward of every micro-batch.
* overlap: DeepSpeed runs some collectives on a side stream while compute goes on, so only what the compute
  beside it cannot cover adds to the step (:func:`exposed_communication_s`). ZeRO-3 always prefetches the next
  parameters on its all-gather stream (partitioned_param_coordinator.py ``fetch_sub_module``: at least one
  whole parameter ahead, up to ``stage3_prefetch_bucket_size``), so its gathers hide behind forward and
  backward but for the first one of each pass; with ``overlap_comm`` ZeRO 1-3 reduce each gradient bucket on a
  reduction stream during backward (stage_1_and_2.py ``reduction_stream``, stage3.py
  ``reduce_and_partition_stream``), all but the last bucket, which waits for backward's last gradient. Without
  ``overlap_comm`` the reduce runs on the compute stream; ZeRO 0's all-reduce and ZeRO 1/2's all-gather of the
  updated parameters run after backward and after the step, with nothing beside them. Backward is 2/3 of a
  micro-batch's FLOPs and forward 1/3 (a matmul's backward is two matmuls of its size: Kaplan et al. 2020,
  sec. 2.1, 6N per token = 2N forward + 4N backward). Exposed = comm - min(hideable comm,
  ``overlap_efficiency`` x compute beside it).
* long context (:mod:`autofit.cost_model.long_context`): under SP a rank computes 1/p of the traced FLOPs and
  bytes and waits for its Ulysses all-to-alls (communication); TiledMLP and the tiled loss add their recomputed
  forwards; offloaded activations add the PCIe transfers compute does not cover (offload).
* the optimizer step is memory-bound: bytes of parameters, gradients and states touched,
  over the achieved memory bandwidth, plus the engine's fixed per-step bookkeeping (what a
  probe times as ``engine.step`` at the accumulation boundary).
* the host (CUDA): forward and backward, and the optimizer step, each take the longer of the device's work and the
  host's dispatch of it (:mod:`autofit.cost_model.dispatch`); ``host`` is what the host adds beyond the device.
"""

from __future__ import annotations

from autofit.core.config import WORKING_BYTES, Config
from autofit.core.hardware import Hardware
from autofit.cost_model.coefficients import Coefficients
from autofit.cost_model.comm import CommPhases, communication_phases, quantization_seconds
from autofit.cost_model.dispatch import MEASURED_H200_MACHINE, host_step_time
from autofit.cost_model.facts import ModelFacts
from autofit.cost_model.fp8 import fp8_cast_seconds, fp8_flops
from autofit.cost_model.long_context import activation_offload_s, extra_flops, sp_all_to_all_s
from autofit.cost_model.states import buckets_of, optimizer_state_bytes

#: host-side optimizer speed for offloaded steps (DeepSpeedCPUAdam, AVX: ~1 param per ns per core group)
HOST_OPTIMIZER_BYTES_PER_S = 10e9


def micro_batch_flops(config: Config, facts: ModelFacts) -> float:
    """FLOPs of forward + backward (+ recompute) of one micro-batch, interpolated in the checkpoint ratio
    within the traces of the config's checkpoint granularity."""
    dtype = config.trace_dtype
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    traced = facts.at_checkpointed(dtype, config.attention, n_ckpt, config.micro_batch_size, "flops",
                                   config.checkpoint_granularity)
    # SP: each rank runs 1/p of the matmuls (s/p tokens) and of attention (heads/p); tiling recomputes
    return traced / config.sequence_parallel + extra_flops(config, facts)


def micro_batch_memory_bound_bytes(config: Config, facts: ModelFacts) -> float:
    """Bytes the non-matmul kernels of one micro-batch read and write (as traced; interpolated as the FLOPs are):
    each op its own kernel, or under ``compile`` their chains fused (:mod:`autofit.trace.traffic`)."""
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    attr = "fused_memory_bound_bytes" if config.compile == "on" else "memory_bound_bytes"
    return facts.at_checkpointed(config.trace_dtype, config.attention, n_ckpt, config.micro_batch_size, attr,
                                 config.checkpoint_granularity) / config.sequence_parallel


def micro_batch_compute_s(config: Config, facts: ModelFacts, hardware: Hardware, coefficients: Coefficients) -> float:
    """Seconds of kernels in one micro-batch: the matmuls' FLOPs at the achieved FLOP/s (under fp8 only the
    converted Linears at the fp8 rate), the other kernels' bytes at the achieved memory bandwidth."""
    bandwidth = coefficients.memory_bound_bytes_per_s
    memory_s = micro_batch_memory_bound_bytes(config, facts) / bandwidth if bandwidth > 0 else 0.0
    return micro_batch_matmul_s(config, facts, hardware, coefficients) + memory_s


def micro_batch_matmul_s(config: Config, facts: ModelFacts, hardware: Hardware, coefficients: Coefficients) -> float:
    """Seconds of arithmetic in one micro-batch; under fp8 only the converted Linears run at the fp8 rate."""

    def rate(dtype: str) -> float:
        return hardware.peak_flops.get(dtype, max(hardware.peak_flops.values())) * coefficients.efficiency(dtype)

    dtype = config.precision if config.precision in hardware.peak_flops else "fp32"
    flops = micro_batch_flops(config, facts)
    if dtype != "fp8":
        return flops / rate(dtype)
    converted = min(flops, fp8_flops(config, facts))
    casts = fp8_cast_seconds(config, facts, hardware)  # amax, scale, cast: fused only under compile
    return (flops - converted) / rate("bf16") + converted / rate("fp8") + casts


#: the share of a micro-batch's FLOPs in its backward pass (module docstring)
BACKWARD_SHARE = 2.0 / 3.0


def exposed_communication_s(config: Config, phases: CommPhases, micro_compute_s: float, overlap_efficiency: float,
                            first_gather_share: float) -> float:
    """Seconds of communication the step waits for, per optimizer step (module docstring).

    Per micro-batch: forward's gathers hide behind forward's compute but for the first gather of the pass
    (``first_gather_share`` of them: the first layer's parameters, which nothing runs beside); backward's gathers
    and, with ``overlap_comm``, its reduce but for the last bucket, share backward's compute."""
    a = config.grad_accum_steps
    forward_s, backward_s = (1 - BACKWARD_SHARE) * micro_compute_s, BACKWARD_SHARE * micro_compute_s

    def exposed(comm: float, hideable: float, beside: float) -> float:
        return comm - min(hideable, overlap_efficiency * beside)

    first = first_gather_share * phases.forward_gather
    forward = exposed(phases.forward_gather, phases.forward_gather - first, forward_s)
    reduce_hideable = phases.reduce - phases.tail if config.overlap_comm else 0.0
    gather_first = first_gather_share * phases.backward_gather

    def backward(with_reduce: bool) -> float:
        comm = phases.backward_gather + (phases.reduce if with_reduce else 0.0)
        hideable = phases.backward_gather - gather_first + (reduce_hideable if with_reduce else 0.0)
        return exposed(comm, hideable, backward_s)

    reducing = phases.reduce_micro_batches
    per_step = a * forward + reducing * backward(True) + (a - reducing) * backward(False)
    return max(0.0, per_step) + phases.after_step


def first_gather_share(facts: ModelFacts) -> float:
    """The share of ZeRO-3's gathers that nothing hides: the first layer's parameters of each pass (the layers
    are the repeated ones; a model without them: all of it)."""
    if not facts.layer_params or facts.n_trainable_params <= 0:
        return 1.0
    return min(1.0, facts.layer_params[0] / facts.n_trainable_params)


def offload_bytes(config: Config, facts: ModelFacts, world_size: int) -> float:
    """Bytes moved between device and host (or NVMe) per optimizer step."""
    w = WORKING_BYTES[config.precision]
    shard = facts.n_trainable_params / world_size if config.zero_stage >= 1 else facts.n_trainable_params
    moved = 0.0
    if config.offload_optimizer != "none":
        moved += 2 * w * shard  # gradients down, updated parameters up
    if config.offload_params != "none":
        moved += 2 * config.grad_accum_steps * w * facts.n_params  # forward and backward, every micro-batch
    return moved


def predict_step_time(
    config: Config, facts: ModelFacts, hardware: Hardware, world_size: int, coefficients: Coefficients
) -> dict[str, float]:
    """Seconds per optimizer step, by cause."""
    a = config.grad_accum_steps
    micro_s = micro_batch_compute_s(config, facts, hardware, coefficients)
    quantization_s = quantization_seconds(config, facts, hardware, world_size, coefficients.memory_bound_bytes_per_s)
    compute_s = a * (micro_s + quantization_s)

    phases = communication_phases(config, facts, hardware, world_size, coefficients.comm_efficiency,
                                  buckets_of(config, facts).reduce_bucket_size, coefficients.collective_latency_s)
    comm_s = exposed_communication_s(config, phases, micro_s, coefficients.overlap_efficiency,
                                     first_gather_share(facts))
    comm_s += a * sp_all_to_all_s(config, facts, hardware, world_size, coefficients.comm_efficiency)

    link = hardware.nvme_bytes_per_s if "nvme" in (config.offload_optimizer, config.offload_params) else hardware.pcie_bytes_per_s
    moved = offload_bytes(config, facts, world_size)
    offload_s = moved / (link * coefficients.offload_efficiency) if moved and link > 0 else 0.0
    offload_s += a * activation_offload_s(config, facts, hardware, micro_s, coefficients.offload_efficiency)

    shard = facts.n_trainable_params / world_size if config.zero_stage >= 1 else facts.n_trainable_params
    touched = optimizer_state_bytes(config.optimizer, facts, shard) + 3 * 4 * shard  # states + param, grad, master
    if config.offload_optimizer != "none":
        optimizer_s = touched / HOST_OPTIMIZER_BYTES_PER_S
    else:
        optimizer_s = touched / coefficients.optimizer_bytes_per_s
    optimizer_s += coefficients.step_overhead_s
    return {
        "compute": compute_s,
        "communication": comm_s,
        "offload": offload_s,
        "optimizer": optimizer_s,
        "overhead": a * coefficients.micro_batch_overhead_s,
        "host": host_excess_s(config, facts, hardware, compute_s + comm_s, optimizer_s),
    }


def host_excess_s(config: Config, facts: ModelFacts, hardware: Hardware, device_forward_backward_s: float,
                  device_optimizer_s: float) -> float:
    """Seconds the host's dispatch adds to a CUDA step beyond the device's work, phase by phase (0 on the CPU, where
    the host is the device): forward and backward against the device's compute and exposed communication, the
    optimizer step against its own (:mod:`autofit.cost_model.dispatch`)."""
    if hardware.kind != "cuda":
        return 0.0
    host = host_step_time(config, facts, MEASURED_H200_MACHINE)
    return (max(0.0, host.forward_backward_s - device_forward_backward_s)
            + max(0.0, host.optimizer_s - device_optimizer_s))
