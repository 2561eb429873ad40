"""The model states one rank holds, by ZeRO stage and offload: parameters, gradients, optimizer states, their
scratch and DeepSpeed's buckets (:func:`model_states`). The formulas follow DeepSpeed's
``runtime/zero/stage_1_and_2.py`` and ``stage3.py``; :mod:`autofit.cost_model.memory` adds activations and phases."""

from __future__ import annotations

from dataclasses import dataclass, replace

from autofit.core.config import WORKING_BYTES, Config
from autofit.cost_model.allocation_sequence import largest_zero3_sub_group
from autofit.cost_model.comm import QWZ_BYTES
from autofit.cost_model.facts import ModelFacts
from autofit.ds.buckets import ZeroBuckets, zero_buckets

#: bytes of an fp32 element (master weights, fp32 gradients, Adam's moments)
FP32 = 4


def optimizer_state_bytes(optimizer: str, facts: ModelFacts, n_elements: float, flat: bool = False) -> float:
    """Optimizer-state bytes for ``n_elements`` trainable parameters (a shard of the model).

    * AdamW: ``m`` and ``v`` in fp32, 8 B/param (Loshchilov & Hutter 2019; ZeRO paper's K counts them).
    * AdamW 8-bit (bitsandbytes, Dettmers et al. 2022): two uint8 states (2 B/param) plus one fp32
      absmax per 256-element block per state (8/256 B/param); tensors under 4096 elements keep
      fp32 states (8 B/param).
    * Lion (Chen et al. 2023): one momentum, 4 B/param.
    * Adafactor (Shazeer & Stern 2018): factored second moment, row + column vectors per matrix,
      no first moment (beta1=None, torch's default).
    * SGD with momentum: one buffer, 4 B/param.
    * Adam-mini (Zhang et al. 2024; the ``adam-mini`` 1.1.1 package): a full fp32 first moment and one
      fp32 second-moment value per block -- per head for queries and keys, per output neuron (row) for
      embeddings, values, projections and MLPs, one per remaining tensor, a full one for biases -- so
      ~4 B/param; the element count is its own step's, on fake tensors (``facts.adam_mini_state_numel``).

    ``flat``: under ZeRO 1-3 the optimizer steps on one flat 1-D partition, so Adafactor cannot
    factor (4 B/param) and bitsandbytes sees no small tensors.
    """
    share = n_elements / max(facts.n_trainable_params, 1)
    if optimizer == "adamw":
        return 8.0 * n_elements
    if optimizer == "adamw8bit":
        small = 0.0 if flat else facts.n_small_params * share
        large = n_elements - small
        return large * (2.0 + 8.0 / 256) + small * 8.0
    if optimizer in ("lion", "sgd"):
        return 4.0 * n_elements
    if optimizer == "adafactor":
        return FP32 * (n_elements if flat else facts.factored_state_numel * share)
    if optimizer == "adam_mini":
        if facts.adam_mini_error:  # it cannot step on this model (predict says why): AdamW's two moments
            return 8.0 * n_elements
        if not facts.adam_mini_state_numel and n_elements:
            raise ValueError("the facts have no Adam-mini state count: trace with optimizers=('adam_mini',)")
        return FP32 * facts.adam_mini_state_numel * share
    raise ValueError(f"unknown optimizer {optimizer!r}")


