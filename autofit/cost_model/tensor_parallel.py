"""A config with DeepSpeed's AutoTP priced as what one of its ranks is: a smaller model trained data-parallel, plus
the TP group's collectives. Pure, no torch.

A rank of an AutoTP group of degree ``tp`` holds the model with the Linear layers its ``tp_plan`` names split
(:mod:`autofit.trace.tensor_parallel` traces exactly that model: its parameters, their gradients and optimizer
states, its activations and FLOPs, the ops it dispatches), and ZeRO partitions those over the data-parallel group
of ``world / tp`` ranks (``deepspeed/utils/groups.py``: mesh ``(dp, tp)``, the engine's ``dp_world_size``). So the
memory and the step are those of the rank's facts (:meth:`ModelFacts.rank`) at the same config without TP, on
``world / tp`` ranks of which ``devices_per_node / tp`` share a node's links; the host a node needs is the whole
model's: every rank builds the whole model before ``deepspeed.initialize`` shards it (measured:
docs/results/autotp_cpu.md).

Added to the step, on the compute stream (``tp_overlap_comm`` is off in the emitted JSON): the TP group's
all-reduces of ``t h w`` bytes each (``t`` = micro x sequence tokens, ``h`` the hidden size, ``w`` the working
precision's bytes), per micro-batch one a row Linear in forward (``RowParallel.forward``,
``deepspeed/module_inject/layers.py``) and one a column Linear in backward (``ColumnParallel.backward``: q, k, v,
gate and up each, not Megatron's fused two), and in the recompute of a checkpointed layer its row Linears but the
last (non-reentrant checkpointing stops once it has what backward needs: measured, docs/results/autotp_cpu.md);
and the head's all-gather of its ``t V`` logits. A ring all-reduce moves ``2 (tp - 1) / tp`` of its bytes over each
rank's link, an all-gather ``(tp - 1) / tp`` (nccl-tests' bus bandwidth: :mod:`autofit.cost_model.comm`), each
collective paying the latency the device's prior states.
"""

from __future__ import annotations

from dataclasses import replace

from autofit.core.config import WORKING_BYTES, Config
from autofit.core.hardware import Hardware
from autofit.cost_model.comm import collective_seconds
from autofit.cost_model.facts import ModelFacts


def as_rank(config: Config, facts: ModelFacts, hardware: Hardware, world_size: int
            ) -> tuple[Config, ModelFacts, Hardware, int]:
    """``config`` priced as one AutoTP rank (module docstring): the config without TP, the rank's facts, the node's
    data-parallel share of its devices, the data-parallel ranks. Where ``config`` has no TP, the same four."""
    degree = config.tensor_parallel
    if degree == 1:
        return config, facts, hardware, world_size
    per_node = hardware.devices_per_node // degree if hardware.devices_per_node else 0
    return (config.with_(tensor_parallel=1), facts.rank(degree), replace(hardware, devices_per_node=per_node),
            max(1, world_size // degree))


def all_reduces_per_micro_batch(config: Config, rank: ModelFacts) -> int:
    """The TP group's all-reduces of one micro-batch (module docstring): every row Linear's in forward, every column
    Linear's in backward, and the row Linears but the last of each checkpointed layer's recompute."""
    rows_per_layer = rank.tp_row_linears // rank.n_layers if rank.n_layers else 0
    recomputed = config.checkpointed_layers(rank.n_layers) * max(0, rows_per_layer - 1)
    return rank.tp_row_linears + rank.tp_column_linears + recomputed


def tensor_parallel_s(config: Config, rank: ModelFacts, hardware: Hardware, latency_s: float,
                      efficiency: float) -> float:
    """Seconds of the TP group's collectives per optimizer step (module docstring); 0 without TP."""
    degree = config.tensor_parallel
    if degree == 1:
        return 0.0
    tokens = config.micro_batch_size * (rank.seq_len or rank.tokens_per_sample or 1)
    w = WORKING_BYTES[config.precision]
    n_all_reduces = all_reduces_per_micro_batch(config, rank)
    all_reduce_s = 2 * collective_seconds(tokens * rank.hidden_size * w, hardware, degree, efficiency)
    gathers = 1 if rank.tp_gathered_features else 0
    gather_s = collective_seconds(tokens * rank.tp_gathered_features * w, hardware, degree, efficiency)
    per_micro = n_all_reduces * (all_reduce_s + latency_s) + gathers * (gather_s + latency_s)
    return config.grad_accum_steps * per_micro
