"""OOM classification from the texts torch, cuBLAS/cuDNN, NCCL and the kernel really write.

The CPU allocator's failure, Python's MemoryError and a SIGKILL are produced for real here; a CUDA
allocator's or NCCL's failure cannot be on a CPU, so those exceptions are built with the classes torch
raises and the texts its sources format (paths in autofit/probe/failure.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from autofit.probe.failure import classify_exception, classify_exit, oom_kill_count, oom_killed_pids
from autofit.probe.launch import RankOutcome, _mark_oom_kills
from autofit.probe.oom_killer import oom_kills

torch = pytest.importorskip("torch")

#: c10/cuda/CUDACachingAllocator.cpp's message, as torch 2.x formats it
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
    "is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory "
    "76.50 GiB is allocated by PyTorch, and 1.11 GiB is reserved by PyTorch but unallocated."
)
#: ATen/cuda/Exceptions.h TORCH_CUDABLAS_CHECK, with the CUDA_LAUNCH_BLOCKING hint torch appends
CUBLAS_ALLOC = (
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
    "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)
#: ATen/cuda/Exceptions.h AT_CUDNN_CHECK
CUDNN_ALLOC = "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"
#: c10d C10D_NCCL_CHECK + getNcclErrorDetailStr, with NCCL's CUDACHECK line as its last error
NCCL_OOM = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error "
    "(run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\n"
    "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'"
)
#: the kernel's line for a real OOM kill, recorded on this machine (a memory cgroup at 64 MiB)
KERNEL_LINE = (
    "3,417,373927299,-;Memory cgroup out of memory: Killed process 4991 (python3) total-vm:323768kB, "
    "anon-rss:65280kB, file-rss:6704kB, shmem-rss:0kB, UID:0 pgtables:204kB oom_score_adj:0\n"
)


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError(CUDA_OOM),
        RuntimeError(CUBLAS_ALLOC),
        RuntimeError(CUDNN_ALLOC),
        torch.distributed.DistBackendError(NCCL_OOM),
        RuntimeError("CUDA error: out of memory\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."),
    ],
    ids=["allocator", "cublas", "cudnn", "nccl", "cuda-runtime"],
)
def test_device_out_of_memory_is_oom_on_the_device(exc: BaseException) -> None:
    result = classify_exception(exc)
    assert (result["status"], result["oom_on"]) == ("oom", "device")
    # the message is the line that names the failure, not torch's debugging hint after it
    assert "CUDA_LAUNCH_BLOCKING" not in result["message"] and "TORCH_USE_CUDA_DSA" not in result["message"]


def test_a_failed_cpu_allocation_is_oom_on_the_host() -> None:
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**50, dtype=torch.uint8)
    result = classify_exception(caught.value)
    assert (result["status"], result["oom_on"]) == ("oom", "host")
    with pytest.raises(MemoryError) as python_caught:
        bytearray(2**50)
    assert classify_exception(python_caught.value)["oom_on"] == "host"


def test_other_failures_are_errors() -> None:
    with pytest.raises(RuntimeError) as caught:
        torch.ones(2, 3) @ torch.ones(2, 3)
    assert classify_exception(caught.value) | {"message": ""} == {"status": "error", "message": "", "oom_on": None}
    # memory in the text is not enough: an illegal access is a bug, not a full device
    illegal = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert classify_exception(illegal)["status"] == "error"
    assert classify_exception(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"))["status"] == "error"


def test_kernel_log_names_the_killed_pid() -> None:
    assert oom_killed_pids("6,1,2,-;some other line\n" + KERNEL_LINE) == {4991}
    assert oom_killed_pids("Out of memory: Killed process 77 (python) total-vm:1kB\n") == {77}
    assert oom_killed_pids("Killed process 5 (x) by someone\n") == set()
    assert oom_kill_count("pgfault 12\noom_kill 3\n") == 3


def _killed_sleeper() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return proc


def test_a_sigkill_without_the_oom_killers_mark_stays_an_error() -> None:
    proc = _killed_sleeper()
    assert proc.returncode == -signal.SIGKILL
    kwargs = {"kernel_log": "", "oom_kills_before": 3, "oom_kills_after": 3}
    assert classify_exit(proc.returncode, proc.pid, killed_by_us=False, **kwargs) is None
    # a kill the launcher sent itself (timeout, a failed peer) is never the OOM killer's
    marked = {"kernel_log": f"Out of memory: Killed process {proc.pid} (python)\n", "oom_kills_before": 3, "oom_kills_after": 4}
    assert classify_exit(proc.returncode, proc.pid, killed_by_us=True, **marked) is None
    assert classify_exit(proc.returncode, proc.pid, killed_by_us=False, **marked)["oom_on"] == "host"  # type: ignore[index]


def _memory_cgroup(limit_bytes: int) -> Path | None:
    """A fresh cgroup-v1 memory group capped at ``limit_bytes``, or None where this user cannot make one."""
    root = Path("/sys/fs/cgroup/memory")
    group = root / f"autofit-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    except OSError:
        return None
    return group


def test_a_rank_the_oom_killer_ended_is_oom_on_the_host() -> None:
    """A real OOM kill: a process past its memory cgroup's 64 MiB is killed by the kernel, then classified."""
    group = _memory_cgroup(64 * 2**20)
    if group is None:
        pytest.skip("cannot create a memory cgroup here (needs root and cgroup v1)")
    try:
        before = oom_kills()  # what the launcher reads: the memory cgroup's count and the system's
        code = f"open('{group}/cgroup.procs', 'w').write(str(__import__('os').getpid())); x = bytearray(400 * 2**20)"
        proc = subprocess.Popen([sys.executable, "-c", code])
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        outcome = RankOutcome(0, proc.returncode, None, "", pid=proc.pid, killed_by_us=False)
        [marked] = _mark_oom_kills([outcome], before)
        assert marked.result is not None
        assert (marked.result.status, marked.result.oom_on) == ("oom", "host")
    finally:
        group.rmdir()