#: scratch bytes per element of the tensor an optimizer step works on, beyond its states.
#: CPU values: measured on DeepSpeed 0.19 / bitsandbytes 0.50 / torch 2.13 as the resident memory one optimizer step adds
#: on flat tensors (no script reruns these readings; docs/results/memory.md, "What changed", records them, and
#: tests/cost_model/test_adam_mini.py measures Adam-mini's);
#: bitsandbytes' CPU AdamW (backends/cpu/ops.py ``_optimizer_update_8bit_blockwise_cpu``) dequantizes both
#: states to fp32 (8), scales the gradient out of place (4) and builds ``state2.sqrt() / correction2`` (4 + 4):
#: 20 B an element at that moment, as measured (19.7-20.0 on flat tensors of 0.26-16.8 M elements). SGD with weight decay
#: adds it out of place (torch/optim/sgd.py ``grad.add(param, alpha=weight_decay)``), one tensor at a time on
#: the CPU (``_single_tensor_sgd``): measured 62.5 MiB = 4 x the largest parameter in a Qwen2 bf16 ZeRO-0 init.
#: Lion on the CPU is autofit's own (autofit/ds/optim.py ``make_lion``): ``m.mul(beta1)`` makes the update out of
#: place, 4 B an element (measured 18.6 MiB on a 4.87 M-element ZeRO-2 partition). Adafactor (torch/optim/_adafactor.py
#: ``_single_tensor_adafactor``) on a matrix forms ``row_var @ col_var`` (4 B an element) and updates in it.
#: Adam-mini (adam_mini.py 1.1.1, ``step``) builds ``update = (state["m"] * stepsize).view(p.size())`` and then
#: ``p.add_(-update)``, a second copy beside it (a bias's ``v.sqrt() / bias_correction_2_sqrt`` the same): 8 B an
#: element on any device, measured 7.99-8.00 on a 16.4 M-element embedding from the second step on
#: (tests/cost_model/test_adam_mini.py).
#: CUDA: fused kernels (FusedAdam, FusedLion, bitsandbytes' CUDA kernels) update in place.
TRANSIENT_BYTES_PER_ELEMENT = {
    "cpu": {"adamw": 0.0, "adamw8bit": 20.0, "lion": 4.0, "adafactor": 4.0, "sgd": 4.0, "adam_mini": 8.0},
    "cuda": {"adamw": 0.0, "adamw8bit": 0.0, "lion": 0.0, "adafactor": 4.0, "sgd": 0.0, "adam_mini": 8.0},
}


#: Adafactor on a vector -- ZeRO 1-3's flat partition -- keeps ``grad * grad`` alive beside ``variance.clone()``
#: (``_single_tensor_adafactor``; ``_multi_tensor_adafactor`` the same with foreach ops): 8 B an element, measured
#: 36.8 MiB on a 4.87 M-element ZeRO-3 partition.
FLAT_ADAFACTOR_TRANSIENT_BYTES = 8.0


def optimizer_scratch_bytes(optimizer: str, device_kind: str, n_elements: float, flat: bool) -> float:
    """Bytes an optimizer step holds beyond its states while it updates ``n_elements`` (one tensor at a time:
    the largest parameter; under ZeRO 1-3 the flat partition, ``flat``)."""
    if flat and optimizer == "adafactor":
        return FLAT_ADAFACTOR_TRANSIENT_BYTES * n_elements
    return TRANSIENT_BYTES_PER_ELEMENT[device_kind][optimizer] * n_elements


