"""Memory of a running script, measured from outside its process tree.

A script-mode probe cannot meter itself (the script is the user's), so each rank's process tree is
sampled from this process every ``interval_s``:

- CPU: the rank's ``VmHWM`` (its own high-water mark, which also catches what falls between two
  samples) plus the ``VmRSS`` of everything it started (DataLoader workers, compile workers), read
  from ``/proc`` through psutil. The RSS a bare ``import torch, deepspeed`` holds is subtracted
  (:func:`import_baseline_bytes`), as docs/design.md subtracts the RSS after imports. A build's
  toolchain (:data:`BUILD_TOOLS`: the ninja, compiler and linker processes DeepSpeed's op builder and
  inductor start the first time an op is JIT-built) is not counted, nor anything under it: it is a
  one-time build on the host, not what the training holds (a first-build ``cc1plus`` alone passes
  a tiny model's budget).
- CUDA: the device memory NVML reports for each process of the tree
  (``nvmlDeviceGetComputeRunningProcesses``, every device: a rank's context, its caching allocator's
  reservations, NCCL's buffers), summed. Where NVML lists none of the tree's pids (a container: NVML
  speaks the host's PID namespace) the rank's device's used memory (``nvmlDeviceGetMemoryInfo``) less what
  it used before the script started stands in, when no process ran on that device then (the probe has it
  alone); otherwise the rank is unmeasured, with the reason (:func:`rank_device_bytes`), and the probe is an
  ``error``: a peak of 0 would make every candidate fit.

Past ``budget_bytes`` (the CPU device's budget) ``on_exceeded`` is called, once.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from autofit.machine.nvml import open_handle, visible_device
from autofit.probe.launch import MMAP_THRESHOLD_BYTES
from autofit.probe.rank.memory import read_status_bytes

#: seconds between two samples of the trees
INTERVAL_S = 0.02


#: process names (``/proc/PID/comm``, 15 characters at most) of a build's toolchain: a JIT build's, not training memory
BUILD_TOOLS = frozenset({
    "ninja", "make", "cc", "c++", "gcc", "g++", "cc1", "cc1plus", "clang", "clang++", "ld", "ld.bfd", "ld.gold",
    "ld.lld", "as", "collect2", "lto1", "lto-wrapper", "nvcc", "cicc", "ptxas", "cudafe++", "fatbinary", "nvlink",
})


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every live process under it."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid] + [child.pid for child in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def training_tree_pids(pid: int) -> list[int]:
    """``pid`` and every live process under it but a build's toolchain and what that started (:data:`BUILD_TOOLS`)."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    members, pending = [pid], [root]
    while pending:
        try:
            children = pending.pop().children()
        except psutil.NoSuchProcess:
            continue
        for child in children:
            try:
                if child.name() in BUILD_TOOLS:
                    continue
            except psutil.NoSuchProcess:
                continue
            members.append(child.pid)
            pending.append(child)
    return members


def host_tree_bytes(pid: int) -> int:
    """The root's peak RSS plus its descendants' RSS now, a build's toolchain left out (0 once it is gone)."""
    total = 0
    for i, member in enumerate(training_tree_pids(pid)):
        try:
            total += read_status_bytes("VmHWM" if i == 0 else "VmRSS", member)
        except (OSError, KeyError):  # exited between the listing and the read
            continue
    return total


@dataclass(frozen=True)
class DeviceBaseline:
    """A rank's device before the script started: the memory used on it and the compute processes NVML listed."""

    used_bytes: int
    processes: int


def rank_device_bytes(tree_bytes: int | None, device_used_bytes: int, baseline: DeviceBaseline | None,
                      device: str) -> tuple[int | None, str | None]:
    """A rank's device memory now, ``(bytes, None)``, or ``(None, why it cannot be measured)``.

    ``tree_bytes``: what NVML lists for the rank's process tree (:func:`nvml_tree_bytes`; None: none of its
    pids listed); ``device_used_bytes``: ``nvmlDeviceGetMemoryInfo(handle).used`` of the rank's device now;
    ``baseline``: that device before the script (None: not read). The device's used memory less the baseline
    counts only where no process held the device then: another's allocations would be read as the script's.
    """
    if tree_bytes is not None:
        return tree_bytes, None
    if baseline is None:
        return None, f"NVML lists none of the script's processes on GPU {device} and its memory before the script is unknown"
    if baseline.processes > 0:
        return None, (f"NVML lists none of the script's processes on GPU {device} (a container's PID namespace?) and "
                      f"{baseline.processes} other process(es) held that GPU when it started: its memory cannot be "
                      "told apart; give the probe the GPU alone or run where NVML sees the script's pids")
    return max(0, device_used_bytes - baseline.used_bytes), None


