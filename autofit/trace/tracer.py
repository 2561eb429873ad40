"""Trace a workload's step on fake (or, for data-dependent models, real) tensors: live bytes, FLOPs, per-layer
segments, at each traced micro-batch, precision, attention kernel and checkpoint layout (the story: :mod:`autofit.trace`)."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from autofit.core.config import Config, trace_dtype_of
from autofit.core.errors import AutofitError
from autofit.cost_model.facts import ActivationProfile, ModelFacts, PeakPoint
from autofit.trace.attention import SDPA_FLASH, flash_attn_installed, flash_trace_plan, kernel_context
from autofit.trace.layers import SegmentMarks, cut_workload
from autofit.trace.scaling import CUT_LAYERS, CannotScale, CutTrace, fit_kind, scaled_point
from autofit.trace.structure import fp8_linear_flops, model_structure
from autofit.trace.tensors import (
    batch_tensors,
    cast_batch,
    first_line,
    flop_counter,
    kernel_workspace_bytes,
    to_dtype,
)
from autofit.trace.traffic import Traffic, storage_key
from autofit.workload.types import Workload

#: the micro-batches every profile is traced at; a space with larger ones adds its largest
#: (:func:`trace_micro_batches`)
TRACE_MICRO_BATCHES = (1, 4)
#: largest model (fp32 parameter bytes) traced on real tensors when fake tensors cannot run it
REAL_TRACE_LIMIT_BYTES = 2 * 2**30
#: alike repeated layers from which a model is traced cut to a few of them (:mod:`autofit.trace.scaling`)
SCALE_MIN_LAYERS = 12


def trace_workload(
    workload: Workload,
    *,
    precisions: tuple[str, ...] = ("fp32",),
    attentions: tuple[str, ...] = ("sdpa",),
    checkpoint_ratios: tuple[float, ...] = (),
    optimizers: tuple[str, ...] = (),
    checkpoint_granularities: tuple[str, ...] = ("block",),
    micro_batches: tuple[int, ...] = TRACE_MICRO_BATCHES,
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
    """
    import torch

    from autofit.trace.cache import cached_trace

    trace_workers_setting()  # a bad setting is an error whether or not this trace forks (or is cached)
    started = time.perf_counter()
    with torch.device("meta"):
        model = workload.build_model()
    request = {"precisions": precisions, "attentions": attentions, "checkpoint_ratios": checkpoint_ratios,
               "optimizers": optimizers, "checkpoint_granularities": checkpoint_granularities,
               "micro_batches": micro_batches}
    facts = cached_trace(workload, model, request, lambda: _trace_workload(
        workload, _structure(workload, optimizers, model), precisions, attentions, checkpoint_ratios,
        checkpoint_granularities, micro_batches))
    return replace(facts, trace_seconds=time.perf_counter() - started)


def _trace_workload(workload: Workload, structure: dict[str, Any], precisions: tuple[str, ...],
                    attentions: tuple[str, ...], checkpoint_ratios: tuple[float, ...],
                    checkpoint_granularities: tuple[str, ...], micro_batches: tuple[int, ...]) -> ModelFacts:
    """:func:`trace_workload` without the cache."""
    started = time.perf_counter()
    dtype_names = tuple(sorted({trace_dtype_of(p) for p in precisions}))
    attention_names = attentions if workload.searches_attention else ("sdpa",)
    n_layers = structure["n_layers"]
    n_middle = middle_checkpointed_layers(checkpoint_ratios, n_layers)
    granularities = tuple(checkpoint_granularities) if n_layers else ()
    scaled = None
    if structure["layers_alike"] and n_layers >= SCALE_MIN_LAYERS:
        with contextlib.suppress(CannotScale, _NeedsRealTensors):
            scaled = _scaled_profiles(workload, structure, (dtype_names, attention_names), granularities, n_middle,
                                      micro_batches)
    if scaled is None:
        tracer = _Tracer(workload, structure)
        profiles: dict[str, ActivationProfile] = {}
        for dtype_name in dtype_names:
            for attention in attention_names:
                profiles[ActivationProfile.key(dtype_name, attention, False)] = ActivationProfile(
                    dtype=dtype_name, attention=attention, checkpointed=False,
                    points=tracer.points(dtype_name, attention, 0.0, micro_batches))
                for granularity in granularities:
                    profiles |= _checkpointed_profiles(tracer, dtype_name, attention, granularity, n_layers, n_middle,
                                                       micro_batches)
        mode, traces = tracer.mode, tracer.attention_traces
    else:
        (profiles, traces), mode = scaled, "fake-scaled"
    facts = _facts(workload, structure, profiles, n_layers, mode, time.perf_counter() - started)
    return replace(facts, attention_traces=dict(traces))


