"""The forked trace workers and the kernel footprint's process die with the autofit process that started them,
however it dies: a SIGKILL from outside (a scheduler's timeout, ``subprocess.run(timeout=...)``, the OOM killer)
leaves none running on as an orphan (issue 51; autofit/machine/lifetime.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostile_helpers import ROOT, env

#: a model deep enough to be traced cut in forked workers (autofit/trace/tracer.py, SCALE_MIN_LAYERS); its forward,
#: in a process forked from the one that imported it (autofit's: a tracer) or in the program $SLEEP_IN names (the
#: kernel footprint's, autofit/probe/footprint.py), marks its pid and sleeps: a child that would outlive autofit
ENTRY = '''\
import os, sys, time
import torch
from torch import nn
from autofit import Workload

AUTOFIT_PID = os.getpid()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if os.getpid() != AUTOFIT_PID or sys.argv[0].endswith(os.environ["SLEEP_IN"]):
            open(os.path.join(os.environ["MARKS"], str(os.getpid())), "w").close()
            time.sleep(600)
        return x + self.fc(x)


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(16))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def deep_workload():
    return Workload(model=Deep, batch=lambda n: torch.randn(n, 16), name="deep")
'''


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` now (from /proc/PID/stat's ppid)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rfind(")") + 2:].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"  # a zombie has ended; only its exit status is left


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and the parent-death signal are Linux's")
@pytest.mark.parametrize(("trace_workers", "sleep_in", "n_children"), [("2", "/nothing", 2), ("1", "footprint.py", 1)],
                         ids=["trace-workers", "kernel-footprint"])
def test_no_child_outlives_a_sigkilled_autofit(tmp_path: Path, trace_workers: str, sleep_in: str,
                                               n_children: int) -> None:
    (tmp_path / "deep.py").write_text(ENTRY)
    marks = tmp_path / "marks"
    marks.mkdir()
    args = [sys.executable, "-m", "autofit", "estimate", f"{tmp_path / 'deep.py'}:deep_workload", "--hardware", "cpu",
            "--memory", "1GiB", "--global-batch", "8", "--set", "zero_stage=0", "--set", "precision=fp32",
            "--set", "compile=off", "--optimizer", "sgd"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env(AUTOFIT_TRACE_WORKERS=trace_workers, MARKS=str(marks), SLEEP_IN=sleep_in),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(marks.iterdir())) < n_children and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        tracers = {int(p.name) for p in marks.iterdir()}
        assert len(tracers) == n_children, proc.stderr.read()[-2000:] if proc.poll() is not None else "none started"
        family = _children(proc.pid)
        assert tracers <= family
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in family) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in family if _alive(pid)] == []
    finally:
        for pid in [proc.pid, *(int(p.name) for p in marks.iterdir())]:
            try:
                os.kill(pid, signal.SIGKILL)  # ours: the autofit process and the tracers it forked
            except OSError:
                pass
        proc.wait(timeout=10)
