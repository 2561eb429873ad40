"""Start the ranks of a user's script with one DeepSpeed JSON, wait with a deadline, measure from outside.

Each rank is the user's command in its own session (so a timeout or a budget overrun kills all it
started), with the rendezvous variables a launcher sets (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``: :func:`autofit.probe.launch.rank_env`, the probe's own). The script
ends itself: DeepSpeed's autotuning section makes the engine exit after the profiled steps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autofit.core.errors import AutofitError
from autofit.probe.launch import free_port, kill_group, rank_env, wait_for_ranks
from autofit.script.command import ScriptCommand
from autofit.script.tree import TreeMeter, import_baseline_bytes, read_device_baselines

#: characters of each rank's log kept for messages
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class ScriptRun:
    """What one run of the script left: exit codes, log tails, each rank's peak memory, and why it ended."""

    returncodes: list[int | None]
    """Each rank's exit status (None: still running when killed)."""
    log_tails: list[str]
    """The end of each rank's stdout and stderr."""
    peak_bytes: list[int]
    """Each rank's peak, measured from outside (:class:`~autofit.script.tree.TreeMeter`)."""
    timed_out: bool
    """The deadline passed before every rank exited."""
    over_budget: bool
    """A rank passed the CPU budget and the run was stopped."""
    wall_s: float
    """Seconds from the first start to the last exit."""
    unmeasured: str | None = None
    """CUDA: why a rank's device memory could not be measured (:meth:`TreeMeter.unmeasured`); None: measured."""


def run_script(command: ScriptCommand, config_path: Path, workdir: Path, world_size: int, kind: str,
               timeout_s: float, budget_bytes: int | None) -> ScriptRun:
    """Run ``world_size`` ranks of ``command`` with the JSON at ``config_path``, in the current directory."""
    port = free_port()
    baseline = import_baseline_bytes() if kind == "cpu" else 0
    devices = read_device_baselines(world_size) if kind == "cuda" else None  # before any rank holds a GPU
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    started = time.monotonic()
    try:
        for rank in range(world_size):
            log = open(workdir / f"script-rank{rank}.log", "wb")
            logs.append(log)
            procs.append(_start(command.argv(config_path), rank_env(dict(os.environ), rank, world_size, port, kind), log))
        meter = TreeMeter([p.pid for p in procs], kind, budget_bytes, lambda used: _kill_all(procs), baseline,
                          device_baselines=devices)
        with meter:
            timed_out = wait_for_ranks(procs, time.monotonic() + timeout_s, lambda rank, code: code not in (None, 0))
    finally:
        for proc in procs:
            kill_group(proc)
        for log in logs:
            log.close()
    return ScriptRun(
        returncodes=[p.returncode for p in procs],
        log_tails=[_tail(workdir / f"script-rank{rank}.log") for rank in range(len(procs))],
        peak_bytes=list(meter.peaks),
        timed_out=timed_out,
        over_budget=meter.exceeded,
        wall_s=time.monotonic() - started,
        unmeasured=meter.unmeasured(),
    )


def _start(argv: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    except OSError as exc:  # no such program, not executable
        raise AutofitError(f"--script cannot start {argv[0]!r}: {exc.strerror or exc}") from None


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _tail(path: Path) -> str:
    try:
        return path.read_bytes()[-LOG_TAIL_CHARS:].decode("utf-8", "replace")
    except OSError:
        return ""
