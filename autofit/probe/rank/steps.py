"""Step timing of one probe rank: warm-up, the peak read, then the timed optimizer steps."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autofit.ds.apply import activation_offload_context, compiles
from autofit.probe.failure import first_line, oom_location
from autofit.probe.rank import memory
from autofit.probe.rank.meter import Meter

#: a warm-up step has settled when it took within this fraction of the warm-up step before it
SETTLE_TOLERANCE = 0.10
#: warm-up steps run past the asked ones, at most, while the step times have not settled
MAX_EXTRA_WARMUP = 4
#: the timed steps are read as steady when their spread, ``(max - min) / median``, is within this
STEADY_SPREAD = 0.10
#: timed steps run past the asked ones, at most, while their spread is wider than :data:`STEADY_SPREAD`
MAX_EXTRA_TIMED = 4


@dataclass
class StepTimes:
    """What the timed steps measured."""

    peak_bytes: int
    step_times_s: list[float] = field(default_factory=list)
    optimizer_times_s: list[float] = field(default_factory=list)
    loss: float = float("nan")
    compile_s: float | None = None
    """Seconds of the first warm-up step where the model is compiled (it builds the graph); None otherwise."""
    warmup_times_s: list[float] = field(default_factory=list)
    """Seconds of each untimed warm-up step, in order (the first holds what a first step costs beyond the others:
    the allocator's growth, kernels' first use, autotuning)."""

    def step_time_s(self) -> float:
        """The median timed step (0.0 when none was timed)."""
        return statistics.median(self.step_times_s) if self.step_times_s else 0.0

    def spread(self) -> float:
        """``(max - min) / median`` of the timed steps (0.0 with fewer than two)."""
        median = self.step_time_s()
        return (max(self.step_times_s) - min(self.step_times_s)) / median if median > 0 and len(self.step_times_s) > 1 else 0.0

    def optimizer_time_s(self) -> float:
        """The median of the optimizer's own ``engine.step`` (0.0 when none was timed)."""
        return statistics.median(self.optimizer_times_s) if self.optimizer_times_s else 0.0


def train_step(engine: Any, compute_loss: Callable[[], Any], grad_accum_steps: int, sync: Callable[[], None],
               around: Callable[[], Any] = contextlib.nullcontext) -> tuple:
    """One optimizer step: (seconds in all, seconds of the optimizer's own ``engine.step``, last loss). Each
    micro-batch's forward and backward run inside ``around()`` (activation offload's context)."""
    sync()
    t0 = time.perf_counter()
    optimizer_s = 0.0
    loss = None
    for _ in range(grad_accum_steps):
        with around():
            loss = compute_loss()
            engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:
            sync()
            t_opt = time.perf_counter()
        engine.step()
        if boundary:
            sync()
            optimizer_s += time.perf_counter() - t_opt
    sync()
    return time.perf_counter() - t0, optimizer_s, loss