def _scaled_profiles(workload: Workload, structure: dict[str, Any], kinds: tuple[tuple[str, ...], tuple[str, ...]],
                     granularities: tuple[str, ...], n_middle: int,
                     micro_batches: tuple[int, ...]) -> tuple[dict[str, ActivationProfile], dict[str, str]]:
    """Profiles of all the layers from the model cut to :data:`CUT_LAYERS` of them, on fake tensors;
    ``kinds``: the dtypes and attention kernels to trace."""
    n_layers = structure["n_layers"]
    tracers = {k: _Tracer(cut_workload(workload, k), structure, cut_layers=k) for cut in CUT_LAYERS.values() for k in cut}
    _trace_in_parallel(tracers, kinds, granularities, micro_batches)
    profiles: dict[str, ActivationProfile] = {}
    for dtype_name in kinds[0]:
        for attention in kinds[1]:
            def fitted(ratio: float, granularity: str) -> list[Any]:
                return [fit_kind(*(tracers[k].cut_trace(dtype_name, attention, ratio, micro_batches, i,  # noqa: B023
                                                        granularity)
                                   for k in CUT_LAYERS[granularity if ratio else "full"])) for i in range(len(micro_batches))]

            full = fitted(0.0, "block")
            profiles[ActivationProfile.key(dtype_name, attention, False)] = ActivationProfile(
                dtype=dtype_name, attention=attention, checkpointed=False,
                points=tuple(scaled_point(f, None, 0, n_layers) for f in full))
            for granularity in granularities:
                ckpt = fitted(1.0, granularity)
                layouts = {ActivationProfile.key(dtype_name, attention, True, granularity): n_layers}
                if n_middle and granularity == "block":
                    layouts[ActivationProfile.partial_key(dtype_name, attention, n_middle, granularity)] = n_middle
                for key, n_ckpt in layouts.items():
                    points = tuple(scaled_point(f, c, n_ckpt, n_layers) for f, c in zip(full, ckpt, strict=True))
                    profiles[key] = ActivationProfile(dtype=dtype_name, attention=attention, checkpointed=True,
                                                      points=points, granularity=granularity)
    return profiles, dict(tracers[CUT_LAYERS["full"][0]].attention_traces)


#: environment variable: how many processes trace the cut models at once, a positive integer (unset or empty:
#: :func:`trace_workers` decides). On the
#: quiet 2-core development machine, LLaMA-2-70B's cold plan took 12.7 s in one process and 9.7-9.8 s with 2
#: workers; with its other core busy, 2 workers took 8.5-9.4 s to trace against 8.0-8.2 s in one process (each
#: worker pays its own fake-tensor caches): set it to 1 on a loaded machine
TRACE_WORKERS_ENV = "AUTOFIT_TRACE_WORKERS"
#: the most forked tracers by default (36 steps for LLaMA-2-70B's default space)
MAX_TRACE_WORKERS = 8

#: one step of a cut trace: (its run's index in :func:`_parallel_runs`, the micro-batch)
_StepKey = tuple[int, int]
#: a run: the tracer, dtype, attention kernel and checkpointing (ratio, granularity) it traces at each micro-batch
_Run = tuple["_Tracer", str, str, tuple[float, str]]
#: a step's result: its point and per-segment peaks (what :meth:`_Tracer.hand_over` takes)
_StepResult = tuple[PeakPoint, dict[tuple[str, int], tuple[int, int]]]
#: the runs the forked workers trace (set before the fork, read in the children by :data:`_StepKey`)
_FORKED_RUNS: list[_Run] = []


