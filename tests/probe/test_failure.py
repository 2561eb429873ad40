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


def test_a_sigkill_reported_through_a_shell_is_classified_too() -> None:
    """torchrun, srun and ssh report a SIGKILLed child as 137 (128 + 9): classify_exit reads it as the -9 it is."""
    killer = f"{sys.executable} -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'; exit $?"
    done = subprocess.run(["sh", "-c", killer], check=False)
    assert done.returncode == 137
    marked = {"kernel_log": "Out of memory: Killed process 4242 (python)\n", "oom_kills_before": None, "oom_kills_after": None}
    assert classify_exit(done.returncode, 4242, killed_by_us=False, **marked)["oom_on"] == "host"  # type: ignore[index]
    assert classify_exit(done.returncode, 4242, killed_by_us=True, **marked) is None
    assert classify_exit(1, 4242, killed_by_us=False, **marked) is None


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


#: ATen/cuda/CublasHandlePool.cpp: cublasCreate on a device with no room for its resources (the
#: text of the reports in QwenLM/Qwen#120, EleutherAI/lm-evaluation-harness#1689, traced to a full device)
CUBLAS_NOT_INITIALIZED = (
    "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
    "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)
#: NCCL include/alloc.h ncclCudaCalloc's WARN, which torch reports as NCCL's last error (NPKit#37's log shows the WARN)
NCCL_CALLOC = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error "
    "(run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\n"
    "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nFailed to CUDA calloc 6291456 bytes"
)
#: PyTorch's CachingHostAllocator: C10_CUDA_CHECK(cudaHostAlloc(...)) on cudaErrorMemoryAllocation
PINNED_OOM = "CUDA error: out of memory\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
#: DeepSpeed csrc/pin_memory/page_alloc.cpp, ds_page_aligned_alloc's stderr line when mlock fails
MLOCK_FAILED = "mlock failed to allocate 1310720000 bytes with error no 12 msg Cannot allocate memory"


@pytest.mark.parametrize("exc", [RuntimeError(CUBLAS_NOT_INITIALIZED), torch.distributed.DistBackendError(NCCL_CALLOC)],
                         ids=["cublas-create", "nccl-calloc"])
def test_cublas_create_and_ncclcalloc_are_the_device_running_out(exc: BaseException) -> None:
    result = classify_exception(exc)
    assert (result["status"], result["oom_on"]) == ("oom", "device")
    assert "cublasCreate" in result["message"] or "Failed to CUDA calloc 6291456 bytes" in result["message"]


def test_not_initialized_outside_handle_creation_stays_an_error() -> None:
    result = classify_exception(RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasSgemm( handle)`"))
    assert result["status"] == "error"


class _Accelerator:
    """A frame shaped as DeepSpeed's ``CUDA_Accelerator.pin_memory`` (``return tensor.pin_memory()``); the CUDA
    error is raised in it as cudaHostAlloc's failure surfaces there."""

    def pin_memory(self, tensor: object) -> object:
        raise RuntimeError(PINNED_OOM)


def test_a_cuda_out_of_memory_while_pinning_is_the_hosts() -> None:
    with pytest.raises(RuntimeError) as caught:
        _Accelerator().pin_memory(torch.zeros(4))
    result = classify_exception(caught.value)
    assert (result["status"], result["oom_on"]) == ("oom", "host")
    with pytest.raises(RuntimeError) as device:
        raise RuntimeError(PINNED_OOM)  # the same text from a device allocation: the device's
    assert classify_exception(device.value)["oom_on"] == "device"


def test_deepspeeds_failed_mlock_in_a_log_tail_is_the_hosts() -> None:
    from autofit.probe.failure import oom_location

    tail = f"[rank0] initializing swapper\n{MLOCK_FAILED}\nSegmentation fault (core dumped)\n"
    assert oom_location("", tail) == ("host", MLOCK_FAILED)


def test_an_out_of_memory_reports_the_peak_reached_before_it_never_a_measured_zero() -> None:
    from autofit.probe.rank.meter import Meter
    from autofit.probe.rank.worker import failure_result

    meter = Meter(torch, "cpu", None, lambda used: None)
    # 64 MiB, held while it fails: over glibc's largest mmap threshold (32 MiB on 64-bit), so fresh pages the process
    # touches now, whatever earlier tests left free in its heap
    held = torch.ones(64 * 2**20 // 4)
    try:
        with pytest.raises(MemoryError) as caught:
            raise MemoryError()
        metered = failure_result(0, {}, caught.value, "traceback", meter)
    finally:
        meter.stop_watchdog()
    assert held.numel() and metered.status == "oom" and metered.peak_bytes >= 64 * 2**20
    assert "unknown" not in (metered.message or "")
    unmetered = failure_result(0, {}, caught.value, "traceback", None)
    assert unmetered.peak_bytes == 0 and "peak unknown" in (unmetered.message or "")
    error = failure_result(0, {}, ValueError("bad entry"), "traceback", None)
    assert error.message == "ValueError: bad entry"


def test_a_rank_that_died_on_a_failed_mlock_is_oom_on_the_host() -> None:
    """DeepSpeed writes the mlock failure to stderr, then the rank dies on the null buffer: no result file."""
    from autofit.core.config import Config
    from autofit.probe.run import _combine

    tail = f"[2026-11-25] [INFO] Tensor Swapping: Adding optimizer tensors\n{MLOCK_FAILED}\n"
    outcomes = [RankOutcome(0, -signal.SIGSEGV, None, tail, pid=1), RankOutcome(1, -signal.SIGKILL, None, "", pid=2,
                                                                                killed_by_us=True)]
    result = _combine(Config(), outcomes, False, 2, "real", 60.0, 1.0)
    assert (result.status, result.oom_on) == ("oom", "host")
    assert "mlock failed to allocate" in (result.message or "")
