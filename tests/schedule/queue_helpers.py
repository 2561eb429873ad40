"""Helpers of the scheduler's tests: queue a tiny search, a worker on this CPU, a prober for queueing logic."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tuner"))
from tiny import ENTRY, sgd_space  # noqa: E402

from autofit.core.config import Config  # noqa: E402
from autofit.core.recipe import Recipe  # noqa: E402
from autofit.cost_model import ModelFacts  # noqa: E402
from autofit.machine.device import get_hardware  # noqa: E402
from autofit.machine.fingerprint import detect_machine  # noqa: E402
from autofit.planning.plan import Plan  # noqa: E402
from autofit.probe.result import ProbeResult  # noqa: E402
from autofit.schedule.queue import Added  # noqa: E402
from autofit.schedule.submit import make_request, submit  # noqa: E402
from autofit.schedule.worker import Worker  # noqa: E402
from autofit.workload.entry import load_workload  # noqa: E402

MIB = 2**20

#: the stock tiny model's traces (with their kernel footprints on a CPU), by what the plan traced for: its file
#: does not change during a session, so each is made once (a trace ~0.5 s, once per test before); a copy of the
#: model in a test's folder (the changed-model tests) is traced anew
_TRACED: dict[tuple[Any, ...], ModelFacts] = {}


def queue_tiny(url: str, *, entry: str = ENTRY, micro_batches: tuple[int, ...] = (4, 8), global_batch: int = 16,
               hardware: str = "cpu", memory_mib: int | None = 1024, trials: int = 2) -> Added:
    """``autofit schedule add`` of the tiny model, fp32 SGD, through the library."""
    device = get_hardware(hardware, memory_mib * MIB if memory_mib else None)
    workload = load_workload(entry)
    space = sgd_space(list(micro_batches))
    recipe = Recipe("sgd", "fp32")
    request = make_request(entry, device, gpus=1, nodes=1, global_batch=global_batch, space=space, fixed={},
                           trials=trials, memory_bytes=memory_mib * MIB if memory_mib else None, recipe=recipe)
    key = (micro_batches, global_batch, hardware, memory_mib)
    shared = entry == ENTRY
    plan = Plan.make(entry, workload, device, space, global_batch=global_batch, recipe=recipe,
                     facts=_TRACED.get(key) if shared else None)
    if shared:
        _TRACED[key] = plan.facts
    return submit(url, plan, workload, request)


def model_prober(plan: Any, sleep_s: float = 0.0) -> Callable[[Config, int, float], ProbeResult]:
    """A prober answering with the plan's prior prediction (an oom past the device) after ``sleep_s`` seconds (a
    probe that takes time, for a worker to be stopped in the middle of): for queueing logic only."""

    def probe(config: Config, steps: int, timeout_s: float) -> ProbeResult:
        time.sleep(sleep_s)
        p = plan.predict(config)
        if p.peak_bytes > plan.hardware.memory_bytes:
            return ProbeResult(config, "oom", plan.hardware.memory_bytes, 0.0, 0.0, None, "past the budget", 0.0)
        return ProbeResult(config, "ok", p.peak_bytes, p.step_time_s, p.samples_per_s, p.tokens_per_s, None, 0.0)

    return probe


def model_worker(url: str, name: str, hardware: str = "cpu", **machine_changes: Any) -> Worker:
    """A worker on ``hardware`` answering probes with the cost model; ``machine_changes`` alter its fingerprint."""
    device = get_hardware(hardware)
    machine = replace(detect_machine(device), **machine_changes)
    return Worker(url, name, device, machine, idle_exit_s=0.0, poll_s=0.1, prober=model_prober, log=lambda text: None)
