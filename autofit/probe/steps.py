"""Step timing of one probe rank: warm-up, the peak read, then the timed optimizer steps."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autofit.probe import memory
from autofit.probe.meter import Meter


@dataclass
class StepTimes:
    """What the timed steps measured."""

    peak_bytes: int
    step_times_s: list[float] = field(default_factory=list)
    optimizer_times_s: list[float] = field(default_factory=list)
    loss: float = float("nan")

    def step_time_s(self) -> float:
        """The median timed step (0.0 when none was timed)."""
        return statistics.median(self.step_times_s) if self.step_times_s else 0.0

    def optimizer_time_s(self) -> float:
        """The median of the optimizer's own ``engine.step`` (0.0 when none was timed)."""
        return statistics.median(self.optimizer_times_s) if self.optimizer_times_s else 0.0


def train_step(engine: Any, compute_loss: Callable[[], Any], grad_accum_steps: int, sync: Callable[[], None]) -> tuple:
    """One optimizer step: (seconds in all, seconds of the optimizer's own ``engine.step``, last loss)."""
    sync()
    t0 = time.perf_counter()
    optimizer_s = 0.0
    loss = None
    for _ in range(grad_accum_steps):
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


def run_steps(engine: Any, compute_loss: Callable[[], Any], grad_accum_steps: int, meter: Meter, spec: dict) -> StepTimes:
    """``warmup_steps`` steps, then ``steps`` timed ones; the peak is read as docs/design.md ("Memory, measured") says.

    CPU: one more step after warm-up runs under the probe's allocator setting and the peak is
    read after it; then glibc goes back to reusing freed blocks and one more step refills its heap
    before the timed ones. CUDA: the peak is read after the timed steps.
    """

    def step() -> tuple:
        return train_step(engine, compute_loss, grad_accum_steps, meter.sync)

    for _ in range(spec["warmup_steps"]):
        step()
    peak = 0
    if not meter.cuda:
        step()
        peak = meter.peak_bytes()
        meter.stop_watchdog()
        if memory.use_default_allocator():
            step()
    times = StepTimes(peak_bytes=peak)
    for _ in range(spec["steps"]):
        step_s, optimizer_s, loss = step()
        times.step_times_s.append(step_s)
        times.optimizer_times_s.append(optimizer_s)
        times.loss = float(loss.detach().float().item())
    if meter.cuda:
        times.peak_bytes = meter.peak_bytes()
    return times
