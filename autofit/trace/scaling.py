"""The facts of an L-layer model from traces of the same model cut to its first k and k + 1 repeated layers.

Pure (no torch): :mod:`autofit.trace.layers` cuts the model and records the traces, this module
extrapolates them.

Why: a forward+backward on fake tensors costs time in proportion to the layers it runs (LLaMA-2-70B,
80 layers at sequence 4096: 77 s per trace on a 2-core CPU, and a space needs a dozen traces). When the
repeated layers are alike (one class, the same parameter shapes and settings), a point of the cut
model's step holds the same bytes as the matching point of the whole model's step, except for what
the other layers hold at that moment: the activations saved by the layers before it and, in backward,
what the layers after it leave (their gradients). So:

- additive quantities (FLOPs, bytes live at the loss, gradient bytes) are affine in the layers:
  ``v(L) = v(k) + (v(k+1) - v(k)) (L - k)``;
- the live-bytes peak of each *segment* of the step -- before the layers (``fpre``), layer i's forward
  (``f``), after it (``fa``: up to the next layer, or the head), backward before the last layer's
  (``bhead``), layer i's backward (``b``), after it (``ba``) -- is ``V(i) = A(i) + B(L - 1 - i)``:
  ``A`` what layer i and the ones before it hold, ``B`` what the ones after it hold (``B(0) = 0``).
  The two cuts give 2k + 1 equations for A(0..k) and B(1..k); beyond, each goes on by its last step.
  ``B`` is not a straight line from the start: a checkpointed stack's first few backward layers leave
  more behind than later ones (measured: 3-4 layers), so block-checkpointed layers are cut deeper
  (:data:`CUT_LAYERS`) for ``B``'s last step to be the steady one.

The step's peak is the largest segment peak over every layer index (a few hundred evaluations).
Layers of two kinds (the first n checkpointed, the rest not) compose from each kind's fit
(:func:`layout_peak`). This is the method of ``torch.distributed._tools.mem_tracker`` (live bytes per
module and phase) applied to the repeated layers, with the layer count as the variable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autofit.cost_model.facts import PeakPoint

#: layers of the two cut models traced, by what the layers run: ``full`` (no checkpointing), ``block`` or
#: ``attention`` checkpointing. A block-checkpointed stack's backward settles only after a few layers (what a
#: layer's recompute leaves behind is freed late), so its cuts must be deep enough for the last step to be
#: the steady one; attention-only checkpointing extrapolates exactly from 2 and 3 (a 12-layer GPT and a
#: 14-layer LLaMA, sdpa and eager)
CUT_LAYERS = {"full": (2, 3), "block": (4, 5), "attention": (2, 3)}

#: segments indexed by a layer, in step order
LAYER_PHASES = ("f", "fa", "b", "ba")
#: segments before the first layer's forward and before the last layer's backward
EDGE_PHASES = ("fpre", "bhead")
ADDITIVE = ("activation_bytes", "grad_bytes", "flops", "fp8_flops", "memory_bound_bytes",
            "fused_memory_bound_bytes", "dispatched_ops", "kernels")

Segment = tuple[str, int]
"""``(phase, layer index)``; index 0 for the edge phases."""


def cut_groups(kind: str, period: int) -> tuple[int, int]:
    """The two cuts traced for layers run as ``kind`` (a key of :data:`CUT_LAYERS`), in groups of ``period`` layers
    (:func:`grouped_segments`): as deep as :data:`CUT_LAYERS` in layers, and at least two groups; a block-checkpointed
    stack settles after a few layers, not a few groups (a 12-layer Gemma-2, period 2: within 2 % cut to 4 and 6)."""
    small = max(2, -(-CUT_LAYERS[kind][0] // period))
    return small, small + 1


class CannotScale(ValueError):
    """The cut traces do not have the shape extrapolation needs (segments missing in one of them)."""


@dataclass(frozen=True)
class CutTrace:
    """One traced step of the model cut to ``n_layers`` layers."""

    n_layers: int
    """Repeated layers the cut model kept."""
    point: PeakPoint
    """The step's totals."""
    segments: Mapping[Segment, tuple[int, int]]
    """Peak live bytes (with gradients, without) in each segment of the step."""