def trace_workers_setting() -> int | None:
    """:data:`TRACE_WORKERS_ENV` as a number of processes, or None where it is unset or empty. A value that is not a
    positive integer is an error, not ignored: one set to limit the load must not fork one tracer per core."""
    import os

    value = os.environ.get(TRACE_WORKERS_ENV, "")
    word = value.strip()
    if not word:
        return None
    if not (word.isascii() and word.isdigit()) or int(word) < 1:
        raise AutofitError(f"{TRACE_WORKERS_ENV}={value!r} is not a positive integer: set it to how many processes "
                           "trace at once (1: all in this one), or unset it for one per usable core")
    return int(word)


def trace_workers() -> int:
    """Processes that trace at once: :func:`trace_workers_setting`; else one per usable core (up to
    :data:`MAX_TRACE_WORKERS`) where this process runs a single Python thread (the CLI, a notebook cell): a fork
    copies only the forking thread, so a process with others (a queue worker's lease thread) could fork a lock one
    of them held; there 1 (no fork)."""
    import os
    import threading

    wanted = trace_workers_setting()
    if wanted is not None:
        return wanted
    if threading.active_count() > 1 or not hasattr(os, "sched_getaffinity"):
        return 1
    return max(1, min(MAX_TRACE_WORKERS, len(os.sched_getaffinity(0))))


def _parallel_runs(tracers: dict[int, _Tracer], kinds: tuple[tuple[str, ...], tuple[str, ...]],
                   granularities: tuple[str, ...]) -> list[_Run]:
    """The runs :func:`_scaled_profiles` will ask the cut tracers for, but ``flash``'s (which kernel stands in for
    it is decided as the tracer goes)."""
    return [(tracers[k], dtype_name, attention, (ratio, granularity))
            for dtype_name in kinds[0] for attention in kinds[1] if attention != "flash"
            for ratio, granularity in [(0.0, "block"), *((1.0, g) for g in granularities)]
            for k in CUT_LAYERS[granularity if ratio else "full"]]


def _trace_in_parallel(tracers: dict[int, _Tracer], kinds: tuple[tuple[str, ...], tuple[str, ...]],
                       granularities: tuple[str, ...], micro_batches: tuple[int, ...]) -> None:
    """Run the steps of :func:`_parallel_runs` (each run at each of ``micro_batches``) in :func:`trace_workers`
    forked processes (where more than 1), and hand each tracer the runs whose every step came back, as if it had
    traced them itself: each step is independent of the others (a fresh model, batch and counters; 36 steps for
    LLaMA-2-70B's default space), so the facts are those of one process. A step that fails in a worker is left to
    the tracer, which runs it again and raises or falls back as it always does. Where forking is unavailable, or
    fails, or a worker dies, nothing is handed over and one line on stderr says so: the tracers trace in this
    process."""
    import multiprocessing

    runs = _parallel_runs(tracers, kinds, granularities)
    keys = [(r, n) for r in range(len(runs)) for n in micro_batches]
    workers = min(trace_workers(), len(keys))
    if workers < 2:
        return
    if "fork" not in multiprocessing.get_all_start_methods():
        _in_one_process(f"{workers} trace workers asked for, but this platform cannot fork")
        return
    # the longest first (more layers, larger micro-batches): the workers end together
    keys.sort(key=lambda key: (-runs[key[0]][0].cut_layers, -key[1]))
    results = _forked_results(runs, keys, workers)
    if results is None:
        return
    done = {key: result for key, result in results.items() if result is not None}
    for r, (tracer, dtype_name, attention, ckpt) in enumerate(runs):
        if all((r, n) in done for n in micro_batches):
            tracer.hand_over(dtype_name, attention, ckpt, micro_batches, [done[(r, n)] for n in micro_batches])


