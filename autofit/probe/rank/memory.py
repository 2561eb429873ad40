"""Process memory on Linux, as docs/design.md's "Memory, measured" defines it for the CPU.

The CPU is the device and the process is what holds memory on it:
``peak_bytes = VmHWM - VmRSS(after imports)``, with the high-water mark reset
(``echo 5 > /proc/self/clear_refs``) right after the imports. A
:class:`RssWatchdog` stops the process the moment its resident memory passes the
budget, so a CPU probe that would not fit says ``oom`` instead of swapping the
machine.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable

KIB = 1024


def read_status_bytes(field: str, pid: int | str = "self") -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KIB
    raise KeyError(f"{field} not in /proc/{pid}/status")


def rss_bytes() -> int:
    """Resident set size of this process now, in bytes."""
    return read_status_bytes("VmRSS")


def _glibc() -> ctypes.CDLL | None:
    """This process's C library, where it is glibc (None elsewhere: no ``mallopt``, no ``malloc_trim``)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def settled_rss_bytes() -> int:
    """Resident set size once glibc has handed its free heap pages back (``malloc_trim(0)``), in bytes: what stays
    resident for good (code, caches, live objects), without the holes freed small blocks left in the heap, which
    the next allocations fill (the RSS where glibc is not this process's C library)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
    return rss_bytes()


def hwm_bytes() -> int:
    """Peak resident set size since start or the last :func:`reset_peak`, in bytes."""
    return read_status_bytes("VmHWM")


#: glibc ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: glibc's ceiling for its dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20


def use_default_allocator() -> bool:
    """Let glibc keep freed blocks for reuse again, as a training process does without the probe's setting.

    The probe starts with ``MALLOC_MMAP_THRESHOLD_=4096`` so that RSS tracks live tensors (docs/design.md, "Memory,
    measured"); that maps and unmaps every tensor of a page or more, and the page faults that follow (measured at
    64 KiB) nearly doubled a CPU step (ViT, 82 -> 150 ms) and made it noisy. Once the peak is read, this sets what
    glibc's dynamic threshold settles at in a long run (blocks up to 32 MiB from the heap, trimmed past twice that),
    so the timed steps run at the speed the user will see. False where glibc's ``mallopt`` is not available.
    """
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX) == 1
    return ok and libc.mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_MMAP_THRESHOLD_MAX) == 1


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``5`` written to ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


#: madvise(2) advice that faults a range's pages into the page table, reading them (Linux >= 5.14)
_MADV_POPULATE_READ = 22
#: ``/proc/PID/pagemap``: one 64-bit entry a virtual page, bit 63 set where the page is present
_PAGEMAP_PRESENT = 1 << 63


def resident_file_runs(maps: str = "/proc/self/maps", pagemap: str = "/proc/self/pagemap") -> list[tuple[int, int]]:
    """``(address, bytes)`` runs of this process's readable file-backed pages (shared libraries, mapped files) that
    are in its page table now.

    ``fork`` copies no page-table entry of a file mapping that holds no private page (mm/memory.c,
    ``vma_needs_copy``): a forked child's RSS starts without the libraries' pages its parent had resident and counts
    each as the child touches it again, where a process that imported those libraries itself counts them from the
    start (docs/results/probe.md). :func:`populate` gives a forked child the same page table back."""
    page = os.sysconf("SC_PAGE_SIZE")
    runs: list[tuple[int, int]] = []
    with open(maps) as lines, open(pagemap, "rb") as table:
        for line in lines:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/") or not fields[1].startswith("r"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            table.seek(start // page * 8)
            entries = table.read((end - start) // page * 8)
            runs.extend(_present_runs(entries, start, page))
    return runs


def _present_runs(entries: bytes, start: int, page: int) -> list[tuple[int, int]]:
    """The runs of present pages among pagemap ``entries`` of the mapping at ``start``."""
    runs: list[tuple[int, int]] = []
    run_start = None
    for i, entry in enumerate(memoryview(entries).cast("Q")):
        if entry & _PAGEMAP_PRESENT:
            if run_start is None:
                run_start = i
        elif run_start is not None:
            runs.append((start + run_start * page, (i - run_start) * page))
            run_start = None
    if run_start is not None:
        runs.append((start + run_start * page, (len(entries) // 8 - run_start) * page))
    return runs


def populate(runs: list[tuple[int, int]]) -> int:
    """Fault ``runs`` (:func:`resident_file_runs`) into this process's page table (``MADV_POPULATE_READ``); returns
    the bytes of the runs it could populate (a run unmapped since is skipped; 0 without glibc or before Linux
    5.14)."""
    libc = _glibc()
    if libc is None:
        return 0
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return sum(size for address, size in runs if madvise(address, size, _MADV_POPULATE_READ) == 0)


class RssWatchdog:
    """A daemon thread that polls VmRSS every ``interval_s`` seconds.

    20 ms by default: VmHWM still catches a peak between two polls, and polling every 2 ms
    took enough of a 2-core machine from the training threads to slow and scatter its steps.

    It keeps the highest RSS it saw (a second opinion next to VmHWM) and, once
    ``RSS - baseline_bytes`` passes ``budget_bytes``, calls ``on_exceeded(used_bytes)``
    once from the thread (the probe writes its ``oom`` result there and exits the
    process). Polling, not ``RLIMIT_AS``: the address space of a process with
    torch loaded is far larger than what it touches.
    """

    def __init__(
        self,
        baseline_bytes: int,
        budget_bytes: int | None,
        on_exceeded: Callable[[int], None],
        interval_s: float = 0.02,
    ) -> None:
        self.baseline_bytes = baseline_bytes
        self.budget_bytes = budget_bytes
        self.on_exceeded = on_exceeded
        self.interval_s = interval_s
        self.max_rss_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autofit-rss-watchdog", daemon=True)
        # open once: re-reading an open /proc file is a cheap pread, opening it is not
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def start(self) -> RssWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def poll(self) -> int:
        """One reading of RSS in bytes (``/proc/self/statm``, field 2, pages)."""
        rss = int(os.pread(self._fd, 256, 0).split()[1]) * self._page
        self.max_rss_bytes = max(self.max_rss_bytes, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self.poll() - self.baseline_bytes
            if self.budget_bytes is not None and used > self.budget_bytes:
                self.on_exceeded(used)
                return
            time.sleep(self.interval_s)
