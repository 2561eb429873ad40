"""Ranks the kernel's OOM killer ended: the exit status they leave and the counters that rise.

A rank the OOM killer takes dies by SIGKILL without writing a result: ``returncode -9`` where this process
or an elastic agent waited on it, ``137`` (128 + 9) where a shell, ``srun`` or ``ssh`` stood between. Whether
it was the OOM killer (and not a user's ``kill -9``) is read, on the node where the rank ran, from:

* the kernel log naming its pid (:func:`autofit.probe.failure.oom_killed_pids`);
* else a rise, while the probe ran, of an ``oom_kill`` counter: the memory cgroup's (cgroup v2
  ``memory.events``, hierarchical, the count a container's limit raises; cgroup v1
  ``memory.oom_control``; Documentation/admin-guide/cgroup-v2.rst) and the system's (``/proc/vmstat``).
  Inside a container the kernel log is rarely readable and the cgroup's counter is the one that tells.
"""

from __future__ import annotations

import signal
from pathlib import Path

from autofit.probe.failure import Failure, classify_exit, oom_kill_count

#: the exit status a shell or launcher reports for a child ended by SIGKILL (128 + signal number)
SHELL_SIGKILL = 128 + int(signal.SIGKILL)


def ended_by_sigkill(returncode: int | None) -> bool:
    """Whether an exit status says SIGKILL: ``-9`` (Popen, torch's elastic agent) or ``137`` (through a shell)."""
    return returncode in (-signal.SIGKILL, SHELL_SIGKILL)


def memory_events_path(self_cgroup: str, cgroup_root: Path) -> Path | None:
    """The file holding this process's memory cgroup ``oom_kill`` count, from ``/proc/self/cgroup`` text.

    cgroup v2 (a ``0::/path`` line): ``<root>/<path>/memory.events``; v1 (a ``N:...memory...:/path`` line):
    ``<root>/memory/<path>/memory.oom_control``. A path not mounted where it says (a container sees its own
    cgroup as ``/`` or as the host's path) falls back to the root's own file. None where neither exists.
    """
    for line in self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.strip().lstrip("/")
        if hierarchy == "0" and controllers == "":
            candidates = [cgroup_root / relative / "memory.events", cgroup_root / "memory.events"]
        elif "memory" in controllers.split(","):
            candidates = [cgroup_root / "memory" / relative / "memory.oom_control", cgroup_root / "memory" / "memory.oom_control"]
        else:
            continue
        for candidate in candidates:
            if candidate.is_file():
                return candidate
    return None


def cgroup_oom_kills(cgroup_root: str | Path = "/sys/fs/cgroup", self_cgroup: str | Path = "/proc/self/cgroup") -> int | None:
    """This process's memory cgroup's ``oom_kill`` count (its descendants included); None where unknown."""
    try:
        path = memory_events_path(Path(self_cgroup).read_text(), Path(cgroup_root))
        text = path.read_text() if path is not None else ""
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def oom_kills(cgroup_root: str | Path = "/sys/fs/cgroup", self_cgroup: str | Path = "/proc/self/cgroup",
              vmstat: str | None = None) -> int | None:
    """The cgroup's and the system's OOM kills together (either rising raises the sum); None where both are unknown."""
    known = [n for n in (cgroup_oom_kills(cgroup_root, self_cgroup), oom_kill_count(vmstat)) if n is not None]
    return sum(known) if known else None


def host_oom(returncode: int | None, pid: int, *, killed_by_us: bool, kernel_log: str, oom_kills_before: int | None,
             oom_kills_after: int | None) -> Failure | None:
    """``oom`` on the host for a rank the OOM killer ended (:func:`autofit.probe.failure.classify_exit`, a ``137``
    read as the SIGKILL it is), else None."""
    code = -signal.SIGKILL if ended_by_sigkill(returncode) else returncode
    return classify_exit(code, pid, killed_by_us=killed_by_us, kernel_log=kernel_log,
                         oom_kills_before=oom_kills_before, oom_kills_after=oom_kills_after)
