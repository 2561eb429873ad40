"""The cut traces of a many-layer model, run in forked processes (:func:`trace_in_parallel`): each step is independent
of the others, so the tracers are handed the results as if they had traced them themselves."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any

from autofit.core.errors import AutofitError, is_control
from autofit.cost_model.facts import PeakPoint
from autofit.machine.lifetime import die_with_parent
from autofit.trace import step
from autofit.trace.attention import kernel_context
from autofit.trace.scaling import cut_groups
from autofit.trace.tensors import (
    first_line,
)

if TYPE_CHECKING:
    from autofit.trace.tracer import _Tracer

#: environment variable: how many processes trace the cut models at once (and price a large plan's candidates:
#: :mod:`autofit.planning.parallel_pricing`), a positive integer (unset or empty: :func:`trace_workers` decides). On
#: a quiet 2-core machine LLaMA-2-70B's cold plan takes 12.7 s in one process and 9.7-9.8 s with 2 workers; with its
#: other core busy, 2 workers take 8.5-9.4 s to trace against 8.0-8.2 s in one process (each worker pays its own
#: fake-tensor caches; docs/results/planning.md): set it to 1 on a loaded machine
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

    value = os.environ.get(TRACE_WORKERS_ENV, "")
    word = value.strip()
    if not word:
        return None
    if not (word.isascii() and word.isdigit()) or int(word) < 1:
        raise AutofitError(f"{TRACE_WORKERS_ENV}={value!r} is not a positive integer: set it to how many processes "
                           "trace at once (1: all in this one), or unset it for one per usable core")
    most = max(MAX_TRACE_WORKERS, os.cpu_count() or 1)
    if len(word) > 6 or int(word) > most:
        raise AutofitError(f"{TRACE_WORKERS_ENV}={value!r} is more processes than this machine can use (at most "
                           f"{most}): set it lower, or unset it for one per usable core")
    return int(word)


def trace_workers() -> int:
    """Processes that trace at once: :func:`trace_workers_setting`; else one per usable core (up to
    :data:`MAX_TRACE_WORKERS`) where this process runs a single Python thread (the CLI, a notebook cell): a fork
    copies only the forking thread, so a process with others (a queue worker's lease thread) could fork a lock one
    of them held; there 1 (no fork)."""

    wanted = trace_workers_setting()
    if wanted is not None:
        return wanted
    if threading.active_count() > 1 or not hasattr(os, "sched_getaffinity"):
        return 1
    return max(1, min(MAX_TRACE_WORKERS, len(os.sched_getaffinity(0))))


def _parallel_runs(tracers: dict[int, _Tracer], kinds: tuple[tuple[str, ...], tuple[str, ...]],
                   granularities: tuple[str, ...]) -> list[_Run]:
    """The runs :func:`_scaled_profiles` will ask the cut tracers for; ``flash``'s only where the kernel that stands in
    for it is known before a step (:meth:`_Tracer.flash_stand_in`: flash-attn not installed); where flash-attn's own
    functions are to be tried first, the tracer decides as it goes, in this process."""
    flash_known = all(tracer.flash_stand_in() is not None for tracer in tracers.values())
    period = next(iter(tracers.values())).period
    return [(tracers[k], dtype_name, attention, (ratio, granularity))
            for dtype_name in kinds[0] for attention in kinds[1] if attention != "flash" or flash_known
            for ratio, granularity in [(0.0, "block"), *((1.0, g) for g in granularities)]
            for k in cut_groups(granularity if ratio else "full", period)]


def trace_in_parallel(tracers: dict[int, _Tracer], kinds: tuple[tuple[str, ...], tuple[str, ...]],
                       granularities: tuple[str, ...], micro_batches: tuple[int, ...]) -> None:
    """Run the steps of :func:`_parallel_runs` (each run at each of ``micro_batches``) in :func:`trace_workers`
    forked processes (where more than 1), and hand each tracer the runs whose every step came back, as if it had
    traced them itself: each step is independent of the others (a fresh model, batch and counters; 36 steps for
    LLaMA-2-70B's default space), so the facts are those of one process. A step that fails in a worker is left to
    the tracer, which runs it again and raises or falls back as it always does. Where forking is unavailable, or
    fails, or a worker dies, nothing is handed over and one line on stderr says so: the tracers trace in this
    process."""

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

    global _FORKED_RUNS
    _FORKED_RUNS = runs
    try:
        return dict(zip(keys, forked_map(_forked_step, keys, workers), strict=True))
    except FORK_FAILURES as exc:
        _in_one_process(f"a trace worker could not start or died: {type(exc).__name__}: {first_line(exc)}")
        return None
    finally:
        _FORKED_RUNS = []


#: what :func:`forked_map` raises where a process could not be forked (no memory, a process limit) or died (killed)
FORK_FAILURES = (OSError, BrokenProcessPool)


def forked_map(function: Callable[[Any], Any], items: list[Any], workers: int) -> list[Any]:
    """``function`` of each of ``items``, in order, in ``workers`` processes forked from this one (what they read of
    it set before the call), each dying with this process; :data:`FORK_FAILURES` where one could not start or died.
    What else fails (a result that cannot be pickled: a bug) is raised as it is."""
    # a pool of ProcessPoolExecutor raises BrokenProcessPool where a worker dies (multiprocessing.Pool waits); each
    # worker dies with this process (a SIGKILL from outside included): a worker runs no subprocess, so the
    # parent-death signal is enough (autofit/machine/lifetime.py); a fork pool starts its workers from this thread,
    # the one that waits for them (the signal follows the thread that forked)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        return list(pool.map(function, items))


def _in_one_process(why: str) -> None:
    """The notice that the cut traces run in this process after all (slower, the same facts)."""

    print(f"autofit: tracing in one process ({why})", file=sys.stderr, flush=True)


def _forked_step(key: _StepKey) -> _StepResult | None:
    """The step ``key`` of :data:`_FORKED_RUNS`, in a worker: its point and per-segment peaks, or None where it
    failed (the tracer, running it itself, raises or falls back as it always does)."""
    run, n = key
    tracer, dtype_name, attention, ckpt = _FORKED_RUNS[run]
    segments: dict[tuple[str, int], tuple[int, int]] = {}
    kernel, label = (attention, "") if attention != "flash" else tracer.flash_stand_in() or ("", "")
    try:
        with kernel_context(label):  # flash: SDPA's flash backend, as the tracer's _flash_points runs it
            point = step.trace_step(tracer.workload, n, dtype_name, kernel, ckpt, tracer.mode, segments,
                                    tracer.sdpa_dispatch)
    except AutofitError:  # a build error or a step too slow: the tracer would meet it again, so it ends the trace
        raise
    except BaseException as exc:  # the step's own failure: reported when the tracer runs it in this process
        if is_control(exc):
            raise
        return None
    return point, segments


