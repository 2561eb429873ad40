"""What the cost model knows about a model: measured by ``autofit.trace``, pure data here.

No torch import: a ``ModelFacts`` can be saved as JSON and priced anywhere.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class PeakPoint:
    """One traced forward+backward of a micro-batch; bytes exclude the parameters themselves."""

    micro_batch_size: int
    """Samples in the traced micro-batch."""
    peak_with_grads_bytes: int
    """Most bytes live at once when every gradient stays allocated as it is produced (plain PyTorch)."""
    peak_without_grads_bytes: int
    """The same with the gradients not counted (they are moved out as produced, as ZeRO-2/3 do)."""
    activation_bytes: int
    """Bytes live when the loss is computed: everything the backward pass will read."""
    grad_bytes: int
    """Bytes of all parameter gradients (the working precision)."""
    flops: int
    """FLOPs of forward + backward (+ recompute when checkpointed)."""
    fp8_flops: int = 0
    """The part of ``flops`` inside the Linear layers fp8 training converts (:mod:`autofit.ds.fp8`)."""
    memory_bound_bytes: int = 0
    """Bytes read and written by the step's kernels that do no matmul (elementwise, norms, softmax, copies,
    reductions), each op its own kernel: what bounds their time is memory bandwidth, not FLOP/s
    (:mod:`autofit.trace.traffic`)."""
    fused_memory_bound_bytes: int = 0
    """The same kernels' bytes as ``torch.compile`` fuses their chains between matmuls (a lower bound:
    :mod:`autofit.trace.traffic`)."""
    dispatched_ops: int = 0
    """Ops the step dispatches (forward, backward and recompute; views too): each costs the host its dispatch and,
    on a GPU, most a kernel launch (:mod:`autofit.cost_model.dispatch`). The same at every micro-batch."""
    kernels: int = 0
    """The part of ``dispatched_ops`` that runs a kernel (matmuls and every op that reads or writes memory; not views
    or allocations: :class:`autofit.trace.traffic.Traffic`)."""
    head_peak_with_grads_bytes: int = 0
    """``peak_with_grads_bytes`` in the head's segments alone: after the last layer's forward and before its backward
    (:func:`autofit.trace.scaling.is_head`), where the final norm, the logits and the loss run; 0 where not measured.
    With :attr:`body_peak_with_grads_bytes`, what a technique that shrinks only one of them changes
    (:mod:`autofit.cost_model.long_context`): the peak is the larger of the two."""
    head_peak_without_grads_bytes: int = 0
    """The same for ``peak_without_grads_bytes``."""
    body_peak_with_grads_bytes: int = 0
    """``peak_with_grads_bytes`` in every other segment: the layers' forwards and backwards; 0 where not measured."""
    body_peak_without_grads_bytes: int = 0
    """The same for ``peak_without_grads_bytes``."""


def footprint_key(dtype: str, checkpointed: bool) -> str:
    """The key of :attr:`ModelFacts.kernel_footprint_bytes`: the traced dtype (``fp32``, ``bf16``), with
    ``+checkpointed`` where the model ran with its layers checkpointed (:mod:`autofit.probe.footprint`: the
    unwinder's pages that non-reentrant checkpointing's early stop maps)."""
    return f"{dtype}+checkpointed" if checkpointed else dtype


#: the key part of a checkpointed trace, by checkpoint granularity
_CKPT = {"block": "ckpt", "attention": "attnckpt"}


