"""Run one candidate for a few real (or fake) training steps, out of process, and measure it.

:func:`run_probe` starts ``world_size`` subprocess ranks of
:mod:`autofit.probe.rank.worker`, each of which builds the workload's model, applies
the candidate (:mod:`autofit.ds.apply`), calls ``deepspeed.initialize`` with the
candidate's own JSON (:func:`autofit.ds.emit.deepspeed_config`) and times warm-up and
measured steps. Memory is measured as docs/design.md ("Memory, measured") defines it. ``mode="fake"`` runs
the model under ``FakeTensorMode`` at full size instead and reports the peak a
real device would see (:mod:`autofit.probe.rank.fake`), without time.

This module imports no torch: the ranks do.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from autofit.core.boundary import OomOn, Status
from autofit.core.config import Config
from autofit.machine.nvml import visible_cuda_devices
from autofit.probe.elastic import check_devices, launch_agents, node_launch
from autofit.probe.failure import classify_log_tail
from autofit.probe.launch import RankOutcome, launch
from autofit.probe.ops import clear_stale_locks
from autofit.probe.records import ProbeSpec, RankResult
from autofit.probe.result import _STATUS_RANK, ProbeResult
from autofit.probe.warm import WarmParent
from autofit.workload.entry import check_loadable

__all__ = ["ProbeSpec", "run_probe"]


def run_probe(spec: ProbeSpec, *, timeout_s: float = 300.0, hosts: tuple[str, ...] = (),
              warm: WarmParent | None = None) -> ProbeResult:
    """Run ``spec`` (built by :func:`autofit.probe.spec.probe_spec` or :meth:`autofit.planning.plan.Plan.probe_spec`):
    its config of its workload on its ``world_size`` ranks of its hardware, and measure it.

    ``spec.hardware.kind`` picks the backend: ``cpu`` (gloo on loopback, ``DS_ACCELERATOR=cpu``,
    a memory watchdog at ``hardware.memory_bytes`` per rank) or ``cuda`` (NCCL, one GPU
    per rank). ``timeout_s`` bounds the whole probe, start-up included (the first
    DeepSpeed start on a machine JIT-builds an op: allow ~2 minutes for it).
    More ranks than ``hardware.devices_per_node`` span nodes, one agent each (:mod:`autofit.probe.elastic`): on
    ``hosts`` (``--hosts``), else on the Slurm allocation, else simulated here (on CUDA each with its own GPUs);
    where none can run them, an :class:`AutofitError` line before anything starts (:mod:`autofit.probe.nodes`).
    ``warm``: the search's warm parent (:mod:`autofit.probe.warm`), which forks the ranks of a real probe on one
    node instead of starting each from nothing; the probe and its isolation are the same.
    Never raises for what happens inside the probe: that is the result's ``status``.
    """
    check_loadable(spec.entry, "a probe")
    hardware, world_size, mode = spec.hardware, spec.world_size, spec.mode
    ranks_per_node, n_nodes = hardware.ranks_on_a_node(world_size), hardware.n_nodes(world_size)
    nodes = node_launch(hardware.kind, n_nodes, ranks_per_node, hosts) if mode == "real" and n_nodes > 1 else None
    if mode == "real" and nodes is None:
        check_devices(hardware.kind, ranks_per_node, visible_cuda_devices() if hardware.kind == "cuda" else None)
        clear_stale_locks()  # before every probe: one killed at its timeout mid-build leaves a lock for the next
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autofit-probe-") as tmp:
        if nodes is not None:  # one elastic agent per node (probe/elastic.py)
            outcomes, timed_out = launch_agents(spec, Path(tmp), nodes, world_size, timeout_s)
        else:  # fake mode simulates every rank in one process
            outcomes, timed_out = launch(spec, Path(tmp), 1 if mode == "fake" else world_size, timeout_s,
                                         warm=warm if mode == "real" else None)
    return _combine(spec.config, outcomes, timed_out, world_size, mode, timeout_s, time.monotonic() - t0,
                    launcher="direct" if nodes is None else "torch.distributed.run")


def _combine(
    config: Config, outcomes: list[RankOutcome], timed_out: bool, world_size: int, mode: str, timeout_s: float,
    wall_s: float, launcher: str = "direct"
) -> ProbeResult:
    """One result from the ranks' own: the worst status, the largest peak, the slowest rank's step. A rank that
    wrote none but logged an out-of-memory line (DeepSpeed's failed mlock) is that ``oom``."""
    for outcome in outcomes:
        verdict = classify_log_tail(outcome.log_tail) if outcome.result is None and not outcome.killed_by_us else None
        if verdict is not None:
            outcome.result = RankResult(rank=outcome.rank, **verdict)
    results = [o.result for o in outcomes]
    statuses = [_rank_status(r, timed_out) for r in results]
    status = max(statuses, key=_STATUS_RANK.__getitem__)
    first = results[0]
    per_rank = [r.peak_bytes if r else 0 for r in results]
    if mode == "fake" and first:
        per_rank = list(first.per_rank_peak_bytes)
    # the slowest rank sets the pace of a data-parallel step
    ran = [r for r in results if r] if status == "ok" else []
    slowest = max(ran, key=lambda r: r.step_time_s, default=None)
    step_time = slowest.step_time_s if slowest else 0.0
    optimizer_time = max((r.optimizer_time_s for r in ran), default=0.0)
    samples = config.samples_per_step(world_size) / step_time if step_time > 0 else 0.0
    tokens_per_sample = next((r.tokens_per_sample for r in results if r and r.tokens_per_sample), None)
    phases = dict(first.phases_s) if first else {}
    return ProbeResult(
        config=config,
        status=status,
        peak_bytes=max(per_rank, default=0),
        step_time_s=step_time,
        optimizer_time_s=optimizer_time,
        step_times_s=list(slowest.step_times_s) if slowest else [],
        warmup_times_s=list(slowest.warmup_times_s) if slowest else [],
        samples_per_s=samples,
        tokens_per_s=samples * tokens_per_sample if tokens_per_sample and samples else None,
        message=_message(outcomes, statuses, status, timeout_s),
        overhead_s=sum(v for k, v in phases.items() if k != "steps_s"),
        per_rank_peak_bytes=per_rank,
        per_rank_build_bytes=[r.build_peak_bytes if r else 0 for r in results],
        per_rank_initialize_bytes=[r.initialize_peak_bytes if r else 0 for r in results],
        per_rank_param_elements=[r.param_elements if r else 0 for r in results],
        optimizer_state_bytes=first.optimizer_state_bytes if first else 0,
        launcher=launcher,
        phases_s=phases,
        breakdown=dict(first.breakdown) if first else {},
        world_size=world_size,
        mode=mode,
        wall_s=wall_s,
        oom_on=_oom_on(results, statuses) if status == "oom" else None,
        device_memory=dict(first.device_memory) if first else {},
    )


def _oom_on(results: list[RankResult | None], statuses: list[Status]) -> OomOn:
    """Where the first rank that ran out of memory ran out; a rank's own budget watchdog means the device."""
    for result, rank_status in zip(results, statuses, strict=True):
        if rank_status == "oom" and result:
            return result.oom_on or "device"
    return "device"


def _rank_status(result: RankResult | None, timed_out: bool) -> Status:
    """A rank's own status; one that wrote nothing timed out (the deadline passed) or failed."""
    if result is not None:
        return result.status
    return "timeout" if timed_out else "error"


def _message(outcomes: list[RankOutcome], statuses: list[Status], status: Status, timeout_s: float) -> str | None:
    """One line: the first failing rank's own message, else the last line of its log."""
    if status == "ok":
        first = outcomes[0].result
        return first.message if first and first.message else None
    if status == "timeout":
        return f"probe did not finish within {timeout_s:g} s"
    for outcome, rank_status in zip(outcomes, statuses, strict=True):
        if rank_status != status:
            continue
        if outcome.result and outcome.result.message:
            return outcome.result.message
        lines = [line for line in outcome.log_tail.splitlines() if line.strip()]
        code = outcome.returncode
        last = lines[-1].strip() if lines else "no output"
        return f"rank {outcome.rank} exited with code {code}: {last}"[:500]
    return None



