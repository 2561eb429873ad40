"""Step time: compute, recompute, communication, offload traffic and fixed overheads.

Per optimizer step of ``a`` micro-batches on ``N_d`` data-parallel ranks:

* compute = a x FLOPs(micro-batch) / (peak FLOP/s[dtype] x efficiency[dtype]); FLOPs are counted
  on the traced model (``torch.utils.flop_counter``), so the recompute that checkpointing adds is in them:
  a whole block's forward again, or only its attention's at ``checkpoint_granularity=attention``.
  fp8 speeds up only the Linear layers torchao converts, and adds their casts, memory-bound passes that only
  ``compile`` fuses (:mod:`autofit.cost_model.fp8`).
* communication (ZeRO paper sec. 7): data parallelism all-reduces gradients, 2 Psi elements per
  step (reduce-scatter + all-gather); ZeRO-2 reduce-scatters every micro-batch and all-gathers
  the updated parameters once; ZeRO-3 moves 3 Psi per micro-batch (all-gather in forward, again
  in backward, reduce-scatter of gradients). A ring moves (N_d - 1)/N_d of that per rank, on the
  intra-node links within a node and hierarchically across nodes (:mod:`autofit.cost_model.comm`).
* offload (ZeRO-Offload, Ren et al. 2021): gradients down and parameters up once per step over
  PCIe (or NVMe), and the optimizer runs on the host; parameter offload streams the parameters
  in for forward and backward of every micro-batch.
* the optimizer step is memory-bound: bytes of parameters, gradients and states touched,
  over the achieved memory bandwidth, plus the engine's fixed per-step bookkeeping (what a
  probe times as ``engine.step`` at the accumulation boundary).
"""

from __future__ import annotations

from autofit.config import WORKING_BYTES, Config
from autofit.cost_model.coefficients import Coefficients
from autofit.cost_model.comm import communication_seconds
from autofit.cost_model.facts import ModelFacts
from autofit.cost_model.fp8 import fp8_cast_seconds, fp8_flops
from autofit.cost_model.memory import optimizer_state_bytes
from autofit.hardware import Hardware

#: host-side optimizer speed for offloaded steps (DeepSpeedCPUAdam, AVX: ~1 param per ns per core group)
HOST_OPTIMIZER_BYTES_PER_S = 10e9


def micro_batch_flops(config: Config, facts: ModelFacts) -> float:
    """FLOPs of forward + backward (+ recompute) of one micro-batch, interpolated in the checkpoint ratio
    within the traces of the config's checkpoint granularity."""
    dtype = config.trace_dtype
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    return facts.at_checkpointed(dtype, config.attention, n_ckpt, config.micro_batch_size, "flops",
                                 config.checkpoint_granularity)


def micro_batch_compute_s(config: Config, facts: ModelFacts, hardware: Hardware, coefficients: Coefficients) -> float:
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
    compute_s = a * micro_batch_compute_s(config, facts, hardware, coefficients)

    comm_s = communication_seconds(config, facts, hardware, world_size, coefficients.comm_efficiency)

    link = hardware.nvme_bytes_per_s if "nvme" in (config.offload_optimizer, config.offload_params) else hardware.pcie_bytes_per_s
    moved = offload_bytes(config, facts, world_size)
    offload_s = moved / (link * coefficients.offload_efficiency) if moved and link > 0 else 0.0

    shard = facts.n_trainable_params / world_size if config.zero_stage >= 1 else facts.n_trainable_params
    touched = optimizer_state_bytes(config.optimizer, facts, shard) + 3 * 4 * shard  # states + param, grad, master
    if config.offload_optimizer != "none":
        optimizer_s = touched / HOST_OPTIMIZER_BYTES_PER_S
    else:
        optimizer_s = touched / coefficients.optimizer_bytes_per_s
    return {
        "compute": compute_s,
        "communication": comm_s,
        "offload": offload_s,
        "optimizer": optimizer_s + coefficients.step_overhead_s,
        "overhead": a * coefficients.micro_batch_overhead_s,
    }
