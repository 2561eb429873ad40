"""Memory of a running script, measured from outside its process tree.

A script-mode probe cannot meter itself (the script is the user's), so each rank's process tree is
sampled from this process every ``interval_s``:

- CPU: the rank's ``VmHWM`` (its own high-water mark, which also catches what falls between two
  samples) plus the ``VmRSS`` of everything it started (DataLoader workers, compile workers), read
  from ``/proc`` through psutil. The RSS a bare ``import torch, deepspeed`` holds is subtracted
  (:func:`import_baseline_bytes`), as docs/design.md subtracts the RSS after imports.
- CUDA: the device memory NVML reports for each process of the tree
  (``nvmlDeviceGetComputeRunningProcesses``, every device: a rank's context, its caching allocator's
  reservations, NCCL's buffers), summed.

Past ``budget_bytes`` (the CPU device's budget) ``on_exceeded`` is called, once.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from autofit.probe.launch import MMAP_THRESHOLD_BYTES
from autofit.probe.memory import read_status_bytes

#: seconds between two samples of the trees
INTERVAL_S = 0.02


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every live process under it."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid] + [child.pid for child in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def host_tree_bytes(pid: int) -> int:
    """The root's peak RSS plus its descendants' RSS now (0 once it is gone)."""
    total = 0
    for i, member in enumerate(tree_pids(pid)):
        try:
            total += read_status_bytes("VmHWM" if i == 0 else "VmRSS", member)
        except (OSError, KeyError):  # exited between the listing and the read
            continue
    return total


def nvml_tree_bytes(pids: set[int]) -> int:
    """Device memory NVML attributes to ``pids``, over every device."""
    import pynvml

    total = 0
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid in pids and proc.usedGpuMemory:
                total += int(proc.usedGpuMemory)
    return total


@functools.lru_cache(maxsize=1)
def import_baseline_bytes() -> int:
    """RSS of this interpreter after ``import torch, deepspeed`` (measured once, in a child)."""
    code = (
        "import os; os.environ.setdefault('DS_ACCELERATOR', 'cpu'); import torch, deepspeed\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:')][0])"
    )
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD_BYTES))  # as the script's ranks run
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    lines = done.stdout.strip().splitlines()
    return int(lines[-1]) * 1024 if done.returncode == 0 and lines and lines[-1].isdigit() else 0


class TreeMeter:
    """Samples the memory of each rank's tree in a thread; :attr:`peaks` holds each rank's most."""

    def __init__(self, pids: list[int], kind: str, budget_bytes: int | None, on_exceeded: Callable[[int], None],
                 baseline_bytes: int = 0, interval_s: float = INTERVAL_S) -> None:
        self.pids, self.kind, self.budget_bytes, self.on_exceeded = pids, kind, budget_bytes, on_exceeded
        self.baseline_bytes = baseline_bytes
        self.interval_s = interval_s
        self.peaks = [0] * len(pids)
        self.exceeded = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autofit-tree-meter", daemon=True)
        self._nvml: Any = None

    def __enter__(self) -> TreeMeter:
        if self.kind == "cuda":
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._nvml is not None:
            self._nvml.nvmlShutdown()

    def sample(self) -> None:
        """Read every rank's tree once; call ``on_exceeded`` the first time one passes the budget."""
        for rank, pid in enumerate(self.pids):
            if self.kind == "cuda":
                used = nvml_tree_bytes(set(tree_pids(pid)))
            else:
                used = max(0, host_tree_bytes(pid) - self.baseline_bytes)
            self.peaks[rank] = max(self.peaks[rank], used)
            if self.budget_bytes is not None and used > self.budget_bytes and not self.exceeded:
                self.exceeded = True
                self.on_exceeded(used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)
