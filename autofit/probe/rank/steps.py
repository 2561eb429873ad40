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


@dataclass
class StepTimes:
    """What the timed steps measured."""

    peak_bytes: int
    step_times_s: list[float] = field(default_factory=list)
    optimizer_times_s: list[float] = field(default_factory=list)
    loss: float = float("nan")
    compile_s: float | None = None
    """Seconds of the first warm-up step where the model is compiled (it builds the graph); None otherwise."""

    def step_time_s(self) -> float:
        """The median timed step (0.0 when none was timed)."""
        return statistics.median(self.step_times_s) if self.step_times_s else 0.0

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
    """``warmup_steps`` steps, then ``steps`` timed ones; the peak is read as docs/design.md ("Memory, measured") says.
    ``ds``: the candidate's DeepSpeed JSON (whether it compiles: the compiling step comes first).

    CPU: one more step after warm-up runs under the probe's allocator setting and the peak is
    read after it; then glibc goes back to reusing freed blocks and one more step refills its heap
    before the timed ones. CUDA: the peak is read after the timed steps.
    """

    def step() -> tuple:
        return train_step(engine, compute_loss, grad_accum_steps, meter.sync, lambda: activation_offload_context(ds))

    # the compiling step comes before the warm-up ones, which then run the compiled graph (a recompile a guard
    # triggers in the second step lands in warm-up, not in the timed steps)
    compile_s = compile_step(step) if compiles(ds) else None
    for _ in range(warmup_steps):
        step()
    peak = 0
    if not meter.cuda:
        step()
        peak = meter.peak_bytes()
        meter.stop_watchdog()
        if memory.use_default_allocator():
            step()
    times = StepTimes(peak_bytes=peak, compile_s=compile_s)
    for _ in range(steps):
        step_s, optimizer_s, loss = step()
        times.step_times_s.append(step_s)
        times.optimizer_times_s.append(optimizer_s)
        times.loss = float(loss.detach().float().item())
    if meter.cuda:
        times.peak_bytes = meter.peak_bytes()
    return times


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
