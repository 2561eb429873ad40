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
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.core.boundary import OomOn, Status
from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.hardware import Hardware
from autofit.core.software import Software
from autofit.machine.nvml import visible_cuda_devices
from autofit.probe.result import _STATUS_RANK, MODES, ProbeResult

if TYPE_CHECKING:
    from autofit.probe.launch import RankOutcome
    from autofit.probe.records import RankResult


def run_probe(
    entry: str,
    config: Config,
    hardware: Hardware,
    world_size: int = 1,
    *,
    mode: str = "real",
    steps: int = 3,
    warmup_steps: int = 1,
    timeout_s: float = 300.0,
    memory_snapshot: str | None = None,
    software: Software | None = None,
    hosts: tuple[str, ...] = (),
    hidden_size: int = 0,
    largest_param_numel: int = 0,
) -> ProbeResult:
    """Run ``config`` of the workload at ``entry`` on ``world_size`` ranks of ``hardware`` and measure it.

    ``hardware.kind`` picks the backend: ``cpu`` (gloo on loopback, ``DS_ACCELERATOR=cpu``,
    a memory watchdog at ``hardware.memory_bytes`` per rank) or ``cuda`` (NCCL, one GPU
    per rank). ``timeout_s`` bounds the whole probe, start-up included (the first
    DeepSpeed start on a machine JIT-builds an op: allow ~2 minutes for it).
    ``memory_snapshot``: on CUDA, rank 0 records the allocator's history from the model build through the
    steps and writes it to this path (:mod:`autofit.probe.snapshot`); ignored on the CPU.
    More ranks than ``hardware.devices_per_node`` span nodes, one agent each (:mod:`autofit.probe.elastic`): on
    ``hosts`` (``--hosts``), else on the Slurm allocation, else simulated here (on CUDA each with its own GPUs);
    where none can run them, an :class:`AutofitError` line before anything starts (:mod:`autofit.probe.nodes`).
    ``hidden_size``: the model's (:attr:`autofit.cost_model.facts.ModelFacts.hidden_size`), which the JSON's ZeRO
    bucket sizes are derived from (:mod:`autofit.ds.buckets`), as the cost model priced them;
    ``largest_param_numel``: its largest parameter, which sizes NVMe parameter offload's swap buffers
    (:func:`autofit.ds.emit.with_param_swap_buffers`; 0: DeepSpeed's default, which a 7B's embedding overflows).
    Never raises for what happens inside the probe: that is the result's ``status``.
    """
    from autofit.probe.elastic import check_devices, launch_agents, node_launch
    from autofit.probe.launch import launch
    from autofit.workload.entry import check_loadable

    check_loadable(entry, "a probe")
    if mode not in MODES:
        raise AutofitError(f"probe mode must be real or fake, but got {mode!r}")
    if world_size < 1:
        raise AutofitError(f"world_size must be >= 1, but got {world_size!r}")
    if steps < 1 or warmup_steps < 0:
        raise AutofitError(f"probe needs steps >= 1 and warmup_steps >= 0, but got {steps=}, {warmup_steps=}")
    spec = _spec(entry, config, hardware, world_size, mode, steps, warmup_steps, software, hidden_size,
                 largest_param_numel)
    if memory_snapshot is not None:
        spec["memory_snapshot"] = str(Path(memory_snapshot).resolve())
    ranks_per_node, n_nodes = hardware.ranks_on_a_node(world_size), hardware.n_nodes(world_size)
    nodes = node_launch(hardware.kind, n_nodes, ranks_per_node, hosts) if mode == "real" and n_nodes > 1 else None
    if mode == "real" and nodes is None:
        check_devices(hardware.kind, ranks_per_node, visible_cuda_devices() if hardware.kind == "cuda" else None)
        from autofit.probe.ops import clear_stale_locks

        clear_stale_locks()  # before every probe: one killed at its timeout mid-build leaves a lock for the next
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autofit-probe-") as tmp:
        if nodes is not None:  # one elastic agent per node (probe/elastic.py)
            outcomes, timed_out = launch_agents(spec, Path(tmp), nodes, world_size, timeout_s)
        else:  # fake mode simulates every rank in one process
            outcomes, timed_out = launch(spec, Path(tmp), 1 if mode == "fake" else world_size, timeout_s)
    return _combine(config, outcomes, timed_out, world_size, mode, timeout_s, time.monotonic() - t0,
                    launcher="direct" if nodes is None else "torch.distributed.run")


def _spec(
    entry: str, config: Config, hardware: Hardware, world_size: int, mode: str, steps: int, warmup_steps: int,
    software: Software | None = None, hidden_size: int = 0, largest_param_numel: int = 0,
) -> dict[str, Any]:
    """What the worker reads: the workload, the config and its DeepSpeed JSON, the steps and the device."""
    from autofit.cost_model.cuda_runtime import nccl_buffer_bytes
    from autofit.ds.emit import deepspeed_config

    return {
        "entry": entry,
        "config": config.to_dict(),
        "deepspeed": deepspeed_config(config, world_size, hardware.kind, software, hidden_size=hidden_size,
                                      largest_param_numel=largest_param_numel or None),
        "world_size": world_size,
        "mode": mode,
        "steps": steps,
        "warmup_steps": warmup_steps,
        "kind": hardware.kind,
        "budget_bytes": hardware.memory_bytes if hardware.kind == "cpu" and mode == "real" else None,
        "memory_bytes": hardware.memory_bytes,
        "context_bytes": hardware.context_bytes,
        # what NCCL will hold outside the allocator once it connects: --memory's cap leaves room for it
        "nccl_bytes": nccl_buffer_bytes(world_size) if hardware.kind == "cuda" else 0,
        "hardware": {k: v for k, v in asdict(hardware).items()},
    }


def _combine(
    config: Config, outcomes: list[RankOutcome], timed_out: bool, world_size: int, mode: str, timeout_s: float,
    wall_s: float, launcher: str = "direct"
) -> ProbeResult:
    """One result from the ranks' own: the worst status, the largest peak, the slowest rank's step. A rank that
    wrote none but logged an out-of-memory line (DeepSpeed's failed mlock) is that ``oom``."""
    from autofit.probe.failure import classify_log_tail
    from autofit.probe.records import RankResult

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



