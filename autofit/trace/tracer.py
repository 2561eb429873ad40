"""Trace a workload's step on fake (or, for data-dependent models, real) tensors: live bytes, FLOPs, per-layer
segments, at each traced micro-batch, precision, attention kernel and checkpoint layout (the story: :mod:`autofit.trace`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from autofit.core.config import Config, trace_dtype_of
from autofit.core.errors import AutofitError, guards_user_code
from autofit.cost_model.facts import ActivationProfile, ModelFacts, PeakPoint
from autofit.ds.optim import adam_mini_state_numel
from autofit.trace import step
from autofit.trace.attention import SDPA_FLASH, flash_attn_installed, flash_trace_plan, kernel_context
from autofit.trace.cache import cached_trace
from autofit.trace.layers import cut_workload
from autofit.trace.parallel import trace_in_parallel, trace_workers_setting
from autofit.trace.scaling import CUT_LAYERS, CannotScale, CutTrace, cut_groups, fit_kind, grouped_segments, scaled_point
from autofit.trace.sdpa import DISPATCHES
from autofit.trace.structure import ModelStructure, model_structure
from autofit.trace.tensor_parallel import split_linears, tensor_parallel_workload
from autofit.trace.tensors import first_line
from autofit.workload.types import Workload

#: the micro-batches every profile is traced at; a space with larger ones adds its largest
#: (:func:`trace_micro_batches`)
TRACE_MICRO_BATCHES = (1, 4)
#: largest model (fp32 parameter bytes) traced on real tensors when fake tensors cannot run it
REAL_TRACE_LIMIT_BYTES = 2 * 2**30
#: alike repeated layers from which a model is traced cut to a few of them (:mod:`autofit.trace.scaling`)
SCALE_MIN_LAYERS = 12
#: tokens of the timed step that tells whether a model whose trace loops over its tokens can be traced in time
#: (:func:`check_scan_time`)
PROBE_LENGTH = 32


@guards_user_code("tracing the workload")
def trace_workload(
    workload: Workload,
    *,
    precisions: tuple[str, ...] = ("fp32",),
    attentions: tuple[str, ...] = ("sdpa",),
    checkpoint_ratios: tuple[float, ...] = (),
    optimizers: tuple[str, ...] = (),
    checkpoint_granularities: tuple[str, ...] = ("block",),
    micro_batches: tuple[int, ...] = TRACE_MICRO_BATCHES,
    sdpa_dispatch: str = "cpu",
    before_tracing: Callable[[int], None] | None = None,
    tensor_parallel: int = 1,
) -> ModelFacts:
    """Trace ``workload`` for each precision class and attention kernel, with and without checkpointing,
    at each of ``micro_batches`` (:func:`trace_micro_batches`; other sizes are interpolated between them).

    ``optimizers``: those the candidates use; for ``adam_mini`` its state size is counted by its own step
    on fake tensors (:func:`autofit.ds.optim.adam_mini_state_numel`). ``checkpoint_granularities``: each is
    traced checkpointed (``block``: whole layers; ``attention``: only their attention sub-modules).

    Of ``checkpoint_ratios`` (the space's), the one nearest 0.5 that checkpoints some but not all
    layers is traced too: how much checkpointing part of the stack saves depends on which layers
    hold the activations, which a straight line between none and all cannot know. A model of at
    least :data:`SCALE_MIN_LAYERS` alike repeated layers is traced cut to a few of them and extrapolated
    (:mod:`autofit.trace.scaling`; the partial ratio composed); if that cannot fit, it is traced whole.

    ``sdpa_dispatch``: the target's (``cuda``, ``cpu``): SDPA is traced as that device dispatches it
    (:mod:`autofit.trace.sdpa`: attention dropout where CUDA's fused kernels take it).

    ``before_tracing``: called with the model's parameter count (each shared tensor once) where the trace is not
    cached, before its fake-tensor steps (after the one timed step of :func:`check_scan_time`): what the caller
    starts beside them (a CPU plan's kernel footprint, :class:`autofit.probe.footprint.PendingFootprints`).

    ``tensor_parallel``: above 1, the facts are of one rank of DeepSpeed's AutoTP at that degree, its model split as
    the model's ``tp_plan`` says (:mod:`autofit.trace.tensor_parallel`), with what was split counted.
    """
    import torch

    trace_workers_setting()  # a bad setting is an error whether or not this trace forks (or is cached)
    started = time.perf_counter()
    with torch.device("meta"):
        model = workload.build_model()
    request: dict[str, Any] = {"precisions": precisions, "attentions": attentions, "checkpoint_ratios": checkpoint_ratios,
               "optimizers": optimizers, "checkpoint_granularities": checkpoint_granularities,
               "micro_batches": micro_batches, "sdpa_dispatch": sdpa_dispatch}
    split = None
    if tensor_parallel > 1:  # one rank's model (its key differs by the request and by the split model's shapes)
        split = split_linears(model, tensor_parallel)
        workload, request = tensor_parallel_workload(workload, tensor_parallel), {**request, "tensor_parallel": tensor_parallel}
    if sdpa_dispatch not in DISPATCHES:
        raise AutofitError(f"sdpa_dispatch must be one of {', '.join(DISPATCHES)}, but got {sdpa_dispatch!r}")

    facts = cached_trace(workload, model, request, lambda: _traced_at_length(
        workload, _structure(workload, optimizers, model), precisions, attentions, checkpoint_ratios,
        checkpoint_granularities, micro_batches, sdpa_dispatch, before_tracing))
    if split is not None:
        facts = replace(facts, tensor_parallel=split.degree, tp_column_linears=split.column, tp_row_linears=split.row,
                        tp_gathered_features=split.gathered_features)
    return replace(facts, trace_seconds=time.perf_counter() - started)


def _traced_at_length(workload: Workload, structure: ModelStructure, precisions: tuple[str, ...],
                      attentions: tuple[str, ...], checkpoint_ratios: tuple[float, ...],
                      checkpoint_granularities: tuple[str, ...], micro_batches: tuple[int, ...],
                      sdpa_dispatch: str = "cpu", before_tracing: Callable[[int], None] | None = None) -> ModelFacts:
    """:func:`_trace_workload`, once a workload whose trace loops over its tokens (:attr:`Workload.at_length`) is
    judged able to be traced in time (:func:`check_scan_time`, with the layers each step will run, timed: so
    ``before_tracing`` is called after it, with the model's parameter count)."""
    n_layers, period = structure.n_layers, scale_period(structure)
    kinds = ("full", *(checkpoint_granularities if n_layers else ()))
    per_kind = [sum(cut_depth(structure, k) for k in cut_groups(kind, period)) if period else n_layers or 1
                for kind in kinds]
    steps = len({trace_dtype_of(p) for p in precisions}) * len(micro_batches)
    check_scan_time(workload, structure, steps * sum(per_kind))
    if before_tracing is not None:
        before_tracing(structure.n_params)
    return _trace_workload(workload, structure, precisions, attentions, checkpoint_ratios, checkpoint_granularities,
                           micro_batches, sdpa_dispatch)


def check_scan_time(workload: Workload, structure: ModelStructure, layer_steps: int) -> None:
    """For a workload whose trace loops over its tokens (:attr:`Workload.at_length`): one step of one sample through
    :data:`CUT_LAYERS` ``full``'s first count of layers at :data:`PROBE_LENGTH` tokens, timed, and carried to the whole
    trace in proportion (``layer_steps``: the layers its steps run, summed; a loop of the same operations a token and a
    layer). Past the trace step's limit (:func:`autofit.trace.step.trace_step_limit_s`), which such a model's whole
    trace is held to, one error line now, not after the limit has run out step after step."""
    seq_len = workload.tokens_per_sample
    if workload.at_length is None or not seq_len or seq_len <= PROBE_LENGTH:
        return
    short = workload.at_length(PROBE_LENGTH)
    period = scale_period(structure)
    layers = min(cut_depth(structure, CUT_LAYERS["full"][0]) if period else CUT_LAYERS["full"][0],
                 structure.n_layers) or 1
    cut = period > 0
    started = time.perf_counter()
    step.trace_step(cut_workload(short, layers) if cut else short, 1, "fp32", "sdpa", (0.0, "block"), "fake")
    measured = time.perf_counter() - started
    projected = measured / (layers if cut else structure.n_layers or 1) * layer_steps * seq_len / PROBE_LENGTH
    if projected > step.trace_step_limit_s():
        raise AutofitError(
            f"tracing {workload.name} at {seq_len:,} tokens would take about {projected / 60:.0f} min (a step through "
            f"{layers if cut else structure.n_layers} layers at {PROBE_LENGTH} tokens took {measured:.1f} s; its "
            f"reference code loops over the tokens), past the {step.trace_step_limit_s():g} s such a trace may take "
            f"({step.TRACE_STEP_ENV}): install its fused kernels, plan a shorter --seq-len, or raise the limit")


def _trace_workload(workload: Workload, structure: ModelStructure, precisions: tuple[str, ...],
                    attentions: tuple[str, ...], checkpoint_ratios: tuple[float, ...],
                    checkpoint_granularities: tuple[str, ...], micro_batches: tuple[int, ...],
                    sdpa_dispatch: str = "cpu") -> ModelFacts:
    """:func:`trace_workload` without the cache."""
    started = time.perf_counter()
    step.trace_started()
    dtype_names = tuple(sorted({trace_dtype_of(p) for p in precisions}))
    attention_names, untraced = (runnable_kernels(workload, structure, attentions, sdpa_dispatch)
                                 if workload.searches_attention else (("sdpa",), {}))
    flash_is_sdpa = _flash_is_sdpa(workload, structure, dtype_names, attention_names, sdpa_dispatch)
    traced_names = tuple(a for a in attention_names if not (flash_is_sdpa and a == "flash"))
    n_layers = structure.n_layers
    n_middle = middle_checkpointed_layers(checkpoint_ratios, n_layers)
    granularities = tuple(checkpoint_granularities) if n_layers else ()
    scaled = None
    if scale_period(structure):
        with contextlib.suppress(CannotScale, step.NeedsRealTensors):
            scaled = _scaled_profiles(workload, structure, (dtype_names, traced_names), granularities, n_middle,
                                      micro_batches, sdpa_dispatch)
    if scaled is None:
        tracer = _Tracer(workload, structure, sdpa_dispatch=sdpa_dispatch)
        profiles: dict[str, ActivationProfile] = {}
        for dtype_name in dtype_names:
            for attention in traced_names:
                profiles[ActivationProfile.key(dtype_name, attention, False)] = ActivationProfile(
                    dtype=dtype_name, attention=attention, checkpointed=False,
                    points=tracer.points(dtype_name, attention, 0.0, micro_batches))
                for granularity in granularities:
                    profiles |= _checkpointed_profiles(tracer, dtype_name, attention, granularity, n_layers, n_middle,
                                                       micro_batches)
        mode, traces = tracer.mode, tracer.attention_traces
    else:
        (profiles, traces), mode = scaled, "fake-scaled"
    if flash_is_sdpa:
        profiles, traces = _sdpa_as_flash(profiles, dtype_names, attention_names), {**traces, "flash": SDPA_FLASH}
    if "sdpa" in attention_names and workload.searches_attention:
        labelled = cut_workload(workload, cut_depth(structure, CUT_LAYERS["full"][0])) if scaled is not None \
            else workload
        traces = {**traces, **{"sdpa": label for label in sorted(step.sdpa_labels(labelled))[:1]}}  # noqa: B035
    facts = _facts(workload, structure, profiles, n_layers, mode, time.perf_counter() - started)
    return replace(facts, attention_traces=dict(traces), untraced_kernels=untraced)


def _flash_is_sdpa(workload: Workload, structure: ModelStructure, dtype_names: tuple[str, ...],
                   attention_names: tuple[str, ...], sdpa_dispatch: str) -> bool:
    """Whether both ``sdpa`` and ``flash`` are traced and ``flash``'s steps would be ``sdpa``'s own in every dtype
    (:func:`autofit.trace.step.flash_traces_as_sdpa`, on the model cut as the trace cuts it): then ``flash`` is not
    traced again (a third of a 70 B plan's trace steps)."""
    if not workload.searches_attention or not {"sdpa", "flash"} <= set(attention_names):
        return False
    checked = cut_workload(workload, cut_depth(structure, CUT_LAYERS["full"][0])) if scale_period(structure) \
        else workload
    return all(step.flash_traces_as_sdpa(checked, dtype_name, sdpa_dispatch) for dtype_name in dtype_names)


def _sdpa_as_flash(profiles: dict[str, ActivationProfile], dtype_names: tuple[str, ...],
                   attention_names: tuple[str, ...]) -> dict[str, ActivationProfile]:
    """``profiles`` with each of ``sdpa``'s also under ``flash``, in the order the trace makes them (dtype, then
    kernel)."""
    copies = {ActivationProfile.key_with_attention(key, "flash"): replace(profile, attention="flash")
              for key, profile in profiles.items() if profile.attention == "sdpa"}
    every = profiles | copies
    return {key: profile for dtype_name in dtype_names for attention in attention_names
            for key, profile in every.items() if profile.dtype == dtype_name and profile.attention == attention}


def runnable_kernels(workload: Workload, structure: ModelStructure, attentions: tuple[str, ...],
                     sdpa_dispatch: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """``attentions`` the model runs with in the trace, and why each other one does not
    (:func:`autofit.trace.step.kernel_failure`, on the model cut as the trace will cut it): a kernel that cannot
    build or run is left out of the plan with its reason, not the end of it; where none runs, the first one's error."""
    checked = cut_workload(workload, cut_depth(structure, CUT_LAYERS["full"][0])) if scale_period(structure) \
        else workload
    untraced = {k: why for k in attentions if (why := step.kernel_failure(checked, k, sdpa_dispatch)) is not None}
    if untraced and len(untraced) == len(attentions):
        kernel, why = next(iter(untraced.items()))
        raise step.NoKernelRuns(f"{workload.name} cannot be traced with attention={kernel}: {why}")
    return tuple(k for k in attentions if k not in untraced), untraced


def _scaled_profiles(workload: Workload, structure: ModelStructure, kinds: tuple[tuple[str, ...], tuple[str, ...]],
                     granularities: tuple[str, ...], n_middle: int, micro_batches: tuple[int, ...],
                     sdpa_dispatch: str = "cpu") -> tuple[dict[str, ActivationProfile], dict[str, str]]:
    """Profiles of all the layers from the model cut to :data:`CUT_LAYERS` periods of them after its leading layers
    (:func:`cut_depth`), on fake tensors; ``kinds``: the dtypes and attention kernels to trace. Where a period is
    several layers, or leading layers come first, the middle ratio's profile checkpoints the whole groups within its
    ``n_middle`` layers: at most one period fewer, which holds more, never less."""
    period, prefix = scale_period(structure), structure.layer_prefix
    n_layers = (structure.n_layers - prefix) // period
    tracers = {k: _Tracer(cut_workload(workload, cut_depth(structure, k)), structure, cut_layers=k,
                          sdpa_dispatch=sdpa_dispatch, period=period, prefix=prefix)
               for kind in CUT_LAYERS for k in cut_groups(kind, period)}
    trace_in_parallel(tracers, kinds, granularities, micro_batches)
    profiles: dict[str, ActivationProfile] = {}
    for dtype_name in kinds[0]:
        for attention in kinds[1]:
            def fitted(ratio: float, granularity: str) -> list[Any]:
                return [fit_kind(*(tracers[k].cut_trace(dtype_name, attention, ratio, micro_batches, i,  # noqa: B023
                                                        granularity)
                                   for k in cut_groups(granularity if ratio else "full", period)))
                        for i in range(len(micro_batches))]

            full = fitted(0.0, "block")
            profiles[ActivationProfile.key(dtype_name, attention, False)] = ActivationProfile(
                dtype=dtype_name, attention=attention, checkpointed=False,
                points=tuple(scaled_point(f, None, 0, n_layers, prefix > 0) for f in full))
            for granularity in granularities:
                ckpt = fitted(1.0, granularity)
                layouts = {ActivationProfile.key(dtype_name, attention, True, granularity): n_layers}
                if n_middle and granularity == "block":
                    layouts[ActivationProfile.partial_key(dtype_name, attention, n_middle, granularity)] = \
                        max(0, n_middle - prefix) // period
                for key, n_ckpt in layouts.items():
                    points = tuple(scaled_point(f, c, n_ckpt, n_layers, prefix > 0)
                                   for f, c in zip(full, ckpt, strict=True))
                    profiles[key] = ActivationProfile(dtype=dtype_name, attention=attention, checkpointed=True,
                                                      points=points, granularity=granularity)
    return profiles, dict(tracers[CUT_LAYERS["full"][0]].attention_traces)


def scale_period(structure: ModelStructure) -> int:
    """The layers taken as one where the model is traced cut and extrapolated (:func:`autofit.trace.layers.layer_period`:
    1 for alike layers); 0 where it is traced whole: fewer than :data:`SCALE_MIN_LAYERS` layers, or no more periods
    than the deepest cut keeps."""
    period, n_layers = structure.layer_period, structure.n_layers
    deep_enough = (n_layers >= SCALE_MIN_LAYERS and period
                   and (n_layers - structure.layer_prefix) // period > max(cut_groups("block", period)))
    return period if deep_enough else 0


def cut_depth(structure: ModelStructure, groups: int) -> int:
    """Layers of the model cut to ``groups`` periods: its leading layers (:attr:`ModelStructure.layer_prefix`), kept
    in every cut, and ``groups`` whole periods after them."""
    return structure.layer_prefix + groups * structure.layer_period


def _checkpointed_profiles(tracer: _Tracer, dtype_name: str, attention: str, granularity: str, n_layers: int,
                           n_middle: int, micro_batches: tuple[int, ...]) -> dict[str, ActivationProfile]:
    """The traces with every layer, and for ``block`` with the middle ratio's first ``n_middle``, checkpointed at
    ``granularity``. Attention-only checkpointing is not traced at the middle ratio: what it saves is each
    layer's attention, alike across a transformer's layers (a straight line between none and all), and the
    layers whose activations differ most (a CNN's stages) have no attention to checkpoint."""
    out = {}
    for n in (n_layers, n_middle) if n_middle and granularity == "block" else (n_layers,):
        key = (ActivationProfile.key(dtype_name, attention, True, granularity) if n == n_layers
               else ActivationProfile.partial_key(dtype_name, attention, n, granularity))
        points = tracer.points(dtype_name, attention, n / n_layers, micro_batches, granularity)
        out[key] = ActivationProfile(dtype=dtype_name, attention=attention, checkpointed=True, points=points,
                                     granularity=granularity)
    return out


def _structure(workload: Workload, optimizers: tuple[str, ...], model: Any = None) -> ModelStructure:
    """:func:`model_structure` (of ``model``, built on the meta device, where given), with Adam-mini's state
    elements where ``optimizers`` has it."""
    structure = model_structure(workload, model)
    if "adam_mini" in optimizers:

        try:
            structure = replace(structure, adam_mini_state_numel=adam_mini_state_numel(workload.build_model))
        except Exception as exc:  # the package's own step refuses the model: priced as not fitting, with why
            structure = replace(structure, adam_mini_error=f"{type(exc).__name__}: {first_line(exc)}")
    return structure


def trace_micro_batches(largest: int) -> tuple[int, ...]:
    """:data:`TRACE_MICRO_BATCHES`, and ``largest`` when past them.

    A step's live-bytes peak is the largest of its moments' (each layer's forward and backward, the
    optimizer step), each affine in the micro-batch: a convex, piecewise-linear function that turns from
    gradient-bound to activation-bound as the batch grows. A line through two small sizes extrapolated
    to a larger one misses that turn and under-predicts (examples/gpt.py, micro-batch 16, fp32, every
    layer checkpointed: 23% under the measured peak); between traced sizes a chord of a convex function
    lies above it, so interpolation errs on the side of fitting nothing that would not fit.
    """
    return tuple(sorted({*TRACE_MICRO_BATCHES, largest}))


@guards_user_code("tracing the workload")
def parameter_facts(workload: Workload) -> ModelFacts:
    """The model's parameter facts alone (counts, largest module, persistent parameters), from a build
    on the meta device: enough for model states (:func:`autofit.cost_model.states.model_states`),
    without the activation traces that pricing a whole config needs."""
    started = time.perf_counter()
    structure = model_structure(workload)
    return _facts(workload, structure, {}, structure.n_layers, "fake", time.perf_counter() - started)


def middle_checkpointed_layers(ratios: tuple[float, ...], n_layers: int) -> int:
    """Checkpointed layers of the ratio nearest 0.5 that wraps some but not all of ``n_layers`` (0: none)."""
    counts = {int(round(r * n_layers)) for r in ratios} - {0, n_layers}
    return min(counts, key=lambda n: (abs(n / n_layers - 0.5), n)) if counts else 0


@guards_user_code("tracing the workload")
def trace_config(workload: Workload, config: Config) -> ModelFacts:
    """Facts of exactly one config: traced at its own micro-batch, precision, attention and
    checkpoint ratio, so nothing is interpolated (``n_layers`` is 0: checkpointing is already in
    the trace). What ``autofit probe --mode fake`` prices."""
    started = time.perf_counter()
    structure = _structure(workload, (config.optimizer,))
    tracer = _Tracer(workload, structure)
    dtype_name = config.trace_dtype
    attention = config.attention if workload.searches_attention else "sdpa"
    points = tracer.points(dtype_name, attention, config.checkpoint_ratio, (config.micro_batch_size,),
                           config.checkpoint_granularity)
    profile = ActivationProfile(dtype=dtype_name, attention=attention, checkpointed=False, points=points)
    profiles = {ActivationProfile.key(dtype_name, attention, False): profile}
    facts = _facts(workload, structure, profiles, 0, tracer.mode, time.perf_counter() - started)
    return replace(facts, attention_traces=dict(tracer.attention_traces))


class _Tracer:
    """Runs trace steps on fake tensors, or on real CPU tensors once fake ones have failed; each run once.

    ``cut_layers`` > 0: the workload is cut to that many layers, and each step's live bytes are kept per
    segment (:mod:`autofit.trace.scaling`); such a tracer never falls back to real tensors.
    """

    def __init__(self, workload: Workload, structure: ModelStructure, cut_layers: int = 0,
                 sdpa_dispatch: str = "cpu", period: int = 1, prefix: int = 0) -> None:
        self.workload = workload
        self.period = period
        """Layers taken as one in :meth:`cut_trace` (the model cut to ``prefix + cut_layers x period`` layers)."""
        self.prefix = prefix
        """Leading layers, taken into the first group in :meth:`cut_trace`."""
        self.sdpa_dispatch = sdpa_dispatch
        self.structure = structure
        self.cut_layers = cut_layers
        self.mode = "fake"
        self.done: dict[tuple[Any, ...], tuple[PeakPoint, ...]] = {}
        self.segments: dict[tuple[Any, ...], tuple[dict[tuple[str, int], tuple[int, int]], ...]] = {}
        self._recorded: list[dict[tuple[str, int], tuple[int, int]]] = []
        self.attention_traces: dict[str, str] = {}
        """How each searched kernel was traced where it is not itself (``flash``: :mod:`autofit.trace.attention`)."""

    def points(self, dtype_name: str, attention: str, ratio: float, micro_batches: tuple[int, ...],
               granularity: str = "block") -> tuple[PeakPoint, ...]:
        ckpt = (ratio, granularity if ratio else "block")
        key = (dtype_name, attention, ckpt, micro_batches)
        if key not in self.done:
            self._recorded = []
            if attention == "flash":
                self.done[key] = self._flash_points(dtype_name, ckpt, micro_batches)
            else:
                self.done[key] = tuple(self._step(n, dtype_name, attention, ckpt) for n in micro_batches)
            self.segments[key] = tuple(self._recorded[len(self._recorded) - len(micro_batches):])
        return self.done[key]

    def hand_over(self, dtype_name: str, attention: str, ckpt: tuple[float, str], micro_batches: tuple[int, ...],
                  results: list[tuple[PeakPoint, dict[tuple[str, int], tuple[int, int]]]]) -> None:
        """The steps at each of ``micro_batches``, traced elsewhere (:func:`autofit.trace.parallel.trace_in_parallel`): what
        :meth:`points` would have traced, then returns without tracing."""
        key = (dtype_name, attention, (ckpt[0], ckpt[1] if ckpt[0] else "block"), micro_batches)
        if attention == "flash" and (stand_in := self.flash_stand_in()) is not None:
            self.attention_traces["flash"] = stand_in[1]  # traced with it, as :meth:`_flash_points` would say
        self.done[key] = tuple(point for point, _ in results)
        self.segments[key] = tuple(segments for _, segments in results)

    def cut_trace(self, dtype_name: str, attention: str, ratio: float, micro_batches: tuple[int, ...], i: int,
                  granularity: str = "block") -> CutTrace:
        """The step at ``micro_batches[i]`` (traced with the others of ``micro_batches``), per segment."""
        point = self.points(dtype_name, attention, ratio, micro_batches, granularity)[i]
        key = (dtype_name, attention, (ratio, granularity if ratio else "block"), micro_batches)
        return CutTrace(n_layers=self.cut_layers, point=point,
                        segments=grouped_segments(self.segments[key][i], self.period, self.prefix))

    def flash_stand_in(self) -> tuple[str, str] | None:
        """``(kernel given to build_model, label)`` that :meth:`_flash_points` will trace ``flash`` with, where that is
        known before any step: one way left to try (flash-attn not installed, or its functions already failed here);
        None where flash-attn's own functions are still to be tried."""
        plan = flash_trace_plan(flash_attn_installed(), self.workload.flash_stand_in)
        if len(plan) == 1 or self.attention_traces.get("flash") == SDPA_FLASH:
            return plan[-1]
        return None

    def _flash_points(self, dtype_name: str, ckpt: tuple[float, str], micro_batches: tuple[int, ...]) -> tuple[PeakPoint, ...]:
        """flash-attn's own functions where installed and they trace; SDPA's flash backend otherwise."""
        plan = flash_trace_plan(flash_attn_installed(), self.workload.flash_stand_in)
        if self.attention_traces.get("flash") == SDPA_FLASH:
            plan = plan[-1:]
        for kernel, label in plan[:-1]:
            try:
                with kernel_context(label):
                    points = tuple(self._run(n, dtype_name, kernel, ckpt) for n in micro_batches)
                self.attention_traces["flash"] = label
                return points
            except Exception:  # flash-attn's functions do not run here: the SDPA flash backend stands in
                continue
        kernel, label = plan[-1]
        self.attention_traces["flash"] = label
        with kernel_context(label):
            return tuple(self._step(n, dtype_name, kernel, ckpt) for n in micro_batches)

    def _run(self, n: int, dtype_name: str, kernel: str, ckpt: tuple[float, str]) -> PeakPoint:
        segments: dict[tuple[str, int], tuple[int, int]] | None = {} if self.cut_layers else None
        point = step.trace_step(self.workload, n, dtype_name, kernel, ckpt, self.mode, segments, self.sdpa_dispatch)
        if segments is not None:
            self._recorded.append(segments)
        return point

    def _step(self, n: int, dtype_name: str, kernel: str, ckpt: tuple[float, str]) -> PeakPoint:
        try:
            return self._run(n, dtype_name, kernel, ckpt)
        except step.NeedsRealTensors as exc:
            if self.cut_layers:
                raise
            if self.structure.param_bytes_fp32 > REAL_TRACE_LIMIT_BYTES:
                raise AutofitError(
                    f"cannot trace {self.workload.name} on fake tensors ({exc}) and at "
                    f"{self.structure.param_bytes_fp32 / 2**30:.1f} GiB it is too large to trace on real ones"
                ) from None
            self.mode = "real"
            return self._run(n, dtype_name, kernel, ckpt)


def _facts(workload: Workload, structure: ModelStructure, profiles: dict[str, ActivationProfile], n_layers: int,
           mode: str, seconds: float) -> ModelFacts:
    sequence = structure.sequence
    return ModelFacts(
        name=workload.name or "workload",
        n_params=structure.n_params,
        n_trainable_params=structure.n_trainable,
        n_layers=n_layers,
        layer_params=structure.layer_params if n_layers else (),
        largest_module_params=structure.largest_module_params,
        largest_param_numel=structure.largest_param_numel,
        n_small_params=structure.n_small_params,
        factored_state_numel=structure.factored_state_numel,
        adam_mini_state_numel=structure.adam_mini_state_numel,
        adam_mini_error=structure.adam_mini_error,
        n_param_tensors=structure.n_param_tensors,
        n_param_modules=structure.n_param_modules,
        n_persistent_params=structure.n_persistent_params,
        buffer_bytes=structure.buffer_bytes,
        fp8_largest_linear=structure.fp8_largest_linear,
        fp8_weight_elements=structure.fp8_weight_elements,
        fp8_feature_elements=structure.fp8_feature_elements,
        hidden_size=structure.hidden_size,
        seq_len=sequence.seq_len,
        vocab_size=sequence.vocab_size,
        intermediate_size=sequence.intermediate_size,
        kv_width=sequence.kv_width,
        n_kv_heads=sequence.n_kv_heads,
        mlp_intermediates=sequence.mlp_intermediates,
        mlp_matrices=sequence.mlp_matrices,
        tokens_per_sample=workload.tokens_per_sample,
        profiles=profiles,
        trace_mode=mode,
        trace_seconds=seconds,
    )