def _forked_results(runs: list[_Run], keys: list[_StepKey], workers: int) -> dict[_StepKey, _StepResult | None] | None:
    """Each step of ``keys`` traced in ``workers`` forked processes, in that order (:func:`_forked_step`), or None
    where a process could not be forked or died (a notice on stderr). What else fails in the pool (a result that
    cannot be pickled: a bug) is raised, not hidden behind a slower trace."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    global _FORKED_RUNS
    _FORKED_RUNS = runs
    try:
        # a pool of ProcessPoolExecutor raises BrokenProcessPool where a worker dies (multiprocessing.Pool waits)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return dict(zip(keys, pool.map(_forked_step, keys), strict=True))
    except (OSError, BrokenProcessPool) as exc:  # a fork refused (no memory, a process limit), a worker killed
        _in_one_process(f"a trace worker could not start or died: {type(exc).__name__}: {first_line(exc)}")
        return None
    finally:
        _FORKED_RUNS = []


def _in_one_process(why: str) -> None:
    """The notice that the cut traces run in this process after all (slower, the same facts)."""
    import sys

    print(f"autofit: tracing in one process ({why})", file=sys.stderr, flush=True)


def _forked_step(key: _StepKey) -> _StepResult | None:
    """The step ``key`` of :data:`_FORKED_RUNS`, in a worker: its point and per-segment peaks, or None where it
    failed (the tracer, running it itself, raises or falls back as it always does)."""
    run, n = key
    tracer, dtype_name, attention, ckpt = _FORKED_RUNS[run]
    segments: dict[tuple[str, int], tuple[int, int]] = {}
    try:
        point = _trace_step(tracer.workload, n, dtype_name, attention, ckpt, tracer.mode, segments)
    except Exception:  # the step's own failure: reported when the tracer runs it in this process
        return None
    return point, segments


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


def _structure(workload: Workload, optimizers: tuple[str, ...], model: Any = None) -> dict[str, Any]:
    """:func:`model_structure` (of ``model``, built on the meta device, where given), with Adam-mini's state
    elements where ``optimizers`` has it."""
    structure = model_structure(workload, model)
    if "adam_mini" in optimizers:
        from autofit.ds.optim import adam_mini_state_numel

        try:
            structure["adam_mini_state_numel"] = adam_mini_state_numel(workload.build_model)
        except Exception as exc:  # the package's own step refuses the model: priced as not fitting, with why
            structure["adam_mini_error"] = f"{type(exc).__name__}: {first_line(exc)}"
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


def parameter_facts(workload: Workload) -> ModelFacts:
    """The model's parameter facts alone (counts, largest module, persistent parameters), from a build
    on the meta device: enough for model states (:func:`autofit.cost_model.memory.model_states`),
    without the activation traces that pricing a whole config needs."""
    started = time.perf_counter()
    structure = model_structure(workload)
    return _facts(workload, structure, {}, structure["n_layers"], "fake", time.perf_counter() - started)


def middle_checkpointed_layers(ratios: tuple[float, ...], n_layers: int) -> int:
    """Checkpointed layers of the ratio nearest 0.5 that wraps some but not all of ``n_layers`` (0: none)."""
    counts = {int(round(r * n_layers)) for r in ratios} - {0, n_layers}
    return min(counts, key=lambda n: (abs(n / n_layers - 0.5), n)) if counts else 0


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

    def __init__(self, workload: Workload, structure: dict[str, Any], cut_layers: int = 0) -> None:
        self.workload = workload
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
        """The steps at each of ``micro_batches``, traced elsewhere (:func:`_trace_in_parallel`): what
        :meth:`points` would have traced, then returns without tracing."""
        key = (dtype_name, attention, (ckpt[0], ckpt[1] if ckpt[0] else "block"), micro_batches)
        self.done[key] = tuple(point for point, _ in results)
        self.segments[key] = tuple(segments for _, segments in results)

    def cut_trace(self, dtype_name: str, attention: str, ratio: float, micro_batches: tuple[int, ...], i: int,
                  granularity: str = "block") -> CutTrace:
        """The step at ``micro_batches[i]`` (traced with the others of ``micro_batches``), per segment."""
        point = self.points(dtype_name, attention, ratio, micro_batches, granularity)[i]
        key = (dtype_name, attention, (ratio, granularity if ratio else "block"), micro_batches)
        return CutTrace(n_layers=self.cut_layers, point=point, segments=self.segments[key][i])

    def _flash_points(self, dtype_name: str, ckpt: tuple[float, str], micro_batches: tuple[int, ...]) -> tuple[PeakPoint, ...]:
        """flash-attn's own functions where installed and they trace; SDPA's flash backend otherwise."""
        plan = flash_trace_plan(flash_attn_installed())
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
        point = _trace_step(self.workload, n, dtype_name, kernel, ckpt, self.mode, segments)
        if segments is not None:
            self._recorded.append(segments)
        return point

    def _step(self, n: int, dtype_name: str, kernel: str, ckpt: tuple[float, str]) -> PeakPoint:
        try:
            return self._run(n, dtype_name, kernel, ckpt)
        except _NeedsRealTensors as exc:
            if self.cut_layers:
                raise
            if self.structure["param_bytes_fp32"] > REAL_TRACE_LIMIT_BYTES:
                raise AutofitError(
                    f"cannot trace {self.workload.name} on fake tensors ({exc}) and at "
                    f"{self.structure['param_bytes_fp32'] / 2**30:.1f} GiB it is too large to trace on real ones"
                ) from None
            self.mode = "real"
            return self._run(n, dtype_name, kernel, ckpt)


def _facts(workload: Workload, structure: dict[str, Any], profiles: dict[str, ActivationProfile], n_layers: int,
           mode: str, seconds: float) -> ModelFacts:
    return ModelFacts(
        name=workload.name or "workload",
        n_params=structure["n_params"],
        n_trainable_params=structure["n_trainable"],
        n_layers=n_layers,
        layer_params=tuple(structure["layer_params"]) if n_layers else (),
        largest_module_params=structure["largest_module_params"],
        largest_param_numel=structure["largest_param_numel"],
        n_small_params=structure["n_small_params"],
        factored_state_numel=structure["factored_state_numel"],
        adam_mini_state_numel=structure.get("adam_mini_state_numel", 0),
        adam_mini_error=structure.get("adam_mini_error", ""),
        n_param_tensors=structure["n_param_tensors"],
        n_persistent_params=structure["n_persistent_params"],
        buffer_bytes=structure["buffer_bytes"],
        fp8_largest_linear=tuple(structure["fp8_largest_linear"]),
        fp8_weight_elements=structure.get("fp8_weight_elements", 0),
        fp8_feature_elements=structure.get("fp8_feature_elements", 0),
        hidden_size=structure.get("hidden_size", 0),
        tokens_per_sample=workload.tokens_per_sample,
        profiles=profiles,
        trace_mode=mode,
        trace_seconds=seconds,
    )


class _NeedsRealTensors(Exception):
    """The model does something fake tensors cannot (a data-dependent shape, a stricter meta kernel)."""


@contextlib.contextmanager
def _fake_mode(mode: str) -> Iterator[Any]:
    if mode == "real":
        yield None
        return
    import logging

    from torch._subclasses.fake_tensor import FakeTensorMode

    # a kernel that fails on fake tensors is retried on real ones; torch's own log of it is noise here
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            yield fake
    finally:
        log.setLevel(level)


@dataclass
class _LiveBytes:
    """Running count of the bytes held by storages created since tracking began."""

    live: int = 0
    grads: int = 0
    peak_with_grads: int = 0
    peak_without_grads: int = 0
    tracked: set[int] = field(default_factory=set)
    traffic: Traffic = field(default_factory=Traffic)
    """Bytes the step's non-matmul kernels move, eager and fused (:mod:`autofit.trace.traffic`)."""
    marks: SegmentMarks | None = None
    """Where the step is (cut traces only): peaks are kept per segment too."""
    segment_peaks: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    def add(self, key: int, n_bytes: int) -> None:
        self.live += n_bytes
        self.note()

    def remove(self, key: int, n_bytes: int) -> None:
        self.tracked.discard(key)
        self.traffic.forget(key)
        self.live -= n_bytes

    def note(self, workspace: int = 0) -> None:
        """A moment of the step: the live bytes, plus ``workspace`` the running kernel holds beside them."""
        live = self.live + workspace
        self.peak_with_grads = max(self.peak_with_grads, live)
        self.peak_without_grads = max(self.peak_without_grads, live - self.grads)
        if self.marks is not None:
            key = self.marks.segment()
            with_grads, without_grads = self.segment_peaks.get(key, (0, 0))
            self.segment_peaks[key] = (max(with_grads, live), max(without_grads, live - self.grads))


