"""Ranks the kernel's OOM killer ended: a real child ended by SIGKILL (-9 directly, 137 through a shell), read by
:func:`autofit.probe.failure.classify_exit` against a cgroup's counter."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from autofit.probe.failure import classify_exit, ended_by_sigkill
from autofit.probe.oom_killer import cgroup_oom_kills, memory_events_path, oom_kills

MEMORY_EVENTS = "low 0\nhigh 0\nmax {max}\noom {oom}\noom_kill {kills}\noom_group_kill 0\n"


def _cgroup_v2(tmp_path: Path, kills: int) -> tuple[Path, Path]:
    """A cgroup v2 tree as /sys/fs/cgroup lays it out, and the /proc/self/cgroup that points into it."""
    group = tmp_path / "root" / "system.slice" / "job-42.scope"
    group.mkdir(parents=True, exist_ok=True)
    (group / "memory.events").write_text(MEMORY_EVENTS.format(max=kills * 7, oom=kills, kills=kills))
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text("0::/system.slice/job-42.scope\n")
    return tmp_path / "root", self_cgroup


def _killed_child(through_shell: bool) -> subprocess.Popen[bytes]:
    """A real process ended by SIGKILL: directly (returncode -9) or under a shell that reports it (137)."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    if through_shell:
        proc = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'"])
    else:
        proc = subprocess.Popen(sleeper)
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=20)
    return proc


def test_a_sigkilled_rank_with_the_cgroup_counter_risen_is_a_host_oom(tmp_path: Path) -> None:
    root, self_cgroup = _cgroup_v2(tmp_path, kills=2)
    before = cgroup_oom_kills(root, self_cgroup)
    for through_shell in (False, True):
        child = _killed_child(through_shell)
        assert child.returncode == (137 if through_shell else -9) and ended_by_sigkill(child.returncode)
        _cgroup_v2(tmp_path, kills=3)  # the kernel's OOM killer counts the kill in the job's cgroup
        after = cgroup_oom_kills(root, self_cgroup)
        assert (before, after) == (2, 3)
        verdict = classify_exit(child.returncode, child.pid, killed_by_us=False, kernel_log="",
                                oom_kills_before=before, oom_kills_after=after)
        assert verdict is not None and verdict["status"] == "oom" and verdict["oom_on"] == "host"
        assert str(child.pid) in verdict["message"]
        # no rise: a kill -9 from someone else, not the OOM killer; sent by autofit: never an OOM
        assert classify_exit(child.returncode, child.pid, killed_by_us=False, kernel_log="", oom_kills_before=3,
                             oom_kills_after=3) is None
        assert classify_exit(child.returncode, child.pid, killed_by_us=True, kernel_log="", oom_kills_before=2,
                             oom_kills_after=3) is None
        _cgroup_v2(tmp_path, kills=2)


def test_an_exit_code_that_is_not_sigkill_is_never_an_oom_kill() -> None:
    done = subprocess.run([sys.executable, "-c", "raise SystemExit(1)"], check=False)
    assert not ended_by_sigkill(done.returncode)
    assert classify_exit(done.returncode, 1, killed_by_us=False, kernel_log="", oom_kills_before=0, oom_kills_after=5) is None


def test_cgroup_v1_and_a_container_that_sees_its_cgroup_as_root(tmp_path: Path) -> None:
    v1 = tmp_path / "v1" / "memory" / "slurm" / "uid_1" / "job_7"
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    self_v1 = tmp_path / "self_v1"
    self_v1.write_text("12:pids:/slurm/uid_1/job_7\n5:memory:/slurm/uid_1/job_7\n")
    assert cgroup_oom_kills(tmp_path / "v1", self_v1) == 4
    # a container: /proc/self/cgroup names the host's path, the namespace mounts the group at the root
    container = tmp_path / "container"
    container.mkdir()
    (container / "memory.events").write_text(MEMORY_EVENTS.format(max=0, oom=1, kills=1))
    self_c = tmp_path / "self_c"
    self_c.write_text("0::/kubepods/burstable/pod1/abc\n")
    assert memory_events_path(self_c.read_text(), container) == container / "memory.events"
    assert cgroup_oom_kills(container, self_c) == 1
    # no memory cgroup at all: unknown, not 0; the system's counter still adds up
    assert cgroup_oom_kills(tmp_path / "nothing", self_c) is None
    assert oom_kills(tmp_path / "nothing", self_c, vmstat="oom_kill 6\n") == 6
    assert oom_kills(container, self_c, vmstat="oom_kill 6\n") == 7
    assert oom_kills(tmp_path / "nothing", self_c, vmstat="pgfault 1\n") is None
