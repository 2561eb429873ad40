"""The caching allocator's reserve for a plan: the requests a training process makes, synthesized and replayed.

What NVML sees of a CUDA rank is the allocator's reserved peak plus what lives outside it
(:mod:`autofit.cost_model.cuda_runtime`); the reserved peak is the allocated peak plus the free bytes the
allocator holds cached at that moment, the *reserve*. The reserve is no ratio: it follows from the order and sizes
of the requests (docs/results/allocator.md, "Where the reserve comes from": 11-49% of the reserved peak on the
H200's histories). So :func:`synthesize` writes down the requests a plan's process makes of the allocator, from
the model's facts, in DeepSpeed's and PyTorch's order, and :func:`reserve_bytes` replays them through
:class:`~autofit.cost_model.allocator.CachingAllocator` and returns reserved peak less allocated peak, which the
memory model adds to its allocated peak.

The sequence keeps what moves a reserved peak (the same page: requests under 1 MiB change none by more than
0.3%; the 1-10 MiB ones and their 20 MiB segments up to 11%; the flat buffers and the loss's vocabulary-sized
tensors most of all):

* **copy** (ZeRO 0-2): the model's parameters reach the device one tensor at a time, twice each in the working
  precision, and stay until ``deepspeed.initialize`` has flattened them into one buffer, when both copies are
  freed (the histories; engine.py ``_configure_distributed_model`` moves the module, the 16-bit optimizer
  flattens it). ZeRO-3 builds under ``zero.Init`` and ``empty_cache`` gives every segment back before its flat
  buffers (partition_parameters.py, stage3.py ``_create_fp16_partitions_with_defragmentation``), so its copy
  leaves nothing and is not written.
* **init**: DeepSpeed's flat buffers in the order it makes them, with the temporaries freed where it frees them.
  ZeRO-0 (``BF16_Optimizer``, runtime/bf16_optimizer.py): the 16-bit flat copy, a second one, the fp32 master,
  the second 16-bit one freed, three fp32 buffers (the optimizer's states and the zero gradient
  ``initialize_optimizer_states`` steps on), the gradient freed. ZeRO 1-2 (stage_1_and_2.py): the rank's fp32
  partition and its states, made the same way. ZeRO-3 (stage3.py): the 16-bit partition, the fp32 partition per
  sub-group (``sub_group_size`` elements, whole tensors), two fp32 temporaries, a 16-bit one that stays.
* **two steps**: each layer's saved activations (the trace's, cut into tensors of the hidden and the MLP's
  width), checkpointed layers recomputed in backward; the loss's vocabulary-sized tensors in the order the
  histories show them (16-bit logits, their fp32 upcast, the fp32 log-softmax, the upcast freed with the 16-bit
  logits; in backward two fp32 gradients and a 16-bit one); the parameters' gradients as backward makes them
  (ZeRO 0-1: one a tensor, kept; ZeRO 2-3: reduced out in buckets); the optimizer step's temporaries (ZeRO-0:
  each gradient in fp32, then their flat fp32 copy; ZeRO 1-3: the partition's fp32 gradient; ZeRO-3 makes
  Adam's states at its first step). Two steps suffice: in every history no phase after step 2 made a segment.

* **cuBLAS's workspaces**: PyTorch gives cuBLAS a workspace from the caching allocator per handle and stream, at
  the first matmul of each, kept for the process (aten/src/ATen/cuda/CublasHandlePool.cpp ``getNewWorkspace``;
  cuBLASLt shares it, ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``). Handles are per thread, so a training step makes two:
  the forward's, at its first matmul, and the backward's (autograd's device thread), at the head's first matmul
  after the loss's backward (their size:
  :func:`autofit.cost_model.cuda_runtime.cublas_workspace_bytes`). Small as they are, where they land can split a
  large free block the next step's loss needs whole, and cost a segment (docs/results/gpu-truth.md).

Beyond the histories (which hold none of them) the sequence follows the memory model: offload keeps the fp32
buffers (and ZeRO-3's offloaded partition) off the device, the long-context keys scale the layers' bytes as
:mod:`autofit.cost_model.long_context` prices them and the tiled loss never holds whole logits; fp8 is its
16-bit storage, without the casts' own buffers; a model whose trace knows no vocabulary gets no loss tensors.
fp32 training (plain ``torch.optim`` without DeepSpeed's 16-bit optimizer) is not synthesized: no reserve is
priced for it. ``expandable_segments:True`` is priced by the same replay (:func:`reserve_bytes`'s ``settings``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autofit.core.config import WORKING_BYTES, Config
from autofit.cost_model.allocator import K_MIN_LARGE_ALLOC, K_SMALL_SIZE, AllocatorSettings, CachingAllocator
from autofit.cost_model.facts import ModelFacts
from autofit.cost_model.long_context import long_context_activation_bytes

FP32 = 4
#: DeepSpeed's ZeRO-3 ``sub_group_size`` default (runtime/zero/config.py): the fp32 partition is cut into groups of
#: whole tensors of at least this many elements
SUB_GROUP_ELEMENTS = 10**9


@dataclass(frozen=True)
class Request:
    """One call on the allocator: ``alloc`` (``size`` bytes, named ``name``) or ``free`` (of ``name``)."""

    action: str
    name: int = 0
    size: int = 0


class _Sequence:
    """A request list being written: ``alloc`` returns the new block's name."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._next = 0

    def alloc(self, size: float) -> int:
        self._next += 1
        self.requests.append(Request("alloc", self._next, max(1, int(size))))
        return self._next

    def free(self, *names: int) -> None:
        self.requests.extend(Request("free", name) for name in names)