def _make_tracker(counter: _LiveBytes) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveMemoryMode(TorchDispatchMode):
        """Counts every storage an op creates until that storage is freed."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._track(tensor)
            counter.note(kernel_workspace_bytes(func, args, out))
            counter.traffic.record(func, args, kwargs, out)
            return out

        def _track(self, tensor: Any) -> None:
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in counter.tracked:
                return
            n_bytes = storage.nbytes()
            counter.tracked.add(key)
            counter.add(key, n_bytes)
            weakref.finalize(storage, counter.remove, key, n_bytes)

    return LiveMemoryMode()


def _trace_step(workload: Workload, n: int, dtype_name: str, attention: str, ckpt: tuple[float, str], mode: str,
                segments: dict[tuple[str, int], tuple[int, int]] | None = None) -> PeakPoint:
    """Forward + backward of one micro-batch of ``n`` samples; live bytes exclude parameters.
    ``ckpt``: ``(checkpoint ratio, granularity)``, applied as :func:`autofit.ds.apply.apply_checkpointing` does;
    ``segments``: filled with the peaks of each segment of the step (:class:`SegmentMarks`)."""
    import torch

    from autofit.ds.apply import apply_checkpointing

    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    try:
        with _fake_mode(mode):
            model = to_dtype(workload.build_model(attention=attention), dtype)
            model.train()
            layers = workload.repeated_layers(model)
            if ckpt[0]:
                apply_checkpointing(model, layers, ckpt[0], ckpt[1], workload.attention_of)
            batch = cast_batch(workload.batch(n), dtype)
            # layer marks whenever layers are cut or checkpointed: they also collect the checkpointed recompute's
            # reference cycles as each layer ends (autofit/trace/layers.py), which a whole trace counted too
            marked = segments is not None or bool(ckpt[0] and layers)
            counter: _LiveBytes = _LiveBytes(marks=SegmentMarks(layers, lambda: counter.note()) if marked else None)
            _ignore_existing(counter, [*model.parameters(), *model.buffers(), *batch_tensors(batch)])
            params = [p for p in model.parameters() if p.requires_grad]
            hooks = [p.register_post_accumulate_grad_hook(_grad_hook(counter)) for p in params]
            activation_bytes_at_loss = 0
            flops = flop_counter()
            marking = counter.marks.tracking() if counter.marks else contextlib.nullcontext()
            with flops, _make_tracker(counter), marking:
                loss = workload.compute_loss(model, batch)
                activation_bytes_at_loss = counter.live
                if counter.marks:
                    counter.marks.start_backward()
                counter.traffic.start_backward()
                loss.backward()
            for hook in hooks:
                hook.remove()
            grad_bytes = counter.grads
            fp8_flops = fp8_linear_flops(model, flops.get_flop_counts())
            del loss, model, batch, params
            if segments is not None:
                segments.update(counter.segment_peaks)
    except Exception as exc:
        if mode == "fake":  # data-dependent shapes, or kernels whose fake (meta) versions are stricter
            raise _NeedsRealTensors(f"{type(exc).__name__}: {first_line(exc)}") from exc
        raise AutofitError(f"tracing {workload.name} ({dtype_name}, {attention}) failed: {type(exc).__name__}: {exc}") from exc
    return PeakPoint(
        micro_batch_size=n,
        peak_with_grads_bytes=counter.peak_with_grads,
        peak_without_grads_bytes=counter.peak_without_grads,
        activation_bytes=activation_bytes_at_loss,
        grad_bytes=grad_bytes,
        flops=int(flops.get_total_flops()),
        fp8_flops=fp8_flops,
        memory_bound_bytes=counter.traffic.eager,
        fused_memory_bound_bytes=counter.traffic.fused,
    )


def _ignore_existing(counter: _LiveBytes, tensors: list[Any]) -> None:
    """Storages that exist before the step (parameters, buffers, the batch) and their views are not counted."""
    for tensor in tensors:
        counter.tracked.add(tensor.untyped_storage()._cdata)


def _grad_hook(counter: _LiveBytes) -> Any:
    def hook(param: Any) -> None:
        grad = param.grad
        if grad is not None:
            counter.grads += grad.untyped_storage().nbytes()
            counter.traffic.keep(storage_key(grad))  # the optimizer reads it
            counter.note()

    return hook