@dataclass(frozen=True)
class PhaseFit:
    """One segment phase of one live-bytes measure: ``V(i) = A(i) + B(L - 1 - i)`` for layer i of L.

    ``A`` is what layer i and the layers before it hold, ``B`` what the layers after it hold (``B(0) = 0``);
    each known at the first indices from the cut traces and extended by a slope beyond them.
    """

    own: tuple[int, ...]
    """A(0) ... A(k) (A(0) alone for a phase only the first or the last layer has)."""
    earlier: int
    """A's slope beyond: what each further earlier layer holds (its saved activations)."""
    after: tuple[int, ...]
    """B(0) = 0, B(1) ... B(k): the later layers' share near the end of the stack, where backward starts."""
    later: int
    """B's slope beyond: what each further later layer holds once its backward is done."""
    where: str
    """``all`` indices, or only the ``first`` or the ``last`` layer has this segment."""

    def has(self, i: int, n_layers: int) -> bool:
        return self.where == "all" or (i == 0 if self.where == "first" else i == n_layers - 1)

    def own_at(self, i: int) -> int:
        return _extended(self.own, i, self.earlier)

    def after_at(self, j: int) -> int:
        return _extended(self.after, j, self.later)


def _extended(known: tuple[int, ...], i: int, slope: int) -> int:
    last = len(known) - 1
    return known[i] if i <= last else known[last] + (i - last) * slope


@dataclass(frozen=True)
class SegmentFit:
    """One live-bytes measure (with or without gradients) fitted over the layers of one kind."""

    phases: Mapping[str, PhaseFit]
    """By :data:`LAYER_PHASES`."""
    edges: Mapping[str, tuple[int, int]]
    """By :data:`EDGE_PHASES`: ``(c, s)`` of ``c + s L``."""


@dataclass(frozen=True)
class KindFit:
    """Everything fitted for layers of one kind (checkpointed or not) at one micro-batch."""

    micro_batch_size: int
    """Samples in the traced micro-batch."""
    with_grads: SegmentFit
    """Live bytes with every gradient kept (plain PyTorch)."""
    without_grads: SegmentFit
    """Live bytes with the gradients moved out as produced (ZeRO-2/3)."""
    base: Mapping[str, int]
    """Additive quantities without any layer."""
    per_layer: Mapping[str, int]
    """Additive quantities each layer adds."""


def position(i: int, n_layers: int) -> str:
    """Where layer ``i`` of ``n_layers`` sits: ``first``, ``last`` or ``middle``."""
    return "first" if i == 0 else "last" if i == n_layers - 1 else "middle"


def fit_kind(small: CutTrace, large: CutTrace) -> KindFit:
    """The fit of one layer kind from its traces cut to k and k + 1 layers (:data:`CUT_LAYERS`)."""
    k = small.n_layers
    if large.n_layers != k + 1 or k < 2 or small.point.micro_batch_size != large.point.micro_batch_size:
        raise CannotScale(f"need traces of k >= 2 and k + 1 layers at one micro-batch, got {k}, {large.n_layers}")
    per_layer = {a: getattr(large.point, a) - getattr(small.point, a) for a in ADDITIVE}
    return KindFit(
        micro_batch_size=small.point.micro_batch_size,
        with_grads=_fit_segments(small, large, 0),
        without_grads=_fit_segments(small, large, 1),
        base={a: getattr(small.point, a) - k * per_layer[a] for a in ADDITIVE},
        per_layer=per_layer,
    )


