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
:func:`memory_phases`, on the rows of benchmarks/memory_accuracy.py: docs/results/memory.md
("What changed") gives each reading, and tests/probe/test_probe.py checks the init and
ZeRO-3 reduce phases against a probe.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autofit.core.config import WORKING_BYTES, Config
from autofit.core.hardware import Hardware
from autofit.cost_model.coefficients import Coefficients
from autofit.cost_model.cuda_runtime import cublas_workspace_bytes, outside_allocator_bytes, runtime_bytes
from autofit.cost_model.facts import ModelFacts
from autofit.cost_model.fp8 import fp8_cast_bytes
from autofit.ds.buckets import ZeroBuckets, zero_buckets

FP32 = 4


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
    """The runtime: CUDA context, allocator and thread-pool overhead, the model's buffers."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.other


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
    step_held = max(bucket_bytes, w * psi) if config.zero_stage == 1 else bucket_bytes
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
    return ModelStates(
        params=params, master=FP32 * shard, optimizer=optimizer,
        grads_resident=w * shard + reduce_buffers(config) * reduce_bucket_bytes(psi, buckets.reduce_bucket_size, w,
                                                                                device_kind),
        gathered_params=w * stage3_live_elements(partitioned - partitioned / world_size, facts.largest_module_params,
                                                 buckets),
        # stage3.py _prepare_fp32_grad_for_sub_group: the partition's gradients flattened into a new tensor and
        # cast to fp32 (``flatten(...).to(fp32)``: in 16-bit the flat copy and its fp32 cast are alive at once)
        # become the fp32 partition's .grad for the step
        grads_step=FP32 * shard,
        step_scratch=max(optimizer_scratch, w * shard if w != FP32 else 0.0),
        # deepspeed.initialize: defragment() copies the partitions into one flat buffer; the fp32 master is
        # made by .to(fp32) and then .clone() (stage3.py _create_fp32_partitions): twice for a moment
        init_extra=max(0.0, w * shard + 2 * FP32 * shard - (built - params)),
        reduce_scratch=stage3_reduce_scratch_bytes(psi, w, device_kind, buckets.reduce_bucket_size),
        built=built,
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


def stage3_live_elements(not_on_device: float, largest_module_params: float, buckets: ZeroBuckets) -> float:
    """Elements ZeRO-3 holds gathered on a rank beyond its own partition, at most.

    The parameter coordinator (partitioned_param_coordinator.py) releases a module's parameters after
    it runs unless they are used again within ``stage3_max_reuse_distance`` elements of the module
    order (``__params_to_release``): at the turn from forward to backward the last
    ``max_reuse_distance / 2`` elements of layers stay gathered (they are traversed once more in forward
    and once in backward before their reuse). It prefetches up to ``stage3_prefetch_bucket_size``
    elements ahead (capped by ``stage3_max_live_parameters``), and the running module is whole.
    A model smaller than that keeps everything it does not own gathered.
    """
    window = buckets.stage3_max_reuse_distance / 2 + min(buckets.stage3_prefetch_bucket_size,
                                                         buckets.stage3_max_live_parameters)
    return min(not_on_device, window) + largest_module_params


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
        gathered = w * stage3_live_elements(partitioned, facts.largest_module_params, buckets_of(config, facts))
        built = params + w * facts.largest_module_params + FP32 * facts.largest_param_numel
        changes |= {"params": params, "gathered_params": gathered, "built": built, "init_extra": 0.0}
    return replace(states, **changes)


def activation_peak_bytes(config: Config, facts: ModelFacts, keep_grads: bool) -> float:
    """Peak live bytes of forward+backward from the trace, at this micro-batch and checkpoint ratio.

    Checkpointing the first k of L layers is interpolated between the traces with
    none, some (the space's middle ratio) and all layers checkpointed, at the config's granularity
    (the whole block, or only its attention: that granularity's own traces; :meth:`ModelFacts.at_checkpointed`).
    ``keep_grads``: gradients stay where autograd puts them (plain PyTorch, ZeRO 0/1)
    rather than being moved out as they are produced (ZeRO-2/3).
    """
    dtype = config.trace_dtype
    attr = "peak_with_grads_bytes" if keep_grads else "peak_without_grads_bytes"
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    return facts.at_checkpointed(dtype, config.attention, n_ckpt, config.micro_batch_size, attr, config.checkpoint_granularity)


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
    """The peak over the init, backward and step phases, split by what holds the bytes."""
    peak = max(memory_phases(config, facts, hardware, world_size, coefficients).values(), key=lambda m: m.total)
    if coefficients.memory_scale == 1.0:
        return peak
    fixed = runtime_bytes(hardware, world_size, coefficients.outside_allocator_bytes)  # CUDA's offset; CPU: 0
    return _scaled(peak, coefficients.memory_scale, fixed)


def kernel_footprint_bytes(config: Config, facts: ModelFacts, hardware: Hardware, coefficients: Coefficients) -> int:
    """What the model's kernels hold resident on a CPU device (code pages, oneDNN primitives): the model's own,
    measured (:mod:`autofit.probe.footprint`), else the coefficients' default; nothing on a GPU, whose memory
    holds no code (its context is :attr:`Hardware.context_bytes`)."""
    if hardware.kind != "cpu":
        return 0
    measured = facts.kernel_footprint_bytes.get(config.trace_dtype)
    if measured is not None:
        return measured
    return coefficients.kernel_footprint_bytes + (coefficients.runtime_16bit_extra_bytes if config.precision != "fp32" else 0)


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
    # CUDA: the context, NCCL's buffers and cuBLAS's workspace, priced or learned (cost_model/cuda_runtime.py);
    # the workspace comes with the first matmul, after initialize. CPU: the preset's context (0)
    outside = hardware.context_bytes
    workspace = 0
    if hardware.kind == "cuda":
        outside = outside_allocator_bytes(hardware, world_size, coefficients.outside_allocator_bytes)
        workspace = cublas_workspace_bytes(hardware)
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
            params=int(states.params + states.gathered_params),
            grads=int(states.grads_resident + held_grads),
            optimizer=int(states.master + states.optimizer),
            activations=int(activations + fp8_cast_bytes(config, facts)),
            other=runtime,
        ),
        # ZeRO-3's last gradient bucket is reduced when backward is over (stage3.py
        # independent_gradient_partition_epilogue): the activations are freed and so are the gathered
        # parameters, each module's after its own backward (parameter_offload.py post_sub_module_backward_function)
        "reduce": MemoryBreakdown(
            params=int(states.params),
            grads=int(states.grads_resident + held_grads + states.reduce_scratch),
            optimizer=int(states.master + states.optimizer),
            activations=0,
            other=runtime,
        ),
        "step": MemoryBreakdown(
            params=int(states.params),
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
