"""Communication time of data parallelism by topology: ring collectives, hierarchical across nodes.

Volumes per optimizer step, in units of the model's working-precision bytes S = w x Psi
(ZeRO paper, Rajbhandari et al. 2020, sec. 7.2): data parallelism and ZeRO-1 all-reduce the
gradients once (a reduce-scatter plus an all-gather: 2 S); ZeRO-2 reduce-scatters the gradients
of every micro-batch and all-gathers the updated parameters once ((a + 1) S); ZeRO-3 all-gathers
the parameters in forward and again in backward and reduce-scatters the gradients, every
micro-batch (3 a S) -- the seeds' "2 Psi vs 3 Psi".

Time of one reduce-scatter or all-gather of S bytes over n ranks on a ring: each rank moves
``(n - 1) / n x S`` over its slowest link. That is NCCL's bus bandwidth (nccl-tests
doc/PERFORMANCE.md: ``busBw = algBw x (n - 1) / n`` for reduce-scatter and all-gather,
``x 2 (n - 1) / n`` for all-reduce), so ``t = (n - 1) / n x S / busBw`` with busBw the link speed.

Across nodes the collectives run hierarchically (NCCL's tree/NVLS-tree and DeepSpeed's hierarchical
partitioning do the same): a reduce-scatter over the g ranks of a node on the intra-node links,
then one over the N nodes of the S / g bytes each rank holds on its own network link, and the
all-gather mirrors it. So one S-collective over g x N ranks costs
``(g - 1) / g x S / B_intra + (N - 1) / N x S / g / B_inter``; on one node the second term is 0
and the first is the flat ring.

ZeRO++'s hierarchical partitioning (hpZ, Wang et al. 2023, sec. 3.2; ``hpz_partition_size`` h) keeps a secondary
partition over the h ranks of a node: each rank holds S / h, and a gather from it is a ring over those h ranks on the
intra-node links, ``(h - 1) / h x S / B_intra``. DeepSpeed makes the secondary as forward releases each module and
drops it after the step, so of a step's 2a gathers the first forward's reads the primary partition over every rank
and the other 2a - 1 the secondary; the reduce-scatter of the gradients still runs over every rank.

ZeRO++'s quantized communication (sec. 3.1 and 3.3) changes the bytes, not the rings. qwZ gathers int8 blocks, each
with an fp32 scale (``partition_parameters.py``: ``CUDAQuantizer``, blocks of at most ``target_group_size`` = 8,000
elements), primary and secondary alike: :data:`QWZ_BYTES` an element instead of w. qgZ (only across nodes) reduces the
gradients by an all-to-all of int4 blocks among the g ranks of a node, each then holding its reduced 1 / g, and an
all-to-all of that among the N nodes (``coalesced_collectives.py``, ``all_to_all_quant_reduce``): per rank
``(g - 1) / g x B4 / B_intra + (N - 1) / N x B4 / g / B_inter`` for ``B4`` = half a byte an element, the hierarchical
reduce-scatter's expression at B4 (its per-row scales, a few bytes per row of thousands, are left out). Their kernels
run on the device beside the step's own (:func:`quantization_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autofit.core.config import WORKING_BYTES, Config
from autofit.core.hardware import Hardware
from autofit.cost_model.facts import ModelFacts

#: bytes of one element of a qwZ gather: int8, and an fp32 scale per block of at most 8,000 elements
#: (partition_parameters.py, ``CUDAQuantizer.target_group_size``)
QWZ_BYTES = 1.0 + 4.0 / 8000
#: bytes of one element of a qgZ all-to-all: int4 (``all_to_all_quant_reduce``, ``swizzle_quant(..., 4, ...)``)
QGZ_BYTES = 0.5


def collective_volumes(config: Config) -> float:
    """Reduce-scatters plus all-gathers of the whole model (S each) per optimizer step (module docstring)."""
    a = config.grad_accum_steps
    if config.zero_stage <= 1:
        return 2.0
    if config.zero_stage == 2:
        return a + 1.0
    return 3.0 * a


def collective_seconds(n_bytes: float, hardware: Hardware, world_size: int, efficiency: float = 1.0) -> float:
    """Seconds of one reduce-scatter (or all-gather) of ``n_bytes`` over ``world_size`` ranks, hierarchical
    across nodes; 0 on one rank or where the hardware names no link."""
    if world_size <= 1 or efficiency <= 0:
        return 0.0
    g = hardware.ranks_on_a_node(world_size)
    n_nodes = hardware.n_nodes(world_size)
    seconds = 0.0
    if g > 1 and hardware.intra_node_bytes_per_s > 0:
        seconds += (g - 1) / g * n_bytes / (hardware.intra_node_bytes_per_s * efficiency)
    if n_nodes > 1 and hardware.inter_node_bytes_per_s > 0:
        seconds += (n_nodes - 1) / n_nodes * n_bytes / g / (hardware.inter_node_bytes_per_s * efficiency)
    return seconds


def secondary_gather_seconds(n_bytes: float, hardware: Hardware, hpz_partition_size: int,
                             efficiency: float = 1.0) -> float:
    """Seconds of one all-gather of ``n_bytes`` from hpZ's secondary partition: a ring over ``hpz_partition_size``
    ranks of one node (module docstring)."""
    h = hpz_partition_size
    if h <= 1 or efficiency <= 0 or hardware.intra_node_bytes_per_s <= 0:
        return 0.0
    return (h - 1) / h * n_bytes / (hardware.intra_node_bytes_per_s * efficiency)


def communication_seconds(config: Config, facts: ModelFacts, hardware: Hardware, world_size: int, efficiency: float) -> float:
    """Seconds per optimizer step of gradient reduction and parameter gathering."""
    model_bytes = float(facts.n_trainable_params * WORKING_BYTES[config.precision])
    return collective_volumes(config) * collective_seconds(model_bytes, hardware, world_size, efficiency)


@dataclass(frozen=True)
class CommPhases:
    """Seconds of one optimizer step's collectives, by where in the step they run (before any overlap).

    ``forward_gather`` and ``backward_gather``: ZeRO-3's parameter all-gathers in each micro-batch's forward and
    backward; ``reduce``: one micro-batch's gradient reduction (ZeRO 1/2 and 3: bucket by bucket in backward's hooks;
    ``reduce_micro_batches`` of them a step); ``after_step``: what runs after the optimizer step or after backward
    on the compute stream (ZeRO 0's all-reduce, ZeRO 1/2's all-gather of the updated partition); ``tail``: the part
    of each reduce that is the last bucket, which waits for backward's last gradient."""

    forward_gather: float = 0.0
    backward_gather: float = 0.0
    reduce: float = 0.0
    reduce_micro_batches: int = 0
    tail: float = 0.0
    after_step: float = 0.0

    def total(self, accumulation: int) -> float:
        return (accumulation * (self.forward_gather + self.backward_gather) + self.reduce_micro_batches * self.reduce
                + self.after_step)