def run_steps(engine: Any, compute_loss: Callable[[], Any], grad_accum_steps: int, meter: Meter, ds: dict[str, Any],
              warmup_steps: int, steps: int) -> StepTimes:
    """Warm-up steps until the step time settles, then timed steps until they agree; the peak is read as
    docs/design.md ("Memory, measured") says. ``ds``: the candidate's DeepSpeed JSON (whether it compiles: the
    compiling step comes first).

    Warm-up: ``warmup_steps`` steps, and more (up to :data:`MAX_EXTRA_WARMUP`) until one took within
    :data:`SETTLE_TOLERANCE` of the one before it, so that the first steps' extra time (the allocator's growth, first
    use of each kernel, a ZeRO-3 engine recording its module order) stays out of the timed ones and is reported apart
    (``warmup_times_s``). Timed: ``steps`` steps, and more (up to :data:`MAX_EXTRA_TIMED`) while their spread is wider
    than :data:`STEADY_SPREAD`; the median is the step time.

    CPU: one more step after warm-up runs under the probe's allocator setting and the peak is
    read after it; then glibc goes back to reusing freed blocks and one more step refills its heap
    before the timed ones. CUDA: the peak is read after the timed steps.
    """

    def step() -> tuple:
        return train_step(engine, compute_loss, grad_accum_steps, meter.sync, lambda: activation_offload_context(ds))

    # the compiling step comes before the warm-up ones, which then run the compiled graph (a recompile a guard
    # triggers in the second step lands in warm-up, not in the timed steps)
    compile_s = compile_step(step) if compiles(ds) else None
    times = StepTimes(peak_bytes=0, compile_s=compile_s)
    while len(times.warmup_times_s) < warmup_steps or (warmup_steps > 0 and any_rank(
            len(times.warmup_times_s) < warmup_steps + MAX_EXTRA_WARMUP and not settled(times.warmup_times_s), meter)):
        times.warmup_times_s.append(step()[0])
    if not meter.cuda:
        step()
        times.peak_bytes = meter.peak_bytes()
        meter.stop_watchdog()
        if memory.use_default_allocator():
            step()
    while len(times.step_times_s) < steps or any_rank(
            len(times.step_times_s) < steps + MAX_EXTRA_TIMED and times.spread() > STEADY_SPREAD, meter):
        step_s, optimizer_s, loss = step()
        times.step_times_s.append(step_s)
        times.optimizer_times_s.append(optimizer_s)
        times.loss = float(loss.detach().float().item())
    if meter.cuda:
        times.peak_bytes = meter.peak_bytes()
    return times


def most_steps(warmup_steps: int, steps: int) -> int:
    """The most optimizer steps :func:`run_steps` runs for ``warmup_steps`` and ``steps`` asked (the CPU's two
    untimed steps around its peak reading included): a probe that timed out ran no more than these."""
    return warmup_steps + (MAX_EXTRA_WARMUP if warmup_steps > 0 else 0) + 2 + steps + MAX_EXTRA_TIMED


def usual_steps(warmup_steps: int, steps: int) -> int:
    """The optimizer steps :func:`run_steps` usually runs for ``warmup_steps`` and ``steps`` asked: one warm-up step
    more to see it settle, the CPU's two untimed steps around its peak reading, no extra timed step."""
    return warmup_steps + (1 if warmup_steps > 0 else 0) + 2 + steps


def any_rank(wants_more: bool, meter: Meter) -> bool:
    """Whether any rank wants one more step: every rank runs the same steps (each step's collectives need them all),
    so the ranks agree (an all-reduce of the wish, its largest) where there are several."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return wants_more
    flag = torch.tensor([1.0 if wants_more else 0.0], device=meter.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def settled(warmup_times_s: list[float]) -> bool:
    """Whether the last warm-up step took within :data:`SETTLE_TOLERANCE` of the one before it (a step before it
    is needed: with none, whether the first step was a slow one is unknown)."""
    return len(warmup_times_s) >= 2 and abs(warmup_times_s[-1] - warmup_times_s[-2]) <= SETTLE_TOLERANCE * warmup_times_s[-2]


class CompileError(RuntimeError):
    """The step that compiles the model raised: ``torch.compile`` cannot run this config."""


def compile_step(step: Callable[[], tuple]) -> float:
    """Run the first step, the one that compiles (dynamo traces, inductor builds forward and backward); return its
    seconds. It counts in the probe's wall time, never in its samples/s. An error in it is a
    :class:`CompileError` naming the cause, unless it ran out of memory (that stays an out-of-memory)."""

    t0 = time.perf_counter()
    try:
        step()
    except Exception as exc:
        name, text = type(exc).__name__, str(exc).strip()
        if oom_location(name, text) is not None:
            raise
        root = root_cause(exc)
        why = f"{name} ({type(root).__name__}: {first_line(str(root))})" if root is not exc else f"{name}: {first_line(text)}"
        raise CompileError(f"torch.compile failed in the first step: {why}"[:400]) from exc
    return time.perf_counter() - t0


def root_cause(exc: BaseException) -> BaseException:
    """The innermost error under dynamo's wrappers (``BackendCompilerFailed.inner_exception``, ``__cause__``)."""
    seen = {id(exc)}
    while True:
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner
