"""Memory of a process tree, read from outside: a child's own peak and what its children hold."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from autofit.script.tree import TreeMeter

MIB = 2**20

#: holds 120 MiB for a moment, frees it, then starts a grandchild that holds 80 MiB while the parent sleeps
_TREE = textwrap.dedent(
    """
    import subprocess, sys, time
    block = bytearray(120 * 2**20)
    time.sleep(0.3)
    del block
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(80 * 2**20); time.sleep(0.6)"])
    child.wait()
    """
)


def _meter(budget_bytes: int | None) -> tuple[TreeMeter, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", _TREE])
    exceeded: list[int] = []
    meter = TreeMeter([proc.pid], "cpu", budget_bytes, exceeded.append)
    with meter:
        proc.wait(timeout=60)
        time.sleep(0.05)
    return meter, exceeded


def test_the_peak_is_the_processs_high_water_mark_plus_its_childrens_memory() -> None:
    meter, exceeded = _meter(None)
    # the parent's freed 120 MiB stays in its VmHWM; the grandchild's 80 MiB comes on top while it lives
    assert meter.peaks[0] >= (120 + 80) * MIB
    assert meter.peaks[0] < (120 + 80 + 200) * MIB  # two interpreters' own memory, not more
    assert exceeded == []


def test_passing_the_budget_is_reported_once() -> None:
    meter, exceeded = _meter(100 * MIB)
    assert meter.exceeded and len(exceeded) == 1 and exceeded[0] > 100 * MIB


def test_a_builds_compiler_is_not_the_trainings_memory(tmp_path) -> None:  # noqa: ANN001
    # the first deepspeed.initialize JIT-builds an op: ninja and cc1plus start under the rank and hold hundreds of MiB
    # for a moment; the training holds none of it. Here a compiler named so holds 300 MiB beside an 80 MiB worker.
    compiler = tmp_path / "cc1plus"
    compiler.symlink_to(sys.executable)
    tree = textwrap.dedent(
        f"""
        import subprocess, sys, time
        hold = "import time; b = bytearray({{}} * 2**20); time.sleep(1.0)"
        build = subprocess.Popen([{str(compiler)!r}, "-S", "-c", hold.format(300)])
        worker = subprocess.Popen([sys.executable, "-S", "-c", hold.format(80)])
        build.wait(); worker.wait()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", tree])
    meter = TreeMeter([proc.pid], "cpu", 250 * MIB, lambda used: None)
    with meter:
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert 80 * MIB <= meter.peaks[0] < (80 + 200) * MIB  # the worker's 80 MiB and two interpreters, not the build's 300
    assert not meter.exceeded


# -- CUDA: NVML's rows, and where they do not list the script (containers) ------------------------------------

GIB = 2**30


def _row(pid: int, used: int | None) -> object:
    """One row of ``nvmlDeviceGetComputeRunningProcesses`` as pynvml hands it out (``usedGpuMemory`` None where
    NVML says NVML_VALUE_NOT_AVAILABLE)."""
    from types import SimpleNamespace

    return SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)


def test_nvml_rows_of_the_scripts_tree_are_its_memory_and_no_row_is_no_measure() -> None:
    from autofit.script.tree import listed_bytes

    rows = [_row(101, 3 * GIB), _row(102, GIB), _row(999, 40 * GIB), _row(103, None)]
    assert listed_bytes(rows, {101, 102}) == 4 * GIB
    assert listed_bytes(rows, {103}) == 0  # listed, its figure unknown to NVML
    # a container: NVML lists the host's pids, none of them the script's
    assert listed_bytes([_row(48213, 30 * GIB)], {101, 102}) is None


def test_unlisted_scripts_fall_back_to_the_devices_used_memory_only_where_the_probe_has_the_gpu_alone() -> None:
    from autofit.script.tree import DeviceBaseline, rank_device_bytes

    # NVML listed the tree: its rows, whatever the device holds besides
    assert rank_device_bytes(5 * GIB, 70 * GIB, DeviceBaseline(GIB, 0), "0") == (5 * GIB, None)
    # not listed, the GPU idle before the script (nvmlDeviceGetMemoryInfo.used 0.5 GiB, no process): the delta
    alone = DeviceBaseline(used_bytes=GIB // 2, processes=0)
    assert rank_device_bytes(None, 31 * GIB // 2, alone, "0") == (15 * GIB, None)
    assert rank_device_bytes(None, GIB // 4, alone, "0") == (0, None)  # before the script's context: nothing yet
    # not listed, and another process held the GPU: no figure, a reason
    value, reason = rank_device_bytes(None, 40 * GIB, DeviceBaseline(used_bytes=20 * GIB, processes=1), "GPU-abc")
    assert value is None and reason is not None and "GPU-abc" in reason and "alone" in reason
    value, reason = rank_device_bytes(None, 40 * GIB, None, "3")
    assert value is None and "unknown" in (reason or "")


def test_a_cuda_run_whose_memory_was_never_measured_is_an_error_not_a_fit() -> None:
    from autofit.core.config import Config
    from autofit.script.prober import result_of
    from autofit.script.records import DeepSpeedMetric
    from autofit.script.runner import ScriptRun

    meter = TreeMeter([1], "cuda", None, lambda used: None)
    meter.reasons[0] = "NVML lists none of the script's processes on GPU 0 (a container's PID namespace?) and ..."
    assert meter.unmeasured() == meter.reasons[0]
    assert TreeMeter([1, 2], "cuda", None, lambda used: None).unmeasured() == "NVML measured no device memory for rank 0"
    metric = DeepSpeedMetric(latency=2e5, FLOPS_per_gpu=1e12, throughput=40.0, rank=0)
    run = ScriptRun(returncodes=[0], log_tails=[""], peak_bytes=[0], timed_out=False, over_budget=False, wall_s=3.0,
                    unmeasured=meter.unmeasured())
    result = result_of(Config(), 1, run, metric, 60.0)
    assert result.status == "error" and not result.fits and "unmeasured" in (result.message or "")
    measured = ScriptRun(returncodes=[0], log_tails=[""], peak_bytes=[6 * GIB], timed_out=False, over_budget=False,
                         wall_s=3.0)
    assert result_of(Config(), 1, measured, metric, 60.0).status == "ok"