def communication_phases(config: Config, facts: ModelFacts, hardware: Hardware, world_size: int, efficiency: float,
                         reduce_bucket_elements: int, latency_s: float = 0.0) -> CommPhases:
    """The step's collectives (module docstring's volumes) split by phase; 0 on one rank.

    ZeRO 0: the engine all-reduces every gradient after backward (engine.py ``allreduce_gradients``): 2 S, after.
    ZeRO 1: the gradients are reduce-scattered once a step, bucket by bucket in the last micro-batch's backward
    (stage_1_and_2.py reduces at the accumulation boundary), and the updated partitions all-gathered after the step.
    ZeRO 2: reduce-scattered in every micro-batch's backward, all-gathered after the step.
    ZeRO 3: all-gathered in forward and in backward, reduce-scattered in backward, every micro-batch; with hpZ the
    backward's gathers and the later micro-batches' forward ones read the secondary partition (module docstring), so
    ``forward_gather`` is the micro-batches' mean.
    Each reduce pass is ``ceil(Psi / reduce_bucket_size)`` collectives, each paying ``latency_s``; its last bucket
    (``reduce_bucket_size / Psi`` of it) is the tail. ZeRO-3's gathers under qwZ and its reduce under qgZ move the
    quantized bytes (module docstring)."""
    model_bytes = float(facts.n_trainable_params * WORKING_BYTES[config.precision])
    one = collective_seconds(model_bytes, hardware, world_size, efficiency)
    if one <= 0:
        return CommPhases()
    psi = max(1, facts.n_trainable_params)
    buckets = math.ceil(psi / max(1, reduce_bucket_elements))
    reduced = collective_seconds(psi * QGZ_BYTES, hardware, world_size, efficiency) \
        if quantizes_gradients(config, hardware, world_size) else one
    reduce = reduced + buckets * latency_s
    tail = reduce * min(1.0, reduce_bucket_elements / psi)
    a = config.grad_accum_steps
    if config.zero_stage == 0:
        return CommPhases(after_step=2 * one)
    if config.zero_stage in (1, 2):
        return CommPhases(reduce=reduce, reduce_micro_batches=1 if config.zero_stage == 1 else a, tail=tail,
                          after_step=one)
    gathered = psi * QWZ_BYTES if config.quantized_weights else model_bytes
    gather = collective_seconds(gathered, hardware, world_size, efficiency)
    if config.hpz_partition_size == 1:
        return CommPhases(forward_gather=gather, backward_gather=gather, reduce=reduce, reduce_micro_batches=a, tail=tail)
    secondary = secondary_gather_seconds(gathered, hardware, config.hpz_partition_size, efficiency)
    return CommPhases(forward_gather=(gather + (a - 1) * secondary) / a, backward_gather=secondary, reduce=reduce,
                      reduce_micro_batches=a, tail=tail)