@dataclass(frozen=True)
class ModelStates:
    """Per-rank bytes of everything but activations, by role and by when they are alive."""

    params: float
    """Working-precision parameters resident on the device (the shard under ZeRO-3)."""
    master: float
    """fp32 master copy (16-bit training) or ZeRO's fp32 partition (kept in any precision)."""
    optimizer: float
    """Optimizer states."""
    grads_resident: float
    """Gradient buffers alive through forward and backward (ZeRO-3's partition, the reduce bucket)."""
    gathered_params: float
    """ZeRO-3: parameters gathered from the other ranks while a layer runs."""
    grads_step: float
    """Gradient bytes alive at the optimizer step beyond ``grads_resident``."""
    step_scratch: float
    """The largest temporary of the step (flattened bucket copy, or the optimizer's scratch)."""
    init_extra: float
    """Bytes ``deepspeed.initialize`` holds briefly above the built model (``built``)."""
    reduce_scratch: float = 0.0
    """ZeRO-3: what the reduce-scatter of the last gradient bucket holds beside the resident states at the end
    of backward (:func:`stage3_reduce_scratch_bytes`)."""
    built: float = 0.0
    """Device bytes of the model as built, before ``deepspeed.initialize`` (see the module docstring)."""
    secondary_params: float = 0.0
    """ZeRO-3 with hpZ: the secondary partition, ``1 / hpz`` of the partitioned parameters in the working precision
    (partition_parameters.py ``_partition_param_sec``: ``aligned numel // hpz`` a parameter, made as forward releases
    each module), alive from the first forward to the end of the optimizer step (stage3.py ``_post_step``,
    ``invalidate_secondary_tensor``)."""
    gathered_at_reduce: float = 0.0
    """ZeRO-3: parameters still gathered when the last gradient bucket is reduced at the end of backward: the
    module whose backward runs last (the first in forward: an embedding), released only after the epilogue.
    Measured on two gloo ranks: at ``independent_gradient_partition_epilogue`` the GQA Llama's embedding (1,048,576 of
    its 4,868,352 elements) was the one module still available. Priced as the largest module."""

    @property
    def resident(self) -> float:
        """The model states a rank keeps through training: parameters (own and gathered), the fp32
        partition, optimizer states and the gradient buffers alive through backward. What DeepSpeed's
        ``estimate_zero{2,3}_model_states_mem_needs`` estimate as ``gpu_mem``."""
        return self.params + self.gathered_params + self.master + self.optimizer + self.grads_resident


def reduce_bucket_bytes(n_elements: float, bucket_elements: int, element_bytes: int, device_kind: str) -> float:
    """A gradient bucket of ``bucket_elements`` (``torch.empty``): a CUDA allocator reserves all of it;
    on the CPU only the pages written count, at most the gradients that exist."""
    size = bucket_elements if device_kind == "cuda" else min(n_elements, bucket_elements)
    return float(element_bytes * size)


def buckets_of(config: Config, facts: ModelFacts) -> ZeroBuckets:
    """The ZeRO bucket sizes ``config`` runs with on this model (what :mod:`autofit.ds.emit` writes)."""
    return zero_buckets(facts.hidden_size, config.bucket_scale)


def reduce_buffers(config: Config) -> int:
    """How many reduce buckets ZeRO preallocates. ZeRO 1/2 (stage_1_and_2.py ``setup_buckets``): one
    ``torch.empty(reduce_bucket_size)`` per dtype with ``contiguous_gradients``, and a second one with
    ``overlap_comm`` ("double buffers to avoid data access conflict": one fills while the other is reduced on
    the reduction stream). ZeRO-3 (stage3.py, after ``initialize_optimizer_states``): one with
    ``contiguous_gradients``, whatever ``overlap_comm`` (it reduces on its own stream from the one buffer).
    Without ``contiguous_gradients`` none: each bucket's gradients are flattened when it is reduced."""
    if not config.contiguous_gradients:
        return 0
    return 2 if config.overlap_comm and config.zero_stage in (1, 2) else 1