class _Replay(_Sequence):
    """The same calls made on a simulated allocator as they are written (no list kept): a block's name is its
    address."""

    def __init__(self, allocator: CachingAllocator) -> None:
        super().__init__()
        self.allocator = allocator

    def alloc(self, size: float) -> int:
        return self.allocator.malloc(max(1, int(size)))

    def free(self, *names: int) -> None:
        for name in names:
            self.allocator.free(name)


@dataclass(frozen=True)
class Parameters:
    """Elements of the model's parameter tensors, in module order."""

    embedding: int
    """The token embedding (``vocab x h``); 0 where the model has none."""
    layers: tuple[tuple[int, ...], ...]
    """Each repeated layer's tensors."""
    rest: int
    """What else lies outside the layers (the final norm), as one tensor."""
    head: int
    """An untied output head (``vocab x h``); 0 where the head is the embedding."""

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """The tensors by module, in module order: the embedding, each layer, the rest, the head."""
        outside = [(t,) for t in (self.embedding,) if t]
        return outside + list(self.layers) + [(t,) for t in (self.rest, self.head) if t]

    @property
    def tensors(self) -> list[int]:
        return ([self.embedding] if self.embedding else []) + [t for layer in self.layers for t in layer] + \
            ([self.rest] if self.rest else []) + ([self.head] if self.head else [])


def parameter_tensors(facts: ModelFacts) -> Parameters:
    """The model's parameter tensors from its widths: in a layer, attention's query and output (``h x h``), key and
    value (``h x kv_width``) and the MLP's ``mlp_matrices`` (``h x intermediate``), what else it holds (norms,
    biases) as tensors of ``h``; outside the layers the embedding (``vocab x h``), and an untied head of its size
    where the parameters outside the layers hold a second one. Without widths, each layer one tensor.

    Memoized on ``facts`` (every replay of a plan asks)."""
    found: Parameters | None = facts.__dict__.get("_parameters_memo")
    if found is None:
        found = _parameter_tensors(facts)
        object.__setattr__(facts, "_parameters_memo", found)  # not a field: as ModelFacts.at_checkpointed's memo
    return found


