"""Processes autofit starts end with the process that started them: a worker killed with SIGKILL (which it cannot
catch) leaves no DeepSpeed op build, no entry being loaded and no probe rank running on without it.

Linux's ``PR_SET_PDEATHSIG`` (prctl(2)) kills one process when its parent dies, not that process's children: a
build's ``ninja`` and compilers, or the subprocesses a user's entry starts, would be orphaned and run on. Nor is a
process group enough: ninja starts each compile in a process group of its own (``POSIX_SPAWN_SETPGROUP``, ninja's
``subprocess-posix.cc``), so killing the group of a build leaves its compilers running (seen here: ``cc1plus``
went on after its ``ninja`` was killed). The session is what they all keep: a process that starts others leads a
session of its own (``start_new_session=True``, ``os.setsid()``), :func:`end_session_with_parent` watches its
parent from a thread, and once the parent is gone every process of the session is killed
(:func:`kill_session`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path

#: environment variable: the pid of the autofit process that started this one (a parent may die before the child
#: asks, and then the child's parent is already another process)
PARENT_PID_ENV = "AUTOFIT_PARENT_PID"
#: how often the watching thread looks at its parent
POLL_S = 0.5


def die_with_parent(expected_parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit at once where the parent is already not
    ``expected_parent`` (it died before the request was made). A parent pid of 1 alone proves nothing: autofit
    itself is PID 1 in a container without an init process. Elsewhere than Linux: nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != expected_parent:
        os._exit(1)


def end_session_with_parent(expected_parent: int, poll_s: float = POLL_S) -> threading.Thread:
    """A daemon thread that SIGKILLs every process of this process's session, this one last, once its parent is
    no longer ``expected_parent``. Call it in a process that leads its own session: else the session is its
    parent's."""

    def watch() -> None:
        while os.getppid() == expected_parent:
            time.sleep(poll_s)
        kill_session(os.getsid(0))

    thread = threading.Thread(target=watch, name="end-with-parent", daemon=True)
    thread.start()
    return thread


def kill_session(session: int, proc: Path = Path("/proc")) -> None:
    """SIGKILL every process of ``session`` (read from ``/proc/PID/stat``), the calling process last."""
    me = os.getpid()
    for pid in [*(p for p in session_members(session, proc) if p != me), me]:
        if pid != me or os.getsid(0) == session:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue


def session_members(session: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids whose session is ``session`` (none where there is no ``/proc``)."""
    members = []
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, session, ...
        if len(fields) > 3 and fields[3] == str(session):
            members.append(int(entry.name))
    return members


def parent_from_env(default: int) -> int:
    """The parent pid :data:`PARENT_PID_ENV` names, else ``default`` (the parent seen at start)."""
    text = os.environ.get(PARENT_PID_ENV, "")
    return int(text) if text.isdigit() else default