@dataclass(frozen=True)
class ActivationProfile:
    """Traced points of one (dtype, attention, checkpointed) at several micro-batch sizes."""

    dtype: str
    """``fp32`` or ``bf16`` (fp16/fp8 runs use the bf16 trace: same element sizes)."""
    attention: str
    """Attention kernel traced."""
    checkpointed: bool
    """True when every repeated layer ran under checkpointing."""
    points: tuple[PeakPoint, ...]
    """At increasing micro-batch sizes."""
    granularity: str = "block"
    """What a checkpointed layer recomputed: the whole ``block`` or only its ``attention``."""

    @staticmethod
    def key(dtype: str, attention: str, checkpointed: bool, granularity: str = "block") -> str:
        """``fp32/sdpa/full``, ``fp32/sdpa/ckpt`` (every block), ``fp32/sdpa/attnckpt`` (every layer's attention)."""
        return f"{dtype}/{attention}/{_CKPT[granularity] if checkpointed else 'full'}"

    @staticmethod
    def partial_key(dtype: str, attention: str, n_checkpointed: int, granularity: str = "block") -> str:
        """Key of a trace with only the first ``n_checkpointed`` layers checkpointed."""
        return f"{dtype}/{attention}/{_CKPT[granularity]}{n_checkpointed}"

    @staticmethod
    def key_with_attention(key: str, attention: str) -> str:
        """``key`` (:meth:`key` or :meth:`partial_key`) of the same layout traced with ``attention``."""
        dtype, _, layout = key.split("/", 2)
        return f"{dtype}/{attention}/{layout}"

    def at(self, micro_batch_size: int, attr: str) -> float:
        """``attr`` of the points at ``micro_batch_size``: piecewise-linear between traced sizes,
        extended along the last segment beyond them (activations grow linearly in the batch)."""
        xs = [p.micro_batch_size for p in self.points]
        ys = [float(getattr(p, attr)) for p in self.points]
        if len(xs) == 1:
            return ys[0] * micro_batch_size / xs[0]
        for i in range(1, len(xs)):
            if micro_batch_size <= xs[i] or i == len(xs) - 1:
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                return y0 + (y1 - y0) * (micro_batch_size - x0) / (x1 - x0)
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class ModelFacts:
    """Everything about the model that the memory and time formulas use."""

    name: str
    """Workload name."""
    n_params: int
    """All parameters (Psi in the ZeRO paper)."""
    n_trainable_params: int
    """Parameters with ``requires_grad``: what gradients and optimizer states cover."""
    n_layers: int
    """Repeated layers that checkpointing may wrap (L)."""
    layer_params: tuple[int, ...]
    """Parameters of each repeated layer."""
    largest_module_params: int
    """Most parameters owned directly by one module (what ZeRO-3 gathers at once, at least)."""
    largest_param_numel: int
    """Elements of the largest trainable tensor (bounds per-tensor optimizer temporaries)."""
    n_small_params: int
    """Elements in tensors under 4096 elements (bitsandbytes keeps 32-bit states for them)."""
    factored_state_numel: int
    """Adafactor's state elements: rows + columns for each matrix, full size otherwise."""
    n_param_tensors: int
    """Number of trainable tensors."""
    n_persistent_params: int
    """Elements in tensors under ZeRO-3's persistence threshold (kept whole on every rank)."""
    buffer_bytes: int
    """Module buffers (running stats, rotary tables), in fp32."""
    tokens_per_sample: int | None
    """Tokens in one sample, or None."""
    adam_mini_state_numel: int = 0
    """Adam-mini's state elements (its own step counted on fake tensors: a full first moment, one second-moment
    value per head, neuron or block); 0 where Adam-mini was not among the traced optimizers."""
    adam_mini_error: str = ""
    """Why Adam-mini cannot step on this model (its own step raised on fake tensors: adam-mini 1.1.1 cannot
    view a 4-D convolution or a ``(1, 1, d)`` token named like an embedding per row); empty where it can."""
    fp8_largest_linear: tuple[int, int] = (0, 0)
    """``(in_features, out_features)`` of the largest Linear fp8 training converts; (0, 0): none."""
    fp8_weight_elements: int = 0
    """``sum(in x out)`` over the Linear layers fp8 training converts: the weights its casts read."""
    fp8_feature_elements: int = 0
    """``sum(in + out)`` over the same layers: elements its casts read per row of input (input and output grad)."""
    n_param_modules: int = 0
    """Modules that hold trainable parameters of their own (ZeRO-3 gathers and releases each one's in its hooks:
    :mod:`autofit.cost_model.dispatch`); 0 where not traced."""
    hidden_size: int = 0
    """The model's hidden size (:func:`autofit.trace.structure.hidden_size_of`), which the ZeRO bucket sizes are
    derived from (:mod:`autofit.ds.buckets`); 0: unknown (DeepSpeed's buckets as autofit pinned them)."""
    seq_len: int = 0
    """Tokens per sample the profiles were traced at, for a causal LM with a sequence (``Workload.sequence``);
    0: none (the long-context keys are off, :mod:`autofit.cost_model.long_context`)."""
    vocab_size: int = 0
    """The logits' width V (the text config's ``vocab_size``); 0: not a causal LM."""
    intermediate_size: int = 0
    """The MLP's intermediate width i (``intermediate_size``)."""
    kv_width: int = 0
    """Key/value width of an attention layer: kv heads x head dim."""
    n_kv_heads: int = 0
    """Key/value heads (``num_key_value_heads``)."""
    mlp_intermediates: int = 0
    """``i``-wide tensors one layer's MLP saves for backward a token: 4 for a gated MLP (gate, up, the activation and
    the product: ``down_proj(act(gate_proj(x)) * up_proj(x))``), 2 otherwise (fc1's output and the activation)."""
    mlp_matrices: int = 0
    """``h x i`` matrices of one MLP (3 gated, 2 otherwise): its forward is ``2 t h i`` FLOPs each."""
    profiles: dict[str, ActivationProfile] = field(default_factory=dict)
    """Traced activation profiles by :meth:`ActivationProfile.key`."""
    tensor_parallel: int = 1
    """The AutoTP degree these facts are of: above 1, one rank's model, its Linear layers split as the model's
    ``tp_plan`` says (:mod:`autofit.trace.tensor_parallel`); 1: the whole model."""
    tp_column_linears: int = 0
    """Of a rank's facts: the column-split Linears (each all-reduces its input's gradient in backward)."""
    tp_row_linears: int = 0
    """Of a rank's facts: the row-split Linears (each all-reduces its output in forward)."""
    tp_gathered_features: int = 0
    """Of a rank's facts: the output features gathered whole again after a column split (the head's vocabulary)."""
    tensor_parallel_ranks: dict[str, ModelFacts] = field(default_factory=dict)
    """Of the whole model's facts: one AutoTP rank's facts by its degree (``"2"``, ``"4"``), traced for the candidates
    that split the model (:func:`autofit.planning.plan.completed_facts`)."""
    attention_traces: dict[str, str] = field(default_factory=dict)
    """How a searched kernel was traced where not as itself: ``{"flash": "flash-attn" | "sdpa flash backend"}``."""
    untraced_kernels: dict[str, str] = field(default_factory=dict)
    """Kernels asked for that the model could not be built or run with in the trace, and the one line why: no profile
    of theirs, so their candidates are rejected with it (:func:`autofit.trace.tracer.runnable_kernels`)."""
    kernel_footprint_bytes: dict[str, int] = field(default_factory=dict)
    """CPU only: what running the model leaves resident in a fresh process beyond its tensors (kernel code,
    oneDNN's primitives, allocator arenas), by traced dtype (``fp32``, ``bf16``) and whether its layers ran
    checkpointed (:func:`footprint_key`): measured, not traced (:mod:`autofit.probe.footprint`); empty where not
    measured."""
    trace_mode: str = "fake"
    """``fake`` (shapes only), ``fake-scaled`` (shapes only, the model cut to 2 and 3 of its alike
    layers and extrapolated: :mod:`autofit.trace.scaling`) or ``real`` (data-dependent models, traced
    on CPU tensors)."""
    trace_seconds: float = 0.0
    """How long tracing took."""

    def rank(self, tensor_parallel: int) -> ModelFacts:
        """The facts one rank prices from at AutoTP degree ``tensor_parallel``: these at 1, else the traced rank's
        (:attr:`tensor_parallel_ranks`); a ``KeyError`` where that degree was not traced."""
        if tensor_parallel == 1:
            return self
        if str(tensor_parallel) not in self.tensor_parallel_ranks:
            raise KeyError(f"no trace at tensor_parallel {tensor_parallel}; traced: {sorted(self.tensor_parallel_ranks)}")
        return self.tensor_parallel_ranks[str(tensor_parallel)]

    def profile(self, dtype: str, attention: str, checkpointed: bool, granularity: str = "block") -> ActivationProfile:
        key = ActivationProfile.key(dtype, attention, checkpointed, granularity)
        if key in self.profiles:
            return self.profiles[key]
        fallback = ActivationProfile.key(dtype, "sdpa", checkpointed, granularity)  # workloads without an attention choice
        if fallback in self.profiles:
            return self.profiles[fallback]
        raise KeyError(f"no trace for {key}; traced: {sorted(self.profiles)}")

    def kernels_priced_as_sdpa(self) -> frozenset[str]:
        """The kernels whose traced profiles are ``sdpa``'s own here and in every traced AutoTP rank: each layout of
        theirs traced, with the same points (``flash`` traced as SDPA's flash backend where its steps would be SDPA's:
        :func:`autofit.trace.tracer._sdpa_as_flash`), or none traced (:meth:`profile` falls back to ``sdpa``'s). The
        cost model reads a config's kernel only through its profiles, so such a kernel's config is priced as its
        ``sdpa`` twin (:meth:`autofit.planning.plan.Plan.price` prices the two once)."""
        kernels = {profile.attention for profile in self.profiles.values()} - {"sdpa"}
        if not any(profile.attention == "sdpa" for profile in self.profiles.values()):
            return frozenset()
        return frozenset(k for k in kernels if all(facts._traced_as_sdpa(k) for facts in
                                                   (self, *self.tensor_parallel_ranks.values())))

    def _traced_as_sdpa(self, kernel: str) -> bool:
        """Whether ``kernel``'s profiles are ``sdpa``'s, layout for layout, or absent (:meth:`kernels_priced_as_sdpa`)."""
        def layouts(attention: str) -> dict[str, ActivationProfile]:
            return {ActivationProfile.key_with_attention(key, "sdpa"): replace(profile, attention="sdpa")
                    for key, profile in self.profiles.items() if profile.attention == attention}

        own = layouts(kernel)
        return not own or own == layouts("sdpa")

    def at_checkpointed(self, dtype: str, attention: str, n_checkpointed: int, micro_batch_size: int, attr: str,
                        granularity: str = "block") -> float:
        """``attr`` at ``micro_batch_size`` with the first ``n_checkpointed`` layers checkpointed (whole, or only
        their attention for ``granularity="attention"``: its own traces, the unchecked one shared).

        Piecewise-linear in the number of checkpointed layers through every trace there is: none, all,
        and the partial ones. Layers are not alike in general (a CNN's early stages hold most of its
        activations, an encoder-decoder's halves differ), so the trace at a middle ratio is what
        bends the line; with none, a straight line between none and all.

        Memoized on this instance (a plan asks the same few dozen questions for each of its thousands of candidates):
        the facts are frozen, and :func:`dataclasses.replace` makes a new instance with an empty memo.
        """
        key = (dtype, attention, n_checkpointed, micro_batch_size, attr, granularity)
        memo: dict[tuple[Any, ...], float] | None = self.__dict__.get("_at_memo")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_at_memo", memo)  # not a field: not compared, copied by replace or written
        if key not in memo:
            memo[key] = self._at_checkpointed(dtype, attention, n_checkpointed, micro_batch_size, attr, granularity)
        return memo[key]

    def _at_checkpointed(self, dtype: str, attention: str, n_checkpointed: int, micro_batch_size: int, attr: str,
                         granularity: str) -> float:
        """:meth:`at_checkpointed`, computed."""
        full = self.profile(dtype, attention, False)
        if n_checkpointed <= 0 or self.n_layers == 0:
            return full.at(micro_batch_size, attr)
        known = {0: full, self.n_layers: self.profile(dtype, attention, True, granularity)}
        prefix = ActivationProfile.partial_key(dtype, full.attention, 0, granularity)[:-1]
        for key, profile in self.profiles.items():  # a handful of traces, not one lookup per layer
            if key.startswith(prefix) and key[len(prefix):].isdigit():
                known[int(key[len(prefix):])] = profile
        n = min(n_checkpointed, self.n_layers)
        if n in known:
            return known[n].at(micro_batch_size, attr)
        lo, hi = max(k for k in known if k < n), min(k for k in known if k > n)
        y_lo, y_hi = known[lo].at(micro_batch_size, attr), known[hi].at(micro_batch_size, attr)
        return y_lo + (y_hi - y_lo) * (n - lo) / (hi - lo)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelFacts:
        """The facts ``to_dict`` wrote, validated (:func:`check_facts`: an :class:`InvalidFacts` naming the field
        where a value is of the wrong type or out of range: read back from a cache, it is never believed)."""
        check_facts(data)
        profiles = {
            key: ActivationProfile(
                dtype=p["dtype"],
                attention=p["attention"],
                checkpointed=p["checkpointed"],
                points=tuple(PeakPoint(**point) for point in p["points"]),
                granularity=p.get("granularity", "block"),
            )
            for key, p in data.get("profiles", {}).items()
        }
        values = {k: v for k, v in data.items() if k not in ("profiles", "tensor_parallel_ranks")}
        values["tensor_parallel_ranks"] = {degree: cls.from_dict(rank)
                                           for degree, rank in data.get("tensor_parallel_ranks", {}).items()}
        values["layer_params"] = tuple(values.get("layer_params", ()))
        values["fp8_largest_linear"] = tuple(values.get("fp8_largest_linear", (0, 0)))
        return cls(**values, profiles=profiles)