def _fit_segments(small: CutTrace, large: CutTrace, measure: int) -> SegmentFit:
    k = small.n_layers
    edges = {}
    for phase in EDGE_PHASES:
        if (phase, 0) in small.segments and (phase, 0) in large.segments:
            v_small, v_large = small.segments[(phase, 0)][measure], large.segments[(phase, 0)][measure]
            edges[phase] = (v_small - k * (v_large - v_small), v_large - v_small)
    phases = {}
    for phase in LAYER_PHASES:
        by_layer_small = {i: peaks[measure] for (p, i), peaks in small.segments.items() if p == phase}
        by_layer_large = {i: peaks[measure] for (p, i), peaks in large.segments.items() if p == phase}
        fit = _fit_phase(by_layer_small, by_layer_large, k)
        if fit is not None:
            phases[phase] = fit
    return SegmentFit(phases=phases, edges=edges)


def _fit_phase(v_small: dict[int, int], v_large: dict[int, int], k: int) -> PhaseFit | None:
    """Solve ``V_k(i) = A(i) + B(k - 1 - i)`` and ``V_{k+1}(i) = A(i) + B(k - i)`` (2k + 1 equations, ``B(0) = 0``).

    Their differences are B's steps at j = 0 ... k - 1; the slopes beyond are the last steps of A and B.
    """
    if set(v_small) == set(range(k)) and set(v_large) == set(range(k + 1)):
        after = [0]
        for j in range(k):
            after.append(after[-1] + v_large[k - 1 - j] - v_small[k - 1 - j])
        own = [v_small[i] - after[k - 1 - i] for i in range(k)] + [v_large[k]]
        return PhaseFit(own=tuple(own), earlier=own[k] - own[k - 1], after=tuple(after),
                        later=after[k] - after[k - 1], where="all")
    if set(v_small) == set(v_large) == {0}:
        step = v_large[0] - v_small[0]
        return PhaseFit(own=(v_small[0] - (k - 1) * step,), earlier=0, after=(0,), later=step, where="first")
    if set(v_small) == {k - 1} and set(v_large) == {k}:
        step = v_large[k] - v_small[k - 1]
        return PhaseFit(own=(v_small[k - 1] - (k - 1) * step,), earlier=step, after=(0,), later=0, where="last")
    if not v_small and not v_large:
        return None
    raise CannotScale(f"segments {sorted(v_small)} and {sorted(v_large)} of the cut traces do not fit A(i) + B(L-1-i)")


def layout_peak(layout: Sequence[SegmentFit], part: str = "all") -> int:
    """The step's peak for layers fitted as ``layout`` (one fit per layer, in order; at least 2); of the head's
    segments alone (:func:`is_head`) where ``part`` is ``head``, of the others where it is ``body``.

    Layer i takes its own kind's ``A`` plus, for each earlier layer of another kind, the difference of
    what the two kinds hold; ``B`` comes from the last layer's kind (backward starts there), plus, for
    each later layer of another kind, the difference of the two kinds' steady ``B`` slopes.
    """
    n, last = len(layout), layout[-1]
    keep = {"all": lambda segment: True, "head": lambda segment: is_head(segment, n),
            "body": lambda segment: not is_head(segment, n)}[part]
    best = layout[0].edges["fpre"][0] if "fpre" in layout[0].edges and keep(("fpre", 0)) else 0
    if "bhead" in last.edges and keep(("bhead", 0)):
        best = max(best, last.edges["bhead"][0] + sum(f.edges["bhead"][1] for f in layout))
    for phase, tail in last.phases.items():
        kinds = [fit.phases.get(phase) for fit in layout]
        held = 0  # what the earlier layers hold, each as its own kind does
        extra_later = sum(k.later - tail.later for k in kinds[1:] if k is not None)
        for i, own in enumerate(kinds):
            if own is None:
                continue
            if i:
                extra_later -= own.later - tail.later
            if own.has(i, n) and keep((phase, i)):
                best = max(best, own.own_at(i) + held - i * own.earlier + tail.after_at(n - 1 - i) + extra_later)
            held += own.earlier
    return best


