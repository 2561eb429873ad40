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

from pathlib import Path

from autofit.probe.failure import SHELL_SIGKILL, ended_by_sigkill, oom_kill_count, oom_kill_counter

__all__ = ["SHELL_SIGKILL", "cgroup_oom_kills", "ended_by_sigkill", "memory_events_path", "oom_kills"]


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
    return oom_kill_counter(text)


def oom_kills(cgroup_root: str | Path = "/sys/fs/cgroup", self_cgroup: str | Path = "/proc/self/cgroup",
              vmstat: str | None = None) -> int | None:
    """The cgroup's and the system's OOM kills together (either rising raises the sum); None where both are unknown."""
    known = [n for n in (cgroup_oom_kills(cgroup_root, self_cgroup), oom_kill_count(vmstat)) if n is not None]
    return sum(known) if known else None