def _parameter_tensors(facts: ModelFacts) -> Parameters:
    h, vocab = facts.hidden_size, facts.vocab_size
    layers: list[tuple[int, ...]] = []
    for params in facts.layer_params:
        tensors: list[int] = []
        if h and facts.intermediate_size:
            kv = facts.kv_width or h
            tensors = [h * h, h * kv, h * kv, h * h] + [h * facts.intermediate_size] * max(1, facts.mlp_matrices)
            if sum(tensors) > params:
                tensors = []
        rest = params - sum(tensors)
        if tensors and h:  # norms and biases: vectors of the hidden width
            tensors += [h] * (rest // h) + ([rest % h] if rest % h else [])
        elif rest:
            tensors.append(rest)
        layers.append(tuple(tensors))
    outside = facts.n_params - sum(facts.layer_params)
    embedding = vocab * h if h and vocab and 0 < vocab * h <= outside else 0
    head = embedding if outside - embedding >= embedding > 0 else 0
    return Parameters(embedding=embedding, layers=tuple(layers), rest=outside - embedding - head, head=head)


def _coalesced(sizes: list[float]) -> list[int]:
    """Requests made one after another and freed together (a module's parameters or gradients), those of
    ``kMinLargeAlloc`` (10 MiB) or more as one (see :func:`_chunks`)."""
    large = sum(int(size) for size in sizes if size >= K_MIN_LARGE_ALLOC)
    return ([large] if large else []) + [int(size) for size in sizes if 0 < size < K_MIN_LARGE_ALLOC]


def _chunks(total: float, sizes: list[int]) -> list[int]:
    """``total`` bytes as tensors of ``sizes`` in turn (the last one repeated), the remainder one more; those of
    ``kMinLargeAlloc`` (10 MiB) or more as one request. Such a request gets a segment of its own size where no free
    block fits it, so made together and freed together they reserve what one request of their sum does; the
    1-10 MiB ones, which share 20 MiB segments, stay apart. Those of ``kSmallSize`` (1 MiB) or less, which the small
    pool packs into 2 MiB segments end to end, are made as requests of up to 1 MiB each (a few tokens' hidden states,
    8 KiB, would otherwise be thousands a layer). This keeps a replay to a few thousand requests at any length."""
    left = int(total)
    pieces: list[int] = []
    for size in sizes[:-1]:
        if left <= 0 or size <= 0:
            break
        pieces.append(min(left, size))
        left -= pieces[-1]
    last = sizes[-1] if sizes else 0
    if left > 0 and last > 0:
        repeats, remainder = divmod(left, last)
        together = max(1, repeats if last >= K_MIN_LARGE_ALLOC else K_SMALL_SIZE // last)  # 1: 1-10 MiB, apart
        whole, rest = divmod(repeats, together)
        pieces += [last * together] * whole + ([last * rest] if rest else [])
        pieces += [remainder] if remainder else []
    return _coalesced([float(piece) for piece in pieces])


@dataclass(frozen=True)
class _Step:
    """What one training step of a plan asks, in bytes (one rank)."""

    layers_full: float
    """A layer's saved activations, not checkpointed."""
    layers_ckpt: float
    """A checkpointed layer's (its input)."""
    transient: float
    """What a layer's backward holds beyond its saved tensors."""
    n_ckpt: int
    unit_hidden: int
    unit_mlp: int
    mlp_tensors: int
    logits: int
    """The 16-bit logits, ``micro-batch x tokens x vocab x w``."""


def _step_shape(config: Config, facts: ModelFacts) -> _Step:
    w = WORKING_BYTES[config.precision]
    p = config.sequence_parallel
    mb, tokens = config.micro_batch_size, (facts.seq_len or facts.tokens_per_sample or 1) // p
    # the tiled loss never holds the whole logits (DeepSpeed's TiledFusedLogitsLoss: a tile at a time, small)
    logits = 0 if config.tiled_loss else mb * tokens * facts.vocab_size * w
    layers = max(1, facts.n_layers)
    n_ckpt = config.checkpointed_layers(facts.n_layers)

    def at(n: int, attr: str) -> float:
        return facts.at_checkpointed(config.trace_dtype, config.attention, n, mb, attr, config.checkpoint_granularity)

    # the long-context keys (SP, tiling, activation offload) change the layers' bytes as the memory model prices
    # them: the traced bytes are scaled by its ratio (cost_model/long_context.py)
    traced = at(n_ckpt, "peak_without_grads_bytes")
    scale = long_context_activation_bytes(config, facts, traced, at(n_ckpt, "head_peak_without_grads_bytes"),
                                          at(n_ckpt, "body_peak_without_grads_bytes")) / traced if traced else 1.0
    head_saved = 2 * mb * facts.seq_len * facts.vocab_size * w  # the fp32 log-softmax the loss keeps for backward
    full = max(0.0, at(0, "activation_bytes") - head_saved) / layers * scale
    ckpt = max(0.0, at(layers, "activation_bytes") - head_saved) / layers * scale
    # a layer's backward holds its recompute and temporaries beyond what forward saved: the body's peak over the
    # saved bytes (the whole step's peak where the trace has no per-part peaks)
    body = at(0, "body_peak_without_grads_bytes") or at(0, "peak_without_grads_bytes")
    transient = max(0.0, body - (at(0, "activation_bytes") - head_saved)) * scale
    if facts.hidden_size:
        hidden = mb * tokens * facts.hidden_size * w
        mlp = mb * tokens * (facts.intermediate_size or facts.hidden_size) * w
    else:  # no width known (a CNN, a model the structure pass does not read): a layer's saved bytes as one request
        hidden = mlp = max(1, int(max(full, ckpt)))
    return _Step(layers_full=full, layers_ckpt=ckpt, transient=transient, n_ckpt=n_ckpt, unit_hidden=hidden,
                 unit_mlp=mlp, mlp_tensors=max(1, facts.mlp_intermediates), logits=int(logits))


def synthesize(config: Config, facts: ModelFacts, world_size: int, workspace: int = 0) -> list[Request] | None:
    """The requests of a plan's process from the model's copy through two steps (module docstring), with cuBLAS
    workspaces of ``workspace`` bytes (:func:`autofit.cost_model.cuda_runtime.cublas_workspace_bytes`; 0: none);
    None where the plan runs what is not synthesized (fp32 training, a model with no layers traced)."""
    seq = _Sequence()
    return seq.requests if _write(seq, config, facts, world_size, workspace) else None


def replayed(config: Config, facts: ModelFacts, world_size: int, settings: AllocatorSettings | None = None,
             workspace: int = 0) -> CachingAllocator | None:
    """:func:`synthesize`'s requests made on a fresh simulated allocator as they are written; None where nothing is
    synthesized."""
    seq = _Replay(CachingAllocator(settings))
    return seq.allocator if _write(seq, config, facts, world_size, workspace) else None


def _write(seq: _Sequence, config: Config, facts: ModelFacts, world_size: int, workspace: int) -> bool:
    if config.precision == "fp32" or not facts.n_layers:
        return False
    w = WORKING_BYTES[config.precision]
    params = parameter_tensors(facts)
    tensors = params.tensors
    if config.zero_stage < 3:
        copies = [seq.alloc(size) for _ in range(2) for group in params.groups
                  for size in _coalesced([w * t for t in group])]
        seq.alloc(w * sum(tensors))  # the flat 16-bit parameters
        seq.free(*copies)
    # offload keeps the fp32 master, its states and gradients (and under ZeRO-3 the 16-bit partition) on the host
    fp32 = FP32 if config.offload_optimizer == "none" else 0
    partition = w if config.offload_params == "none" else 0
    _init(seq, config.zero_stage, w, tensors, world_size, fp32, partition)
    shape = _step_shape(config, facts)
    for step in range(2):
        _step(seq, config.zero_stage, shape, params, w, world_size, fp32, first=step == 0,
              workspace=workspace if step == 0 else 0, secondary_share=1 / config.hpz_partition_size
              if config.hpz_partition_size > 1 else 0.0)
    return True


def zero3_sub_groups(tensors: list[int], world_size: int) -> list[float]:
    """ZeRO-3's sub-groups of one rank, in elements: whole tensors' partitions until a group holds ``sub_group_size``
    (stage3.py ``_create_fp16_sub_groups``, which counts ``param.partition_numel()``); the fp32 partition, its
    gradient and the step's flat temporaries are made per sub-group."""
    groups: list[float] = []
    current = 0.0
    for t in tensors:
        current += t / world_size
        if current >= SUB_GROUP_ELEMENTS:
            groups.append(current)
            current = 0.0
    return groups + ([current] if current else [])


def largest_zero3_sub_group(facts: ModelFacts, world_size: int) -> float:
    """Elements of one rank's largest ZeRO-3 sub-group (:func:`zero3_sub_groups`), what the step's fp32 gradient and
    its 16-bit flat copy hold at once (:mod:`autofit.cost_model.states`). Memoized on ``facts`` by world size: every
    ZeRO-3 candidate of a plan asks."""
    memo: dict[int, float] = _memo(facts, "_sub_group_memo")
    if world_size not in memo:
        memo[world_size] = max(zero3_sub_groups(parameter_tensors(facts).tensors, world_size), default=0.0)
    return memo[world_size]


def _init(seq: _Sequence, stage: int, w: int, tensors: list[int], world_size: int, fp32: int,
          partition: int) -> None:
    """``deepspeed.initialize``'s buffers (module docstring); ``fp32`` and ``partition``: the bytes an element of the
    fp32 buffers and of ZeRO-3's 16-bit partition take on the device (0: offloaded)."""
    psi = sum(tensors)
    shard = psi / world_size if stage >= 1 else psi
    if stage == 0:
        second = seq.alloc(w * psi)
        seq.alloc(FP32 * psi)  # the fp32 master
        seq.free(second)
        states = [seq.alloc(FP32 * psi) for _ in range(3)]
        seq.free(states[0])
    elif stage in (1, 2) and fp32:
        seq.alloc(fp32 * shard)
        grad = seq.alloc(fp32 * shard)
        seq.alloc(fp32 * shard), seq.alloc(fp32 * shard)
        seq.free(grad)
    elif stage == 3:
        if partition:
            seq.alloc(partition * shard)
        for group in zero3_sub_groups(tensors, world_size) if fp32 else []:
            seq.alloc(fp32 * group)
            for _ in range(2):
                seq.free(seq.alloc(fp32 * group))
        if partition:
            seq.alloc(partition * shard)


def _loss(seq: _Sequence, logits_bytes: int) -> int:
    """The loss's vocabulary-sized tensors through forward and into backward, in the histories' order; returns the
    logits' 16-bit gradient, live while the head's weight gradient is made (0: no logits)."""
    if not logits_bytes:  # no vocabulary the trace knows: the layers and DeepSpeed's buffers only
        return 0
    logits = seq.alloc(logits_bytes)
    upcast = seq.alloc(2 * logits_bytes)
    log_probs = seq.alloc(2 * logits_bytes)
    seq.free(upcast, logits)
    first, second = seq.alloc(2 * logits_bytes), seq.alloc(2 * logits_bytes)
    seq.free(second, log_probs)
    grad = seq.alloc(logits_bytes)
    seq.free(first)
    return grad


def _reduced(seq: _Sequence, stage: int, w: int, tensors: tuple[int, ...]) -> list[int]:
    """A module's gradients as backward makes them: kept (ZeRO 0-1, returned) or reduced out at once (ZeRO 2-3;
    ZeRO-3 through an fp32 buffer of twice their elements, as the histories show)."""
    grads = [seq.alloc(size) for size in _coalesced([w * t for t in tensors])]
    if stage < 2:
        return grads
    if stage == 3:
        seq.free(*[seq.alloc(size) for size in _coalesced([2 * FP32 * t for t in tensors])])
    seq.free(*grads)
    return []


def _step(seq: _Sequence, stage: int, shape: _Step, params: Parameters, w: int, world_size: int, fp32: int,
          first: bool, workspace: int, secondary_share: float = 0.0) -> None:
    """One training step: forward, the loss, backward, the optimizer's temporaries (module docstring); ``workspace``:
    the bytes of the cuBLAS workspaces its first matmuls make, forward's and backward's (the first step's; 0: none).
    ``secondary_share``: hpZ's ``1 / hpz``: as forward releases a layer, each of its tensors gets its secondary
    partition before the gathered buffer is freed (partition_parameters.py ``_partition``), all kept until the step
    is over (stage3.py ``invalidate_secondary_tensor``)."""
    sizes = [shape.unit_mlp] * shape.mlp_tensors + [shape.unit_hidden]
    if workspace:
        seq.alloc(workspace)  # the forward's, at its first matmul: kept
    saved: list[list[int]] = []
    secondary: list[int] = []
    for index, layer in enumerate(params.layers):
        gathered = seq.alloc(w * sum(layer)) if stage == 3 else 0
        per_layer = shape.layers_ckpt if index < shape.n_ckpt else shape.layers_full
        saved.append([seq.alloc(size) for size in _chunks(per_layer, sizes)])
        if gathered:
            secondary += [seq.alloc(w * t * secondary_share) for t in layer] if secondary_share else []
            seq.free(gathered)
    logits_grad = _loss(seq, shape.logits)
    # the backward's workspace, on autograd's thread, kept: at the head's first matmul, which ZeRO-3's linear
    # (runtime/zero/linear.py ``LinearFunctionForZeroStage3.backward``: the input's gradient first) makes before the
    # weight's gradient and autograd's own (``mm``'s backward) after it
    if workspace and stage == 3:
        seq.alloc(workspace)
    head = params.head or params.embedding
    grads = _reduced(seq, stage, w, (head,)) if head else []
    if workspace and stage < 3:
        seq.alloc(workspace)
    if logits_grad:
        seq.free(logits_grad)
    for index in reversed(range(len(params.layers))):
        layer = params.layers[index]
        gathered = seq.alloc(w * sum(layer)) if stage == 3 else 0
        recomputed = [seq.alloc(size) for size in _chunks(shape.layers_full, sizes)] if index < shape.n_ckpt else []
        transient = [seq.alloc(size) for size in _chunks(shape.transient, sizes)]
        grads += _reduced(seq, stage, w, layer[::-1])
        seq.free(*transient, *recomputed, *saved[index])
        if gathered:
            seq.free(gathered)
    if params.head and params.embedding:
        grads += _reduced(seq, stage, w, (params.embedding,))
    _optimizer(seq, stage, w, params, grads, world_size, fp32, first)
    seq.free(*secondary)


def _optimizer(seq: _Sequence, stage: int, w: int, params: Parameters, grads: list[int], world_size: int,
               fp32: int, first: bool) -> None:
    """The optimizer step's temporaries, and the gradients freed (``zero_grad``); ``fp32`` as in :func:`_init`."""
    tensors = params.tensors
    psi = sum(tensors)
    if not fp32:  # offloaded: the step runs on the host
        seq.free(*grads)
    elif stage == 0:
        seq.free(seq.alloc(w * psi))  # the engine's all-reduce of every gradient, flattened (one rank too)
        upcast = [seq.alloc(size) for group in params.groups for size in _coalesced([FP32 * t for t in group])]
        flat = seq.alloc(FP32 * psi)
        seq.free(*upcast, *grads, flat)
    elif stage in (1, 2):
        flat = seq.alloc(FP32 * psi / world_size)
        seq.free(*grads, flat)
    else:
        for group in zero3_sub_groups(tensors, world_size):
            half = seq.alloc(w * group)
            grad = seq.alloc(FP32 * group)
            seq.free(half)
            if first:  # Adam's states, made at the first step
                seq.alloc(FP32 * group), seq.alloc(FP32 * group)
            seq.free(grad)


def replay_requests(requests: list[Request], settings: AllocatorSettings | None = None) -> CachingAllocator:
    """``requests`` through a fresh simulated allocator (segments at ascending stand-in addresses)."""
    allocator = CachingAllocator(settings)
    blocks: dict[int, int] = {}
    for request in requests:
        if request.action == "alloc":
            blocks[request.name] = allocator.malloc(request.size)
        else:
            allocator.free(blocks.pop(request.name))
    return allocator


def reserve_key(config: Config, facts: ModelFacts, world_size: int, workspace: int = 0) -> tuple[object, ...]:
    """What the reserve is priced by: the keys that decide the buffers and the step's large requests. The attention
    kernel, the checkpoint granularity, TiledMLP and activation offload change only the layers' activations, which
    set no reserve at the sizes measured (docs/results/allocator.md): configs differing only in them share one replay
    (the first priced), which keeps a plan of 66,000 candidates to a few hundred replays."""
    return (config.micro_batch_size, config.checkpointed_layers(facts.n_layers), config.zero_stage,
            config.precision == "fp32", config.offload_optimizer != "none", config.offload_params != "none",
            config.sequence_parallel, config.tiled_loss, config.hpz_partition_size, world_size, workspace)


def reserve_bytes(config: Config, facts: ModelFacts, world_size: int,
                  settings: AllocatorSettings | None = None, workspace: int = 0,
                  representatives: Mapping[tuple[object, ...], Config] | None = None) -> int:
    """What the allocator holds cached at its reserved peak beyond the allocated peak, for this plan: the replay of
    :func:`synthesize`'s requests (reserved peak less allocated peak), with cuBLAS workspaces of ``workspace`` bytes;
    0 where nothing is synthesized.

    Memoized on ``facts`` by :func:`reserve_key` and ``settings`` (:func:`reserve_memo`): the replay is of the
    config that asks first, or of ``representatives``' config for the key (a plan's first candidate of each:
    :meth:`autofit.planning.plan.Plan.price`, which asks of some candidates only)."""
    short = reserve_key(config, facts, world_size, workspace)
    key = (*short, settings)
    memo = reserve_memo(facts)
    if key not in memo:
        replayed_config = representatives.get(short, config) if representatives is not None else config
        allocator = replayed(replayed_config, facts, world_size, settings, workspace)
        memo[key] = 0 if allocator is None else allocator.peak_reserved_bytes - allocator.peak_allocated_bytes
    return memo[key]


def reserve_memo(facts: ModelFacts) -> dict[tuple[object, ...], int]:
    """The reserves :func:`reserve_bytes` priced for ``facts``, by :func:`reserve_key` and the allocator's settings
    (None: the defaults): kept on the facts as :meth:`ModelFacts.at_checkpointed`'s memo is, and on disk beside
    their trace by :mod:`autofit.planning.reserve_cache`, so a model planned again replays nothing."""
    return _memo(facts, "_reserve_memo")


def _memo(facts: ModelFacts, name: str) -> dict[Any, Any]:
    """The dict kept on ``facts`` under ``name``, made empty the first time: not a field, so not compared, copied or
    written (as :meth:`ModelFacts.at_checkpointed`'s memo)."""
    memo: dict[Any, Any] | None = facts.__dict__.get(name)
    if memo is None:
        memo = {}
        object.__setattr__(facts, name, memo)
    return memo