def quantizes_gradients(config: Config, hardware: Hardware, world_size: int) -> bool:
    """Whether qgZ runs: ZeRO-3 quantizes its reduce only across nodes (stage3.py ``__avg_scatter_grads``: ``num_nodes
    > 1``, else the plain reduce-scatter)."""
    return config.quantized_gradients and hardware.n_nodes(world_size) > 1


def quantization_seconds(config: Config, facts: ModelFacts, hardware: Hardware, world_size: int,
                         bytes_per_s: float) -> float:
    """Device seconds a micro-batch spends in ZeRO++'s quantize and dequantize kernels, memory-bound at ``bytes_per_s``
    (the achieved bandwidth of kernels that do no matmul); 0 without qwZ and qgZ or a bandwidth.

    qwZ, in each of forward's and backward's gathers: the rank's share quantized (w bytes read, one written, 1 / n of
    the model) and every gathered element dequantized (:data:`QWZ_BYTES` read, w written; ``AllGatherCoalescedHandle``
    ``wait``). qgZ, in each micro-batch's reduce: the whole gradient quantized (``swizzle_quant``: w read, half a byte
    written), its 1 / g share received from the node's ranks reduced and quantized again (``quantized_reduction``: g
    halves read, one written), and the 1 / g received from the nodes dequantized to the working precision and its N
    chunks summed into the rank's 1 / (g N) (``final_output.chunk(num_nodes)``)."""
    if bytes_per_s <= 0 or not (config.quantized_weights or config.quantized_gradients):
        return 0.0
    w, psi = WORKING_BYTES[config.precision], float(facts.n_trainable_params)
    moved = 0.0
    if config.quantized_weights:
        moved += 2 * psi * ((w + 1.0) / world_size + QWZ_BYTES + w)
    if quantizes_gradients(config, hardware, world_size):
        g, n_nodes = hardware.ranks_on_a_node(world_size), hardware.n_nodes(world_size)
        moved += psi * (w + QGZ_BYTES + (g + 1) * QGZ_BYTES / g + (QGZ_BYTES + 2 * w) / g + w / (g * n_nodes))
    return moved / bytes_per_s
