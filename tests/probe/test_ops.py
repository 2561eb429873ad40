"""DeepSpeed ops before the first probe: which ones a space needs, stale build locks, loading them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.core.software import Software, ops_needed
from autofit.probe.ops import busy_build_dirs, clear_stale_locks, prepare_ops, stale_locks
from autofit.probe.spec import probe_spec

NO_NVCC = Software(cuda_toolkit=False)


def test_ops_the_candidates_need():
    assert ops_needed([("adamw", "none", "none"), ("lion", "none", "none"), ("sgd", "none", "none")], "cpu", Software()) == (
        "deepspeed_shm_comm", "fused_adam",
    )  # the CPU runs Lion as a client optimizer; DeepSpeed's CPU comm builds its shared-memory op
    assert ops_needed([("lion", "none", "none"), ("adamw", "cpu", "none")], "cuda", Software()) == ("cpu_adam", "fused_lion")
    assert ops_needed([("adamw", "none", "none")], "cuda", NO_NVCC) == ()  # torch_adam: nothing to build
    assert ops_needed([("sgd", "none", "nvme")], "cuda", Software()) == ("async_io",)


def _killed_build(root: Path, op: str) -> Path:
    """What a build killed mid-way leaves: torch's FileBaton lock, acquired and never released."""
    from torch.utils.file_baton import FileBaton

    build = root / "py311_cpu" / op
    build.mkdir(parents=True)
    assert FileBaton(str(build / "lock")).try_acquire()
    return build / "lock"


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path):
    pytest.importorskip("torch")
    from torch.utils.file_baton import FileBaton

    lock = _killed_build(tmp_path, "fused_adam")
    old = time.time() - 120
    os.utime(lock, (old, old))
    assert stale_locks((tmp_path,), busy_build_dirs(), time.time()) == [lock]
    assert clear_stale_locks((tmp_path,)) == [lock]
    assert FileBaton(str(lock)).try_acquire()  # the next build goes ahead instead of waiting forever


def test_a_lock_whose_build_runs_is_kept(tmp_path):
    pytest.importorskip("torch")
    lock = _killed_build(tmp_path, "cpu_adam")
    old = time.time() - 120
    os.utime(lock, (old, old))
    ninja = subprocess.Popen(["sleep", "30"], cwd=lock.parent)  # stands where the build's ninja works
    try:
        time.sleep(0.1)
        assert stale_locks((tmp_path,), busy_build_dirs(), time.time()) == []
    finally:
        ninja.kill()
        ninja.wait()
    young = _killed_build(tmp_path, "fused_lion")  # a build that has not started ninja yet
    assert young not in stale_locks((tmp_path,), busy_build_dirs(), time.time())


@pytest.mark.slow
def test_prepare_ops_loads_fused_adam_on_the_cpu():
    from autofit.machine.device import get_hardware

    report = prepare_ops([Config(optimizer="adamw"), Config(optimizer="sgd")], get_hardware("cpu"))
    assert report.ops == ("deepspeed_shm_comm", "fused_adam")
    assert report.loaded == {"deepspeed_shm_comm": "ok", "fused_adam": "ok"}, report.loaded


def test_a_failed_fused_adam_build_runs_adamw_as_torch_adam():
    from autofit.ds.emit import deepspeed_config
    from autofit.probe.ops import OpsReport

    adamw = Config(optimizer="adamw")
    software = Software()  # nvcc found: FusedAdam is expected to build
    assert "torch_adam" not in deepspeed_config(adamw, 1, "cuda", software)["optimizer"]["params"]
    report = OpsReport(ops=("fused_adam",), loaded={"fused_adam": "RuntimeError: Error building extension 'fused_adam'"})
    after = report.software(software)
    assert after.failed_ops == {"fused_adam"} and not after.can_load_op("fused_adam")
    params = deepspeed_config(adamw, 1, "cuda", after)["optimizer"]["params"]
    assert params["torch_adam"] is True
    assert ops_needed([("adamw", "none", "none")], "cuda", after) == ()  # nothing left to build for it
    assert OpsReport(ops=("fused_adam",), loaded={"fused_adam": "ok"}).software(software) is software


def test_the_json_with_torch_adam_is_deepspeeds():
    from autofit.ds.emit import check_with_deepspeed, deepspeed_config

    ds = deepspeed_config(Config(optimizer="adamw", zero_stage=2), 8, "cuda", Software(failed_ops=frozenset({"fused_adam"})))
    check_with_deepspeed(ds)


@pytest.mark.slow
def test_every_probe_clears_stale_locks_first(tmp_path, monkeypatch):
    """Not once a search: a probe killed at its timeout mid-build leaves a lock the next probe would wait on."""
    from autofit.machine.device import get_hardware
    from autofit.probe.run import run_probe

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _killed_build(tmp_path, "fused_adam")
    old = time.time() - 120
    os.utime(lock, (old, old))
    missing = f"{tmp_path / 'no_such_workload.py'}:workload"  # the probe fails at once, after clearing
    result = run_probe(probe_spec(missing, Config(optimizer="sgd"), get_hardware("cpu"), 1, steps=1, warmup_steps=0), timeout_s=120)
    assert result.status == "error"
    assert not lock.exists()


def _building_in(folder: Path) -> list[int]:
    """Processes working under ``folder`` (a build's ninja and compilers work in its build directory), zombies not
    counted."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            works_here = Path(os.readlink(entry / "cwd")).is_relative_to(folder)
            zombie = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if works_here and not zombie:
            alive.append(int(entry.name))
    return alive


def _wait(until, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        time.sleep(0.2)
    return bool(until())


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="reads /proc")
@pytest.mark.parametrize("end", ["caller killed", "timeout"])
def test_an_op_build_ends_with_its_caller_and_its_timeout_compilers_included(tmp_path: Path, end: str) -> None:
    """A worker killed with SIGKILL, or a build past its timeout, leaves no ninja or compiler running (a fresh
    TORCH_EXTENSIONS_DIR: the cpu_adam build really starts). The timeout leaves the build's process time to import
    DeepSpeed and start compiling (twice what an import takes here, and 10 s more: on a loaded 2-core machine the
    import alone took past 8 s), and the build itself takes longer still (a minute to several)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), DS_ACCELERATOR="cpu",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, check=True, capture_output=True)
    timeout = 600 if end == "caller killed" else round(2 * (time.monotonic() - started) + 10)
    code = f"from autofit.probe.ops import load_ops; print(load_ops(('cpu_adam',), 'cpu', {timeout}), flush=True)"
    caller = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: len(_building_in(tmp_path)) >= 2, 120), "the build never started"
        if end == "caller killed":
            caller.kill()
        else:
            assert f"not built within {timeout} s" in caller.communicate(timeout=timeout + 120)[0]
        caller.wait()
        assert _wait(lambda: not _building_in(tmp_path), 15), _building_in(tmp_path)
    finally:
        caller.kill()
        for pid in _building_in(tmp_path):  # on a failure: no compiler left behind by the test itself
            os.kill(pid, 9)