def device_baselines(pynvml: Any, n_ranks: int, cuda_visible_devices: str | None) -> list[DeviceBaseline | None]:
    """Each rank's device (``LOCAL_RANK`` = rank, through ``CUDA_VISIBLE_DEVICES``) before the script starts."""

    baselines: list[DeviceBaseline | None] = []
    for rank in range(n_ranks):
        try:
            handle = open_handle(pynvml, None, cuda_visible_devices, rank)
            baselines.append(DeviceBaseline(int(pynvml.nvmlDeviceGetMemoryInfo(handle).used),
                                            len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))))
        except Exception:  # no such device, an NVML error: no fallback for this rank
            baselines.append(None)
    return baselines


def read_device_baselines(n_ranks: int) -> list[DeviceBaseline | None]:
    """:func:`device_baselines` of this machine now (every None without NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return [None] * n_ranks
    try:
        return device_baselines(pynvml, n_ranks, os.environ.get("CUDA_VISIBLE_DEVICES"))
    finally:
        pynvml.nvmlShutdown()


def visible_entry(rank: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of a rank's device (its index where unset), for messages."""

    try:
        return visible_device(os.environ.get("CUDA_VISIBLE_DEVICES"), rank)
    except ValueError:
        return str(rank)


def nvml_tree_bytes(pids: set[int]) -> int | None:
    """Device memory NVML attributes to ``pids``, over every device; None where it lists none of them."""
    import pynvml

    rows = [row for index in range(pynvml.nvmlDeviceGetCount())
            for row in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(index))]
    return listed_bytes(rows, pids)


def listed_bytes(rows: Iterable[Any], pids: set[int]) -> int | None:
    """Device bytes of NVML's process rows (``pid``, ``usedGpuMemory``: None where NVML cannot tell) that belong to
    ``pids``; None where no row does (not 0: "not listed" is no measure)."""
    mine = [row for row in rows if row.pid in pids]
    return sum(int(row.usedGpuMemory or 0) for row in mine) if mine else None


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
                 baseline_bytes: int = 0, interval_s: float = INTERVAL_S,
                 device_baselines: list[DeviceBaseline | None] | None = None) -> None:
        self.pids, self.kind, self.budget_bytes, self.on_exceeded = pids, kind, budget_bytes, on_exceeded
        self.baseline_bytes = baseline_bytes
        self.interval_s = interval_s
        self.peaks = [0] * len(pids)
        self.device_baselines = device_baselines or [None] * len(pids)
        self.reasons: list[str | None] = [None] * len(pids)
        """CUDA: why a rank's sample could not be measured (the last such sample)."""
        self._handles: dict[int, Any] = {}
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
                measured, reason = self._device_bytes(rank, pid)
                if measured is None:
                    self.reasons[rank] = reason
                    continue
                used = measured
            else:
                used = max(0, host_tree_bytes(pid) - self.baseline_bytes)
            self.peaks[rank] = max(self.peaks[rank], used)
            if self.budget_bytes is not None and used > self.budget_bytes and not self.exceeded:
                self.exceeded = True
                self.on_exceeded(used)

    def unmeasured(self) -> str | None:
        """CUDA: why a rank that never showed device memory has no measure (None: every rank measured)."""
        if self.kind != "cuda":
            return None
        for rank, peak in enumerate(self.peaks):
            if peak == 0:
                return self.reasons[rank] or f"NVML measured no device memory for rank {rank}"
        return None

    def _device_bytes(self, rank: int, pid: int) -> tuple[int | None, str | None]:
        tree_bytes = nvml_tree_bytes(set(tree_pids(pid)))
        baseline = self.device_baselines[rank]
        device = visible_entry(rank)
        used = 0
        if tree_bytes is None and baseline is not None:

            if rank not in self._handles:
                self._handles[rank] = open_handle(self._nvml, None, os.environ.get("CUDA_VISIBLE_DEVICES"), rank)
            used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handles[rank]).used)
        return rank_device_bytes(tree_bytes, used, baseline, device)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)
