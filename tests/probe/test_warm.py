"""Probes whose ranks a warm parent forks (autofit/probe/warm.py, autofit/probe/rank/zygote.py): the same measurement
as a fresh process, and the same isolation: a rank that runs out of memory, is killed, exits, hangs or leaks leaves
the next probe's peak where it was. Real probes of tiny models, real DeepSpeed on the CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.machine.device import get_hardware
from autofit.probe.rank.memory import populate, resident_file_runs
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec
from autofit.probe.warm import WarmParent
from tests.probe.test_probe import START_S, _alive, entry

CPU = get_hardware("cpu")
OPS = ("deepspeed_shm_comm", "fused_adam")
CLEAN = Config(micro_batch_size=4)


def _gone_within(pids: list[int], seconds: float) -> bool:
    """Whether every one of ``pids`` has ended (or is a zombie) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _file_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile")


def test_a_forked_child_gets_its_parents_library_pages_back() -> None:
    """fork copies no page-table entry of a file mapping: the child counts its parent's library pages again as it
    touches them, unless they are populated first."""
    import torch  # noqa: F401  (libraries worth their pages)

    runs, parent = resident_file_runs(), _file_rss_bytes()
    assert runs and sum(size for _, size in runs) == pytest.approx(parent, rel=0.1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        before = _file_rss_bytes()
        populate(runs)
        os.write(write, f"{before} {_file_rss_bytes()}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    before, after = (int(x) for x in os.read(read, 100).split())
    assert before < 0.5 * parent
    assert after == pytest.approx(parent, rel=0.05)


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmParent]:
    with WarmParent(entry("medium"), "eager", "cpu", OPS) as parent:
        yield parent


@pytest.mark.slow
def test_a_forked_probe_measures_what_a_fresh_one_does(warm: WarmParent) -> None:
    fresh = run_probe(probe_spec(entry("medium"), CLEAN, CPU, steps=2), timeout_s=START_S)
    forked = run_probe(probe_spec(entry("medium"), CLEAN, CPU, steps=2), timeout_s=START_S, warm=warm)
    assert fresh.status == forked.status == "ok", (fresh.message, forked.message)
    assert warm.failure is None and warm.ready["prepaid_bytes"] > 0
    assert forked.peak_bytes == pytest.approx(fresh.peak_bytes, rel=0.01)
    assert forked.phases_s["imports_s"] < fresh.phases_s["imports_s"]
    assert forked.phases_s["initialize_s"] < fresh.phases_s["initialize_s"]


@pytest.mark.slow
def test_two_forked_ranks_train_zero3(warm: WarmParent) -> None:
    result = run_probe(probe_spec(entry("tiny"), Config(micro_batch_size=2, zero_stage=3), CPU, world_size=2,
                                  steps=2), timeout_s=START_S, warm=warm)
    assert result.status == "ok", result.message
    assert len(result.per_rank_peak_bytes) == 2 and min(result.per_rank_peak_bytes) > 0


@pytest.mark.slow
def test_a_rank_that_fails_in_any_way_leaves_the_next_probe_as_it_was(warm: WarmParent, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOFIT_TEST_PIDFILE", str(tmp_path / "pid"))

    def clean() -> int:
        result = run_probe(probe_spec(entry("medium"), CLEAN, CPU, steps=2), timeout_s=START_S, warm=warm)
        assert result.status == "ok", result.message
        return result.peak_bytes

    first = clean()
    cases = [
        ("hog", get_hardware("cpu", memory_bytes=256 * 2**20), 60.0, {"oom"}),
        ("killed", CPU, 60.0, {"error", "oom"}),
        ("exits", CPU, 60.0, {"error"}),
        ("hangs", CPU, 15.0, {"timeout"}),
        ("leaks", CPU, 60.0, {"ok"}),
    ]
    zygote = warm.proc.pid if warm.proc else None
    for name, hardware, timeout_s, statuses in cases:
        result = run_probe(probe_spec(entry(name), Config(grad_accum_steps=4), hardware, steps=2),
                           timeout_s=timeout_s, warm=warm)
        assert result.status in statuses, (name, result.status, result.message)
        assert clean() == pytest.approx(first, rel=0.01), name
    assert warm.failure is None and warm.proc is not None and warm.proc.pid == zygote  # one warm parent throughout
    assert not _alive(int((tmp_path / "pid").read_text()))  # the hung rank was killed


SCRIPT = """
from autofit.core.config import Config
from autofit.machine.device import get_hardware
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec
from autofit.probe.warm import WarmParent

warm = WarmParent({entry!r}, "eager", "cpu", ())
run_probe(probe_spec({hang!r}, Config(), get_hardware("cpu")), timeout_s=600, warm=warm)
"""


@pytest.mark.slow
def test_no_probe_process_outlives_a_sigkilled_autofit(tmp_path: Path) -> None:
    """autofit SIGKILLed mid-probe: its warm parent and the rank it forked die with it."""
    pidfile = tmp_path / "pid"
    script = textwrap.dedent(SCRIPT).format(entry=entry("tiny"), hang=entry("hangs"))
    env = dict(os.environ, AUTOFIT_TEST_PIDFILE=str(pidfile))
    parent = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_S
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline and parent.poll() is None, "the probe never reached its step"
        time.sleep(0.2)
    rank = int(pidfile.read_text())
    zygote = int(Path(f"/proc/{rank}/stat").read_text().split(") ")[1].split()[1])  # the rank's parent
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _gone_within([rank, zygote], 10.0)