def model_states(config: Config, facts: ModelFacts, world_size: int, device_kind: str) -> ModelStates:
    """Model-state bytes of one rank: the ZeRO paper's accounting with DeepSpeed's buffers.

    Psi = trainable parameters, N_d = ``world_size``, w = working bytes (4 fp32, 2 bf16/fp16).
    Stage 0: w*Psi params, 4*Psi master (16-bit), K*Psi optimizer, w*Psi grads; the engine
    flattens all gradients into one all-reduce bucket (engine.allreduce_gradients) even on one rank.
    Stage 1/2: the optimizer steps on a flat fp32 partition of Psi/N_d (``single_partition_of_fp32_groups``,
    made even in fp32); gradients go through a reduce bucket (w bytes an element,
    stage_1_and_2.setup_buckets) into an fp32 partition.
    Stage 3: parameters too are partitioned; a gradient partition buffer and the reduce bucket live
    for the whole run; layers gather their parameters while they run (:func:`stage3_live_elements`).
    Offload moves what DeepSpeed puts on ``self.device = 'cpu'`` to the host (:mod:`autofit.cost_model.host`
    prices it there) and keeps the device-side buffers named in :func:`_offloaded`.
    """
    psi = float(facts.n_trainable_params)
    stage = config.zero_stage
    shard = psi / world_size if stage >= 1 else psi
    stepped_elements = shard if stage >= 1 else facts.largest_param_numel
    common = {
        "optimizer": optimizer_state_bytes(config.optimizer, facts, shard, flat=stage >= 1),
        "optimizer_scratch": optimizer_scratch_bytes(config.optimizer, device_kind, stepped_elements, flat=stage >= 1),
        # a CPU device is the process that builds the fp32 model; a GPU receives it cast to w (engine.py)
        "built": float(FP32 * facts.n_params) if device_kind == "cpu" else WORKING_BYTES[config.precision] * facts.n_params,
    }
    if stage == 0:
        return _stage0_states(config, facts, **common)
    if stage in (1, 2):
        return _offloaded(_stage12_states(config, facts, shard, device_kind, **common), config, facts, world_size)
    return _offloaded(_stage3_states(config, facts, shard, world_size, device_kind, **common), config, facts, world_size)


def _stage0_states(config: Config, facts: ModelFacts, optimizer: float, optimizer_scratch: float,
                   built: float) -> ModelStates:
    """ZeRO 0: whole params, master, optimizer and grads; one flat all-reduce bucket; the 16-bit optimizers'
    flat copies (fp16/fused_optimizer.py for DeepSpeed's Adam, fp16/unfused_optimizer.py for the others)."""
    psi, frozen = float(facts.n_trainable_params), float(facts.n_params - facts.n_trainable_params)
    w = WORKING_BYTES[config.precision]
    sixteen_bit = config.precision != "fp32"
    params = w * (psi + frozen)
    bucket = w * psi  # engine.allreduce_gradients flattens every gradient, even on one rank
    init_extra = 0.0
    if sixteen_bit:
        largest = float(facts.largest_param_numel)
        fused = config.optimizer == "adamw" and config.offload_optimizer == "none"
        bucket += (w + FP32) * psi if fused else w * psi + FP32 * largest
        # deepspeed.initialize ends in the wrapper's initialize_optimizer_states (fp16/fused_optimizer.py,
        # fp16/unfused_optimizer.py): zero gradients (the flat fp32 one; unfused, every parameter's in both
        # precisions) and one optimizer step, which creates the states, beside the parameters and the master
        zero_grads = FP32 * psi if fused else (w + FP32) * psi
        init_extra = params + FP32 * psi + zero_grads + optimizer + optimizer_scratch - built
    return ModelStates(
        params=params, master=FP32 * psi if sixteen_bit else 0.0, optimizer=optimizer, grads_resident=0.0,
        gathered_params=0.0, grads_step=w * psi, step_scratch=max(bucket, optimizer_scratch),
        init_extra=max(0.0, init_extra), built=built,
    )


