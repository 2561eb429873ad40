"""Process memory on Linux, as DESIGN.md's "Memory, measured" defines it for the CPU.

The CPU is the device and the process is what holds memory on it:
``peak_bytes = VmHWM - VmRSS(after imports)``, with the high-water mark reset
(``echo 5 > /proc/self/clear_refs``) right after the imports. A
:class:`RssWatchdog` stops the process the moment its resident memory passes the
budget, so a CPU probe that would not fit says ``oom`` instead of swapping the
machine.
"""

from __future__ import annotations

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


def hwm_bytes() -> int:
    """Peak resident set size since start or the last :func:`reset_peak`, in bytes."""
    return read_status_bytes("VmHWM")


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``5`` written to ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


class RssWatchdog:
    """A daemon thread that polls VmRSS every ``interval_s`` seconds.

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
        interval_s: float = 0.002,
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
