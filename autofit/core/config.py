"""One training configuration: the canonical keys of docs/design.md ("Config keys").

A :class:`Config` is what the search space enumerates, what the cost model
prices, what a probe runs and what ``emit`` turns into a DeepSpeed JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

from autofit.core.errors import AutofitError

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
Optimizer = Literal["adamw", "adamw8bit", "lion", "adafactor", "sgd", "adam_mini"]
OffloadDevice = Literal["none", "cpu", "nvme"]
Attention = Literal["eager", "sdpa", "flash"]
TraceDtype = Literal["fp32", "bf16"]
Granularity = Literal["block", "attention"]
Compile = Literal["off", "on"]
ActivationOffload = Literal["none", "cpu"]

PRECISIONS: tuple[Precision, ...] = get_args(Precision)
OPTIMIZERS: tuple[Optimizer, ...] = get_args(Optimizer)
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES: tuple[OffloadDevice, ...] = get_args(OffloadDevice)
ATTENTIONS: tuple[Attention, ...] = get_args(Attention)
GRANULARITIES: tuple[Granularity, ...] = get_args(Granularity)
COMPILES: tuple[Compile, ...] = get_args(Compile)
ACTIVATION_OFFLOADS: tuple[ActivationOffload, ...] = get_args(ActivationOffload)
#: the long-context keys (docs/design.md, "Config keys"): off where the workload states no sequence
LONG_CONTEXT_KEYS = ("sequence_parallel", "tiled_mlp", "tiled_loss", "offload_activations")
#: multiples of the model-derived ZeRO bucket sizes a space may list (:mod:`autofit.ds.buckets`)
BUCKET_SCALES = (1, 2, 4, 8)

#: bytes of one element of the 16-bit (or 8-bit) working copy for each precision
WORKING_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


@dataclass(frozen=True)
class Config:
    """A point of the search space. Field names are the public config keys."""

    micro_batch_size: int = 1
    """Samples per device per forward pass."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step (global batch = micro x accum x data-parallel size)."""
    checkpoint_ratio: float = 0.0
    """The first ``round(r x L)`` of the L repeated layers run under activation checkpointing."""
    precision: Precision = "fp32"
    """fp32, or bf16/fp16/fp8 as DeepSpeed means them (16-bit weights and grads, fp32 master)."""
    optimizer: Optimizer = "adamw"
    """adamw, adamw8bit (bitsandbytes), lion, adafactor, sgd or adam_mini (the adam-mini package)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3."""
    offload_optimizer: OffloadDevice = "none"
    """Where ZeRO keeps optimizer states: none, cpu or nvme."""
    offload_params: OffloadDevice = "none"
    """Where ZeRO-3 keeps parameters: none, cpu or nvme."""
    attention: Attention = "sdpa"
    """Attention kernel: eager, sdpa or flash (only where the workload lets it be chosen)."""
    checkpoint_granularity: Granularity = "block"
    """What each checkpointed layer recomputes: the whole ``block``, or only its ``attention`` sub-module
    (selective checkpointing; :meth:`autofit.workload.types.Workload.attention_of` finds it)."""
    compile: Compile = "off"
    """``on``: the model runs under ``torch.compile`` through DeepSpeed's own ``engine.compile()``
    (:func:`autofit.ds.apply.compile_engine`; inductor); the first step compiles, timed apart from the step."""
    overlap_comm: bool = False
    """ZeRO's ``overlap_comm``: reduce gradients on a side stream while backward runs (ZeRO 1/2 double the
    reduce bucket for it; ZeRO-3 reduces on its own stream); off: each bucket's reduce waits for itself."""
    contiguous_gradients: bool = True
    """ZeRO's ``contiguous_gradients``: copy each gradient into a preallocated reduce bucket as backward makes it
    (less fragmentation, one bucket of memory); off: no bucket buffer, each bucket is flattened when reduced."""
    bucket_scale: int = 1
    """Multiple of the model-derived ZeRO bucket sizes (reduce and all-gather buckets ``hidden^2``, ZeRO-3's
    prefetch ``0.9 hidden^2``: the Hugging Face integration's ``auto`` values; :mod:`autofit.ds.buckets`).
    Larger buckets mean fewer, larger collectives for more memory."""
    hpz_partition_size: int = 1
    """ZeRO++'s hierarchical partitioning (hpZ; ``zero_optimization.zero_hpz_partition_size``, ZeRO-3; 1: off): each
    rank also keeps a secondary partition of the parameters, ``1 / hpz`` of them, over the ``hpz`` consecutive ranks of
    its node, made as forward releases each module (``partition_parameters.py``, ``_partition_param_sec``) and dropped
    after the optimizer step (``stage3.py``, ``invalidate_secondary_tensor``). Every gather of a step but the first
    forward's reads it on the node's links instead of the network (ZeRO++, Wang et al. 2023, sec. 3.2)."""
    tensor_parallel: int = 1
    """DeepSpeed AutoTP's degree ``tp`` (``tensor_parallel.autotp_size``; 1: off): each group of ``tp`` consecutive
    ranks of a node holds one copy of the model with the Linear layers its Hugging Face ``tp_plan`` names split
    between them (``deepspeed/runtime/engine.py``, ``_configure_tensor_parallel``), every rank of the group
    training on the same micro-batch. Data-parallel size is ``world / (tp x sp)``."""
    sequence_parallel: int = 1
    """Ulysses sequence-parallel degree ``sp`` (DeepSpeed's ``sequence_parallel_size``; 1: off): each group of ``sp``
    ranks trains one sequence, each rank ``seq/sp`` of its tokens (all of them for ``heads/sp`` heads inside
    attention). Data-parallel size is ``world / sp``: ``micro x accumulation x (world / sp) = global batch``."""
    tiled_mlp: bool = False
    """DeepSpeed's ``TiledMLP``: each layer's MLP runs over ``ceil((seq/sp) / hidden)`` tiles of the sequence, its
    intermediates one tile at a time, recomputed in backward (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``)."""
    tiled_loss: bool = False
    """The logits and the loss computed in sequence tiles (``sequence_tiled_compute``; Liger's chunking rule
    ``ceil(vocab / hidden)`` tiles), so the ``seq x vocab`` logits and their fp32 copies never exist whole."""
    offload_activations: ActivationOffload = "none"
    """``cpu``: the checkpointed layers' inputs are kept in host memory between forward and backward (DeepSpeed's
    checkpoint-offload, ``get_checkpoint_hidden_states_offloading_ctx_manager``); needs ``checkpoint_ratio > 0``."""
    quantized_weights: bool = False
    """ZeRO++'s qwZ (``zero_optimization.zero_quantized_weights``, ZeRO-3): every parameter all-gather moves int8
    blocks with an fp32 scale each instead of the working precision (``partition_parameters.py``, ``CUDAQuantizer``),
    dequantized on arrival. It changes the forward's and backward's weights: only where the recipe allows ``qwz``."""
    quantized_gradients: bool = False
    """ZeRO++'s qgZ (``zero_optimization.zero_quantized_gradients``, ZeRO-3 across nodes): the gradients reduced by
    two all-to-alls of int4 blocks, inside the node and then across nodes (``coalesced_collectives.py``,
    ``all_to_all_quant_reduce``), instead of a reduce-scatter. It changes the gradients: only where allowed (``qgz``)."""

    def __post_init__(self) -> None:
        _check_int("micro_batch_size", self.micro_batch_size)
        _check_int("grad_accum_steps", self.grad_accum_steps)
        ratio = self.checkpoint_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            raise AutofitError(f"checkpoint_ratio must be a number within 0.0 ... 1.0, but got {ratio!r}")
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("zero_stage", self.zero_stage, ZERO_STAGES)
        _check_choice("offload_optimizer", self.offload_optimizer, OFFLOAD_DEVICES)
        _check_choice("offload_params", self.offload_params, OFFLOAD_DEVICES)
        _check_choice("attention", self.attention, ATTENTIONS)
        _check_choice("checkpoint_granularity", self.checkpoint_granularity, GRANULARITIES)
        _check_choice("compile", self.compile, COMPILES)
        _check_bool("overlap_comm", self.overlap_comm)
        _check_bool("contiguous_gradients", self.contiguous_gradients)
        _check_choice("bucket_scale", self.bucket_scale, BUCKET_SCALES)
        _check_int("hpz_partition_size", self.hpz_partition_size)
        _check_int("tensor_parallel", self.tensor_parallel)
        _check_int("sequence_parallel", self.sequence_parallel)
        _check_bool("tiled_mlp", self.tiled_mlp)
        _check_bool("tiled_loss", self.tiled_loss)
        _check_choice("offload_activations", self.offload_activations, ACTIVATION_OFFLOADS)
        _check_bool("quantized_weights", self.quantized_weights)
        _check_bool("quantized_gradients", self.quantized_gradients)

    def to_dict(self) -> dict[str, Any]:
        """Every key and its value, in :data:`CONFIG_KEYS` order: what ``dataclasses.asdict`` gives, without its deep
        copy (every value is a scalar), which was a fifth of a warm 70B plan (two calls a candidate)."""
        return {name: getattr(self, name) for name in CONFIG_KEYS}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Config:
        unknown = set(values) - set(CONFIG_KEYS)
        if unknown:
            raise AutofitError(f"unknown config key {sorted(unknown)[0]!r}; known keys: {', '.join(CONFIG_KEYS)}")
        return cls(**{k: coerce_value(k, v) for k, v in values.items()})

    def with_(self, **changes: Any) -> Config:
        return replace(self, **changes)

    def checkpointed_layers(self, n_layers: int) -> int:
        """``round(r x L)``: how many of the first layers run under checkpointing."""
        return int(round(self.checkpoint_ratio * n_layers))

    def data_parallel(self, world_size: int) -> int:
        """Data-parallel ranks of ``world_size``: ``world / (tensor_parallel x sequence_parallel)`` (each TP group holds
        one copy of the model, each SP group trains one micro-batch)."""
        return max(1, world_size // (self.tensor_parallel * self.sequence_parallel))

    def samples_per_step(self, world_size: int) -> int:
        """Samples of one optimizer step over ``world_size`` ranks: micro x accumulation x data-parallel ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.data_parallel(world_size)

    @property
    def trace_dtype(self) -> TraceDtype:
        """The dtype its activations were traced in (:func:`trace_dtype_of`)."""
        return trace_dtype_of(self.precision)

    def key(self) -> str:
        """A canonical string of every key, equal for equal configs (what records and studies match on)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def label(self) -> str:
        """A short human-readable name, stable for one config."""
        parts = [
            f"mb{self.micro_batch_size}x{self.grad_accum_steps}",
            self.precision,
            self.optimizer,
            f"z{self.zero_stage}",
            f"ckpt{self.checkpoint_ratio:g}{'attn' if self.checkpoint_granularity == 'attention' else ''}",
            self.attention,
        ]
        if self.compile == "on":
            parts.append("compiled")
        if self.overlap_comm:
            parts.append("overlap")
        if not self.contiguous_gradients:
            parts.append("noncontig")
        if self.bucket_scale != 1:
            parts.append(f"bucket{self.bucket_scale}x")
        if self.offload_optimizer != "none":
            parts.append(f"opt>{self.offload_optimizer}")
        if self.offload_params != "none":
            parts.append(f"par>{self.offload_params}")
        if self.hpz_partition_size > 1:
            parts.append(f"hpz{self.hpz_partition_size}")
        if self.tensor_parallel > 1:
            parts.append(f"tp{self.tensor_parallel}")
        parts += ["qwz"] if self.quantized_weights else []
        parts += ["qgz"] if self.quantized_gradients else []
        return " ".join(parts + self.long_context_labels())

    def long_context_labels(self) -> list[str]:
        """The long-context keys in short: ``sp2 tmlp tloss aoff`` (empty where all are off)."""
        parts = [f"sp{self.sequence_parallel}"] if self.sequence_parallel > 1 else []
        parts += ["tmlp"] if self.tiled_mlp else []
        parts += ["tloss"] if self.tiled_loss else []
        return parts + (["aoff"] if self.offload_activations != "none" else [])


def trace_dtype_of(precision: str) -> TraceDtype:
    """fp32 traces in fp32; bf16, fp16 and fp8 (whose activations around fp8 matmuls stay 16-bit) in bf16."""
    return "fp32" if precision == "fp32" else "bf16"


CONFIG_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Config))
_INT_KEYS = {"micro_batch_size", "grad_accum_steps", "zero_stage", "bucket_scale", "hpz_partition_size", "tensor_parallel",
             "sequence_parallel"}
