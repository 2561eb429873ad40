"""One candidate of a script-mode search: its JSON, the unmodified script for a few steps, the measurement.

The script runs with the candidate's DeepSpeed JSON plus DeepSpeed's ``autotuning`` section
(:func:`~autofit.script.command.with_metric`): the engine times the steps from ``start_profile_step``
through ``end_profile_step``, writes its metric file and exits. Memory is measured from outside
(:mod:`autofit.script.tree`). The result is a :class:`~autofit.probe.result.ProbeResult`, so
:func:`autofit.tuner.run_search` takes :func:`script_prober` where it takes the subprocess probe.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from autofit.core.boundary import OomOn, Status
from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.hardware import Hardware
from autofit.core.software import Software
from autofit.ds.emit import deepspeed_config
from autofit.probe.failure import oom_location
from autofit.probe.result import ProbeResult
from autofit.script.command import ScriptCommand, with_metric
from autofit.script.records import US, DeepSpeedMetric, read_deepspeed_file
from autofit.script.runner import ScriptRun, run_script
from autofit.tuner.driver import Prober


def script_prober(command: ScriptCommand, hardware: Hardware, world_size: int, workdir: Path,
                  warmup_steps: int = 1, software: Software | None = None) -> Prober:
    """A prober for :func:`autofit.tuner.run_search` that runs ``command`` once per candidate (``software``:
    what the machine runs, for the candidates' JSON; this one's by default)."""

    def probe(config: Config, steps: int, timeout_s: float) -> ProbeResult:
        return probe_script(command, config, hardware, world_size, workdir, steps=steps, warmup_steps=warmup_steps,
                            timeout_s=timeout_s, software=software)

    return probe


def probe_script(command: ScriptCommand, config: Config, hardware: Hardware, world_size: int, workdir: Path, *,
                 steps: int = 3, warmup_steps: int = 1, timeout_s: float = 600.0,
                 software: Software | None = None) -> ProbeResult:
    """Run ``config`` through the script for ``warmup_steps + steps`` optimizer steps and measure it."""
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=re.sub(r"[^A-Za-z0-9.]+", "-", config.label()) + "-", dir=workdir))
    metric_path = run_dir / "metric.json"
    ds = with_metric(deepspeed_config(config, world_size, hardware.kind, software), metric_path, warmup_steps, steps)
    config_path = run_dir / "ds_config.json"
    config_path.write_text(json.dumps(ds, indent=2))
    budget = hardware.memory_bytes if hardware.kind == "cpu" else None
    run = run_script(command, config_path, run_dir, world_size, hardware.kind, timeout_s, budget)
    metric, unreadable = read_metric(metric_path)
    return result_of(config, world_size, run, metric, timeout_s, unreadable)


def read_metric(path: Path) -> tuple[DeepSpeedMetric | None, str | None]:
    """DeepSpeed's metric file at ``path`` as a record, or None and why it cannot be read (None, None: no file)."""
    try:
        data = read_deepspeed_file(path, "metric")
        return (DeepSpeedMetric.from_json(data) if data is not None else None), None
    except AutofitError as exc:
        return None, str(exc)


def result_of(config: Config, world_size: int, run: ScriptRun, metric: DeepSpeedMetric | None,
              timeout_s: float, unreadable: str | None = None) -> ProbeResult:
    """The probe's result from the run and DeepSpeed's metric file (None when the script wrote none; ``unreadable``:
    why the file it wrote could not be read, which makes an ``error``)."""
    status, message, oom_on = _status(run, metric, timeout_s, unreadable)
    step_s, optimizer_s, phases = 0.0, 0.0, {}
    if status == "ok" and metric is not None:
        # the engine's timers are logged and reset at every step boundary while its flops profiler is on, so
        # the means are over the last profiled step's micro-batches; "latency" is accumulation x their sum
        a = config.grad_accum_steps
        phases = {"forward_s": a * metric.fwd * US, "backward_s": a * metric.bwd * US, "step_s": a * metric.step * US}
        step_s, optimizer_s = metric.step_time_s, phases["step_s"]
        message = f"DeepSpeed's metric: {metric.throughput:.4g} samples/s, latency {step_s:.4g} s"
    samples = config.samples_per_step(world_size) / step_s if step_s > 0 else 0.0
    return ProbeResult(
        config=config, status=status, peak_bytes=max(run.peak_bytes, default=0), step_time_s=step_s,
        samples_per_s=samples, tokens_per_s=None, message=message, overhead_s=max(0.0, run.wall_s - step_s),
        step_times_s=[step_s] if step_s else [],
        per_rank_peak_bytes=list(run.peak_bytes), phases_s=phases, world_size=world_size, wall_s=run.wall_s,
        optimizer_time_s=optimizer_s, oom_on=oom_on,
    )


def _status(run: ScriptRun, metric: DeepSpeedMetric | None, timeout_s: float,
            unreadable: str | None = None) -> tuple[Status, str | None, OomOn | None]:
    """(status, message, oom_on) of a run: over the budget, out of memory in a log, timed out, ok, or an error."""
    if run.over_budget:
        return "oom", f"resident memory passed the budget ({max(run.peak_bytes)} bytes)", "device"
    for tail in run.log_tails:
        found = oom_location("", tail)
        if found is not None:
            return "oom", found[1], found[0]
    if run.timed_out:
        return "timeout", f"the script did not finish within {timeout_s:g} s", None
    if unreadable is not None:
        return "error", unreadable[:500], None
    if metric is not None and all(code == 0 for code in run.returncodes):
        if run.unmeasured is not None:  # a peak of 0 is no measure: it would make every candidate fit
            return "error", f"the script ran but its device memory is unmeasured: {run.unmeasured}"[:500], None
        return "ok", None, None
    for rank, (code, tail) in enumerate(zip(run.returncodes, run.log_tails, strict=True)):
        if code != 0 or metric is None:
            lines = [line.strip() for line in tail.splitlines() if line.strip()]
            last = lines[-1] if lines else "no output"
            return "error", f"rank {rank} exited with code {code} and no DeepSpeed metric: {last}"[:500], None
    return "error", "no DeepSpeed metric", None
