"""Processes autofit starts end with it (issue 40): a real process tree whose top is killed with SIGKILL, as a
worker is; the session's grandchild runs in a process group of its own, as ninja's compilers do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autofit.machine.lifetime import session_members

ROOT = Path(__file__).resolve().parents[2]

#: the watched child: leads its session, starts a grandchild in a group of its own, says both pids, waits
CHILD = """
import os, subprocess, sys, time
from autofit.machine.lifetime import end_session_with_parent, parent_from_env
end_session_with_parent(parent_from_env(os.getppid()), poll_s=0.1)
grandchild = subprocess.Popen(["sleep", "1000"], process_group=0)
print(os.getpid(), grandchild.pid, flush=True)
time.sleep(1000)
"""

#: the top: starts the child in a session of its own (as load_ops does), passes its pid, relays the pids, waits
TOP = f"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], start_new_session=True, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, AUTOFIT_PARENT_PID=str(os.getpid())))
print(child.stdout.readline().strip(), flush=True)
time.sleep(1000)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_session_ends_with_its_parent_killed_by_sigkill_grandchildren_included() -> None:
    top = subprocess.Popen([sys.executable, "-c", TOP], stdout=subprocess.PIPE, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        child, grandchild = (int(word) for word in top.stdout.readline().split())  # type: ignore[union-attr]
        assert _alive(child) and _alive(grandchild)
        assert os.getpgid(grandchild) != os.getpgid(child)  # a group of its own: killing the child's group misses it
        assert set(session_members(child)) >= {child, grandchild}
        top.send_signal(signal.SIGKILL)
        top.wait()
        deadline = time.monotonic() + 10
        while (_alive(child) or _alive(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child) and not _alive(grandchild)
    finally:
        top.kill()