_BOOL_KEYS = {"overlap_comm", "contiguous_gradients", "tiled_mlp", "tiled_loss", "quantized_weights",
              "quantized_gradients"}
_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def coerce_value(key: str, value: Any) -> Any:
    """Turn a value from YAML or ``--set key=value`` into the key's type, naming both on failure."""
    if key not in CONFIG_KEYS:
        raise AutofitError(f"unknown config key {key!r}; known keys: {', '.join(CONFIG_KEYS)}")
    if key in _BOOL_KEYS:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise AutofitError(f"{key} must be true or false (on/off), but got {value!r}")
    try:
        if key in _INT_KEYS:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if key == "checkpoint_ratio":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if key == "compile" and isinstance(value, bool):
            return "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        return str(value).lower()
    except (TypeError, ValueError):
        kind = "an integer" if key in _INT_KEYS else "a number"
        raise AutofitError(f"{key} must be {kind}, but got {value!r}") from None


def parse_set(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``["zero_stage=2", "precision=bf16"]`` -> ``{"zero_stage": 2, "precision": "bf16"}``."""
    fixed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise AutofitError(f"--set takes key=value, but got {pair!r}")
        coerced = coerce_value(key, value.strip())
        if key in fixed and fixed[key] != coerced:
            raise AutofitError(f"--set {key} is given twice with different values ({fixed[key]!r} and {coerced!r}): "
                               "give it once")
        fixed[key] = coerced
        Config.from_dict({key: fixed[key]})  # validate the value alone, with a clear message
    return fixed


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AutofitError(f"{name} must be an integer >= 1, but got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise AutofitError(f"{name} must be true or false, but got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise AutofitError(f"{name} must be one of {', '.join(map(str, choices))}, but got {value!r}")