def _stage12_states(config: Config, facts: ModelFacts, shard: float, device_kind: str, optimizer: float,
                    optimizer_scratch: float, built: float) -> ModelStates:
    """ZeRO 1/2: the optimizer steps on a flat fp32 partition (``single_partition_of_fp32_groups``, made even
    in fp32); gradients go through a reduce bucket in the working precision (stage_1_and_2.setup_buckets)
    into an fp32 partition."""
    psi, frozen = float(facts.n_trainable_params), float(facts.n_params - facts.n_trainable_params)
    w = WORKING_BYTES[config.precision]
    params = w * (psi + frozen)
    # the reduce bucket (setup_buckets, at each micro-step's start): a CUDA allocator holds all of it
    # through backward; on the CPU its pages are touched as gradients arrive, while activations free.
    # Its dtype is _gradient_reduction_buffer_dtype(): the working precision, as autofit's JSON sets no
    # data_types.grad_accum_dtype (fp32 only for a 16-bit ZeRO-1 that accumulates in fp32)
    # (memory_phases prices the filling bucket as gradients kept through backward). After backward the filled
    # bucket sits beside the gradient partition; by the optimizer's own step it is spent (measured: the step of a
    # 4.87 M-element ZeRO-2 partition began 18.6 MiB -- the fp32 partition's gradient -- above the resident state)
    # overlap_comm doubles it, no contiguous_gradients leaves only the flattened bucket of each reduce
    # (:func:`reduce_buffers`)
    bucket_elements = buckets_of(config, facts).reduce_bucket_size
    one_bucket = reduce_bucket_bytes(psi, bucket_elements, w, device_kind)
    n_buffers = reduce_buffers(config)
    bucket_bytes = n_buffers * one_bucket if n_buffers else w * min(psi, bucket_elements)
    grads_resident = bucket_bytes if device_kind == "cuda" and n_buffers else 0.0
    # stage_1_and_2.py step: ``flatten_dense_tensors_aligned(averaged_gradients).to(fp32)``; in 16-bit the flat
    # copy and its fp32 cast are alive at once (measured: 8 B an element above the resident state in a bf16
    # ZeRO-2 AdamW step, the bucket 2 + the flat copy 2 + the fp32 gradient 4)
    flat_copy = w * shard if w != FP32 else 0.0
    # ZeRO-1 reduces only at the accumulation boundary: the parameters' own .grad (w Psi, accumulated_grad_bytes)
    # are still held when the step begins, whatever the bucket (measured: gpt-small, ZeRO-1 fp32 mb2, peaked at
    # 132.4 MiB with 256^2-element buckets and 131.6 MiB with 5e7-element ones)
    # ZeRO-2 moves each gradient into the rank's partition as it is reduced (copy_grads_in_partition:
    # ``grads_in_partition``, w bytes an element); the epilogue drops that name (_release_ipg_buffers) but
    # ``averaged_gradients`` holds its views until the step has flattened them into a new tensor
    # (flatten_dense_tensors_aligned, a copy in any precision): the partition, not the bucket, is what the step holds
    # beside its flat copy (measured: a two-layer Qwen3-MoE, fp32 ZeRO-2 on the CPU, 16 K-element buckets, peaked at
    # 190.9 MB, one 26.7 MB partition above the bucket-only price; a bucket as large as the partition hid it)
    step_held = max(bucket_bytes, w * psi) if config.zero_stage == 1 else max(bucket_bytes, w * shard)
    return ModelStates(
        params=params, master=FP32 * shard, optimizer=optimizer, grads_resident=grads_resident,
        gathered_params=0.0,
        # the fp32 gradient partition handed to the optimizer
        grads_step=FP32 * shard,
        step_scratch=max(optimizer_scratch, step_held - grads_resident + flat_copy),
        # flat buffer and fp32 partition next to the built model
        init_extra=max(0.0, w * psi + FP32 * shard - (built - params)),
        built=built,
    )