def is_head(segment: Segment, n_layers: int) -> bool:
    """Whether ``segment`` is the head's: after the last layer's forward (``fa``), before its backward (``bhead``),
    where the final norm, the logits and the loss run."""
    return segment == ("bhead", 0) or segment == ("fa", n_layers - 1)


def grouped_segments(segments: Mapping[Segment, tuple[int, int]], period: int,
                     prefix: int = 0) -> dict[Segment, tuple[int, int]]:
    """A cut trace's segment peaks with each ``period`` consecutive layers taken as one (a stack whose pattern repeats
    every ``period`` layers after its first ``prefix``, :func:`autofit.trace.layers.layer_pattern`), the ``prefix``
    layers joining the first group: a group's segment of a phase peaks at the most any of its layers' did, so the fit
    runs over groups as over alike layers. The fit takes the first groups' own values as traced (``A(0..k)``), so a
    first group unlike the others (the prefix in it) is fitted as it is; only the slopes beyond come from the alike
    ones."""
    grouped: dict[Segment, tuple[int, int]] = {}
    for (phase, index), (with_grads, without) in segments.items():
        key = (phase, max(0, index - prefix) // period) if phase in LAYER_PHASES else (phase, index)
        before = grouped.get(key, (0, 0))
        grouped[key] = (max(before[0], with_grads), max(before[1], without))
    return grouped


def part_peaks(segment_peaks: Mapping[Segment, tuple[int, int]], n_layers: int) -> dict[str, int]:
    """:class:`PeakPoint`'s ``head_peak_*`` and ``body_peak_*`` from a step's ``(with grads, without)`` segment
    peaks: the largest in the head's segments (:func:`is_head`) and in the others; zeros where none was recorded."""
    parts: dict[str, int] = {}
    for part in ("head", "body"):
        peaks = [p for segment, p in segment_peaks.items() if is_head(segment, n_layers) == (part == "head")]
        parts[f"{part}_peak_with_grads_bytes"] = max((p[0] for p in peaks), default=0)
        parts[f"{part}_peak_without_grads_bytes"] = max((p[1] for p in peaks), default=0)
    return parts


def scaled_point(full: KindFit, checkpointed: KindFit | None, n_checkpointed: int, n_layers: int,
                 leading: bool = False) -> PeakPoint:
    """The traced point of ``n_layers`` layers whose first ``n_checkpointed`` run under checkpointing. ``leading``:
    the first layer group holds leading layers of their own (:func:`grouped_segments`' ``prefix``), which every cut
    kept, so each kind's ``base`` has them as that kind runs them: their additive part is the first group's kind's,
    the rest of ``base`` (the embedding, the head) the last's, as without them."""
    if n_layers < 2 or not 0 <= n_checkpointed <= n_layers:
        raise ValueError(f"need n_layers >= 2 and 0 <= n_checkpointed <= n_layers, but got {n_layers=}, {n_checkpointed=}")
    if n_checkpointed and checkpointed is None:
        raise ValueError(f"{n_checkpointed=} needs the checkpointed layers' fit")
    kinds = [checkpointed if i < n_checkpointed else full for i in range(n_layers)]
    layout: list[KindFit] = [k for k in kinds if k is not None]
    additive = {
        a: layout[-1].base[a] + sum(k.per_layer[a] for k in layout)
        + (layout[0].base[a] - layout[-1].base[a] if leading else 0) for a in ADDITIVE
    }
    return PeakPoint(
        micro_batch_size=full.micro_batch_size,
        peak_with_grads_bytes=layout_peak([k.with_grads for k in layout]),
        peak_without_grads_bytes=layout_peak([k.without_grads for k in layout]),
        **{f"{part}_peak_{grads}_bytes": layout_peak([getattr(k, grads) for k in layout], part)
           for part in ("head", "body") for grads in ("with_grads", "without_grads")},
        **additive,
    )