class InvalidFacts(ValueError):
    """A value in stored facts that no trace writes: the wrong type, negative, NaN or infinite, unsorted."""


def _count(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidFacts(f"{where}={value!r} is not an integer >= 0")


def _typed(where: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind):
        raise InvalidFacts(f"{where}={value!r} is not a {getattr(kind, '__name__', kind)}")


def check_facts(data: Any) -> None:
    """An :class:`InvalidFacts` where ``data`` (``ModelFacts.to_dict``'s layout) holds a value no trace writes."""
    _typed("facts", data, dict)
    known = {f.name: str(f.type) for f in fields(ModelFacts)}
    for key, value in data.items():
        kind = known.get(key)
        if kind is None:
            raise InvalidFacts(f"unknown field {key!r}")
        if kind == "int":
            _count(key, value)
        elif kind == "float":
            _typed(key, value, (int, float))
            if isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise InvalidFacts(f"{key}={value!r} is not a finite number >= 0")
        elif kind == "str" and not (key == "name" and value is None):
            _typed(key, value, str)
        elif kind == "int | None" and value is not None:
            _count(key, value)
        elif kind.startswith("tuple[int"):
            _typed(key, value, (list, tuple))
            for i, item in enumerate(value):
                _count(f"{key}[{i}]", item)
        elif kind in ("dict[str, str]", "dict[str, int]"):
            _typed(key, value, dict)
            for name, item in value.items():
                if kind.endswith("str]"):
                    _typed(f"{key}[{name!r}]", item, str)
                else:
                    _count(f"{key}[{name!r}]", item)
    _typed("tensor_parallel_ranks", data.get("tensor_parallel_ranks", {}), dict)
    for degree, rank in data.get("tensor_parallel_ranks", {}).items():
        if not (isinstance(degree, str) and degree.isdigit() and int(degree) > 1):
            raise InvalidFacts(f"tensor_parallel_ranks has the degree {degree!r}, not an integer > 1")
        check_facts(rank)
    _typed("profiles", data.get("profiles", {}), dict)
    for key, profile in data.get("profiles", {}).items():
        _check_profile(f"profiles[{key!r}]", profile)


def _check_profile(where: str, profile: Any) -> None:
    _typed(where, profile, dict)
    for name in ("dtype", "attention"):
        _typed(f"{where}.{name}", profile.get(name), str)
    _typed(f"{where}.checkpointed", profile.get("checkpointed"), bool)
    points = profile.get("points")
    _typed(f"{where}.points", points, (list, tuple))
    if not points:
        raise InvalidFacts(f"{where}.points is empty")
    point_fields = {f.name for f in fields(PeakPoint)}
    sizes = []
    for i, point in enumerate(points):
        _typed(f"{where}.points[{i}]", point, dict)
        for name, value in point.items():
            if name not in point_fields:
                raise InvalidFacts(f"{where}.points[{i}] has an unknown field {name!r}")
            _count(f"{where}.points[{i}].{name}", value)
        sizes.append(point.get("micro_batch_size", 0))
    if sizes[0] < 1 or sorted(set(sizes)) != sizes:
        raise InvalidFacts(f"{where}: micro-batch sizes {sizes} are not increasing from 1 or more")