def _stage3_states(config: Config, facts: ModelFacts, shard: float, world_size: int, device_kind: str,
                   optimizer: float, optimizer_scratch: float, built: float) -> ModelStates:
    """ZeRO 3: parameters partitioned too (those under the persistence threshold stay whole, stage3.py
    persistent_parameters); a gradient partition and the reduce bucket live for the whole run; layers gather
    their parameters while they run (:func:`stage3_live_elements`); the model is built under zero.Init."""
    psi, frozen = float(facts.n_trainable_params), float(facts.n_params - facts.n_trainable_params)
    w = WORKING_BYTES[config.precision]
    persistent = float(facts.n_persistent_params)
    partitioned = psi - persistent
    params = w * (persistent + partitioned / world_size + frozen)
    # zero.Init: each module is made whole in w (fp32 tensor by tensor) then partitioned (Init._post_init_method)
    built = params + w * facts.largest_module_params + FP32 * float(facts.largest_param_numel)
    buckets = buckets_of(config, facts)
    sub_group = min(shard, largest_zero3_sub_group(facts, world_size) or shard)
    # one rank gathers nothing: all_gather_coalesced takes _no_gather_coalesced (NoGatherHandle), each parameter a
    # view of its partition
    gathers = world_size > 1
    return ModelStates(
        params=params, master=FP32 * shard, optimizer=optimizer,
        grads_resident=w * shard + reduce_buffers(config) * reduce_bucket_bytes(psi, buckets.reduce_bucket_size, w,
                                                                                device_kind),
        gathered_params=(w * stage3_live_elements(partitioned, facts.largest_module_params, buckets)
                         + qwz_in_flight_bytes(config, partitioned, facts.largest_module_params, buckets))
        if gathers else 0.0,
        # stage3.py _prepare_fp32_grad_for_sub_group: the partition's gradients flattened into a new tensor and
        # cast to fp32 (``flatten(...).to(fp32)``: in 16-bit the flat copy and its fp32 cast are alive at once)
        # become the fp32 partition's .grad for the step, one sub-group at a time (``_release_sub_group`` drops it
        # before the next): the largest sub-group's
        grads_step=FP32 * sub_group,
        step_scratch=max(optimizer_scratch, w * sub_group if w != FP32 else 0.0),
        # deepspeed.initialize: defragment() copies the partitions into one flat buffer; the fp32 master is
        # made by .to(fp32) and then .clone() (stage3.py _create_fp32_partitions): twice for a moment
        init_extra=max(0.0, w * shard + 2 * FP32 * shard - (built - params)),
        reduce_scratch=stage3_reduce_scratch_bytes(psi, w, device_kind, buckets.reduce_bucket_size),
        built=built,
        gathered_at_reduce=w * float(facts.largest_module_params) if gathers else 0.0,
        secondary_params=w * partitioned / config.hpz_partition_size if config.hpz_partition_size > 1 else 0.0,
    )


def stage3_reduce_scratch_bytes(n_elements: float, element_bytes: int, device_kind: str,
                                bucket_elements: int) -> float:
    """ZeRO-3's reduce of a gradient bucket (stage3.py ``__avg_scatter_grads``): ``reduce_scatter_coalesced``
    (runtime/comm/coalesced_collectives.py) ``torch.cat``s the bucket's gradients, rank by rank, into one
    flat buffer and reduce-scatters it into a chunk of itself. At the end of backward the last bucket holds
    every gradient not yet reduced, at most ``reduce_bucket_size``. NCCL reduces in place; the CPU backend
    copies its input (measured: ``dist.reduce_scatter_fn`` on a 20 MiB tensor, one rank, peaks 19.9 MiB above it;
    ``reduce_scatter_coalesced`` of 5 tensors of 4 MiB, 39.8)."""
    flat = element_bytes * min(n_elements, bucket_elements)
    return float(flat * (2 if device_kind == "cpu" else 1))


def stage3_live_elements(gatherable: float, largest_module_params: float, buckets: ZeroBuckets) -> float:
    """Elements ZeRO-3 holds gathered on a rank beyond its own partition, at most.

    A gathered module is whole: ``_all_gather_dtype`` (partition_parameters.py) gathers into a flat tensor of
    ``partition x world`` elements, the rank's own share copied in, and the parameters become views of it
    while their partition (``ds_tensor``) stays allocated. So ``gatherable`` counts every partitioned
    element, the rank's own included. (On one rank with the partition on the device, nothing is gathered:
    ``NoGatherHandle`` makes the parameter a view of its partition; the caller prices 0.)

    The parameter coordinator (partitioned_param_coordinator.py) releases a module's parameters after
    it runs unless they are used again within ``stage3_max_reuse_distance`` elements of the module
    order (``__params_to_release``): at the turn from forward to backward the last
    ``max_reuse_distance / 2`` elements of layers stay gathered (they are traversed once more in forward
    and once in backward before their reuse). It prefetches up to ``stage3_prefetch_bucket_size``
    elements ahead (capped by ``stage3_max_live_parameters``), and the running module is whole.
    A model smaller than that keeps everything gathered, each module once.
    """
    window = buckets.stage3_max_reuse_distance / 2 + min(buckets.stage3_prefetch_bucket_size,
                                                         buckets.stage3_max_live_parameters)
    return min(gatherable, window + largest_module_params)


def qwz_in_flight_bytes(config: Config, gatherable: float, largest_module_params: float,
                        buckets: ZeroBuckets) -> float:
    """qwZ's int8 gather buffers beside the gathered parameters: a quantized gather lands in a flat int8 tensor
    (partition_parameters.py ``_all_gather_coalesced``, ``dtype=torch.int8``) that lives until ``wait`` dequantizes it
    into the working precision, so at most what is in flight at once, the prefetched elements and the running module
    (:func:`stage3_live_elements`), is held a byte an element more; 0 without qwZ."""
    if not config.quantized_weights:
        return 0.0
    in_flight = min(buckets.stage3_prefetch_bucket_size, buckets.stage3_max_live_parameters) + largest_module_params
    return QWZ_BYTES * min(gatherable, in_flight)


def _offloaded(states: ModelStates, config: Config, facts: ModelFacts, world_size: int) -> ModelStates:
    """What stays on the device when ZeRO offloads the optimizer and/or the parameters.

    Optimizer offload: the fp32 partition, its gradient and the optimizer states live on the host
    (``self.device = 'cpu'`` in stage_1_and_2.py and stage3.py); ZeRO 1/2 keep a device buffer of the
    largest parameter for each gradient's copy down (``temp_grad_buffer_for_gpu_offload``), ZeRO-3 keeps
    only its reduce bucket (its gradient partition buffer, ``grad_partitions_flat_buffer``, is on the host).
    Parameter offload (ZeRO-3): the partition lives on the host (``param_groups_fp16_flat_cpu_memory``);
    the device holds the persistent parameters and what is gathered, the rank's own share included.
    """
    w = WORKING_BYTES[config.precision]
    changes: dict[str, float] = {}
    if config.offload_optimizer != "none":
        changes |= {"master": 0.0, "optimizer": 0.0, "step_scratch": 0.0}
        if config.zero_stage == 3:
            bucket = reduce_buffers(config) * reduce_bucket_bytes(
                facts.n_trainable_params, buckets_of(config, facts).reduce_bucket_size, w, "cuda")
            changes |= {"grads_resident": bucket, "grads_step": 0.0, "init_extra": 0.0}
        else:
            changes |= {"grads_step": w * float(facts.largest_param_numel)}
            changes["init_extra"] = max(0.0, states.init_extra - FP32 * facts.n_trainable_params / world_size)
    if config.offload_params != "none" and config.zero_stage == 3:
        persistent = float(facts.n_persistent_params)
        partitioned = facts.n_trainable_params - persistent
        frozen = float(facts.n_params - facts.n_trainable_params)
        params = w * (persistent + frozen)
        buckets = buckets_of(config, facts)
        gathered = (w * stage3_live_elements(partitioned, facts.largest_module_params, buckets)
                    + qwz_in_flight_bytes(config, partitioned, facts.largest_module_params, buckets))
        built = params + w * facts.largest_module_params + FP32 * facts.largest_param_numel
        changes |= {"params": params, "gathered_params": gathered, "built": built, "init_extra": 0.0,
                    "gathered_at_reduce": w * float(facts.largest_module_params)}
    return replace(states, **changes)
