"""Why a probe rank failed: out of memory (on the device or on the host) or another error.

Two ways a rank fails:

* it raises, and :func:`classify_exception` reads the exception. The texts matched are the ones
  the libraries write:

  - PyTorch's caching allocator: ``torch.OutOfMemoryError`` "CUDA out of memory. Tried to allocate ..."
    (c10/cuda/CUDACachingAllocator.cpp);
  - a CUDA runtime call: "CUDA error: out of memory" (``C10_CUDA_CHECK`` on ``cudaErrorMemoryAllocation``);
  - cuBLAS / cuDNN / cuSOLVER / cuSPARSE handles and workspaces: "CUDA error: CUBLAS_STATUS_ALLOC_FAILED
    when calling `cublasCreate(handle)`" (``TORCH_CUDABLAS_CHECK``), "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"
    (``AT_CUDNN_CHECK``; ATen/cuda/Exceptions.h);
  - NCCL: ``torch.distributed.DistBackendError`` "NCCL error in: ...ProcessGroupNCCL.cpp, unhandled cuda
    error ... Last error: Cuda failure 'out of memory'" (c10d ``C10D_NCCL_CHECK`` + NCCL's ``CUDACHECK``);
  - cuBLAS handle creation on a full device: "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling
    `cublasCreate(handle)`" (``TORCH_CUDABLAS_CHECK`` in ATen/cuda/CublasHandlePool.cpp; cuBLAS returns
    NOT_INITIALIZED, not ALLOC_FAILED, when it cannot allocate its resources), only with ``cublasCreate``
    / ``cublasLtCreate`` (NOT_INITIALIZED elsewhere is a setup error);
  - NCCL's own device buffers: "Failed to CUDA calloc 6291456 bytes" (NCCL's ``WARN`` in include/alloc.h,
    ``ncclCudaCalloc``; torch appends NCCL's last error after "Last error:"), "Failed to CUDA calloc async";
  - the host: "DefaultCPUAllocator: can't allocate memory" (c10/core/impl/alloc_cpu.cpp) and Python's
    ``MemoryError``;
  - pinned host memory: "mlock failed to allocate N bytes" (DeepSpeed's csrc/pin_memory/page_alloc.cpp, the
    NVMe swap buffers; written to stderr, read from a rank's log tail); and a "CUDA error: out of memory"
    raised by a pinning call (PyTorch's CachingHostAllocator ``C10_CUDA_CHECK(cudaHostAlloc(...))``): the
    innermost frame of the traceback pins (``pin_memory``, ``new_cpu_locked_tensor``), so it is the host's.

* it dies without writing a result. A rank ended by SIGKILL that this process did not send is ``oom``
  on the host when the kernel's OOM killer marked it: its pid in a kernel log line "Out of memory:
  Killed process PID (comm) ..." / "Memory cgroup out of memory: Killed process PID ..."
  (mm/oom_kill.c, ``__oom_kill_process``), or, where the log cannot be read, the system's ``oom_kill``
  counter in ``/proc/vmstat`` rose while the probe ran.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import traceback
from typing import TypedDict

from autofit.core.boundary import OomOn, Status

#: (pattern over the exception text, where memory ran out); the first match wins
OOM_PATTERNS: tuple[tuple[re.Pattern[str], OomOn], ...] = (
    (re.compile(r"mlock failed to allocate \d+ bytes"), "host"),
    (re.compile(r"CUDA out of memory"), "device"),
    (re.compile(r"CUBLAS(?:LT)?_STATUS_NOT_INITIALIZED when calling `cublas(?:Lt)?Create"), "device"),
    (re.compile(r"Failed to CUDA calloc"), "device"),
    (re.compile(r"\b(?:CUBLAS|CUBLASLT|CUDNN|CUSOLVER|CUSPARSE|CUFFT)_STATUS_ALLOC_FAILED\b"), "device"),
    (re.compile(r"CUDA error: out of memory"), "device"),
    (re.compile(r"NCCL error[\s\S]*out of memory|Cuda failure[^\n]*out of memory"), "device"),
    (re.compile(r"can't allocate memory"), "host"),
)
#: exception classes that are out-of-memory whatever their text
_OOM_TYPES: dict[str, OomOn] = {"OutOfMemoryError": "device", "MemoryError": "host"}
#: the kernel OOM killer's line, mm/oom_kill.c: "%s: Killed process %d (%s) total-vm:..."
_KILLED_RE = re.compile(r"(?:Out of memory|out of memory)[^:\n]*: Killed process (\d+) \(")


#: a source line or function that pins host memory: torch's ``pin_memory``, DeepSpeed's accelerator
#: ``pin_memory`` and its aio handles' ``new_cpu_locked_tensor``
_PINNING_RE = re.compile(r"pin_memory(?!\s*=\s*False)|new_cpu_locked_tensor|cudaHostAlloc|cudaHostRegister")


def oom_location(name: str, text: str, innermost: str = "") -> tuple[OomOn, str] | None:
    """``(where, line)`` when an exception of class ``name`` with ``text`` is an out-of-memory, else None.

    ``where`` is ``device`` or ``host``; ``line`` is the line of ``text`` that says so. ``innermost``: the
    function name and source line of the traceback's innermost frame; a CUDA out-of-memory raised where it
    pins memory is the host's (cudaHostAlloc reports cudaErrorMemoryAllocation as "out of memory").
    """
    for pattern, where in OOM_PATTERNS:
        match = pattern.search(text)
        if match:
            if where == "device" and _PINNING_RE.search(innermost):
                where = "host"
            return where, _line_at(text, match.end() - 1)
    if name in _OOM_TYPES:
        return _OOM_TYPES[name], first_line(text)
    return None


class Failure(TypedDict):
    """Why a rank failed, as :class:`~autofit.probe.records.RankResult` fields (``RankResult(rank=r, **failure)``)."""

    status: Status
    message: str
    oom_on: OomOn | None


def classify_exception(exc: BaseException) -> Failure:
    """``oom`` on the ``device`` or the ``host``, or ``error``; with one line saying so."""
    name = type(exc).__name__
    text = str(exc).strip()
    found = oom_location(name, text, innermost_frame(exc))
    if found is not None:
        where, line = found
        return {"status": "oom", "message": _one_line(name, line), "oom_on": where}
    return {"status": "error", "message": _one_line(name, first_line(text)), "oom_on": None}


def innermost_frame(exc: BaseException) -> str:
    """``function: source line`` of the innermost Python frame of ``exc``'s traceback ("" without one): the call
    into the library that raised (a C++ error has no frame of its own)."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    return f"{frames[-1].name}: {frames[-1].line or ''}" if frames else ""


def _one_line(name: str, line: str) -> str:
    return (f"{name}: {line}" if line else name)[:500]


def first_line(text: str) -> str:
    """The first line of ``text`` that is not blank, stripped ("" where there is none)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def _line_at(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start : end if end >= 0 else len(text)].strip()


# ---------------------------------------------------------------------------------------------
# ranks that died without a result


#: the exit status a shell or launcher reports for a child ended by SIGKILL (128 + signal number)
SHELL_SIGKILL = 128 + int(signal.SIGKILL)


def ended_by_sigkill(returncode: int | None) -> bool:
    """Whether an exit status says SIGKILL: ``-9`` (Popen, torch's elastic agent) or ``137`` (through a shell,
    ``srun``, ``ssh`` or torchrun)."""
    return returncode in (-signal.SIGKILL, SHELL_SIGKILL)


def oom_killed_pids(kernel_log: str) -> set[int]:
    """Pids the kernel's OOM killer killed, from kernel log text (``dmesg`` or ``/dev/kmsg`` records)."""
    return {int(m.group(1)) for m in _KILLED_RE.finditer(kernel_log)}


def oom_kill_count(vmstat: str | None = None) -> int | None:
    """The system's count of OOM kills so far (``oom_kill`` in ``/proc/vmstat``, Linux >= 4.13); None if unknown."""
    if vmstat is None:
        try:
            with open("/proc/vmstat") as handle:
                vmstat = handle.read()
        except OSError:
            return None
    return oom_kill_counter(vmstat)


def oom_kill_counter(text: str) -> int | None:
    """The ``oom_kill N`` line's count in a kernel counter file (``/proc/vmstat``, a cgroup v2 ``memory.events``,
    a cgroup v1 ``memory.oom_control``: one ``key value`` pair a line); None where it has none."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def read_kernel_log(max_records: int = 4096) -> str:
    """The kernel's recent log (``/dev/kmsg`` records, else ``dmesg``); empty where neither can be read."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return _dmesg()
    records: list[str] = []
    try:
        for _ in range(max_records * 4):
            try:
                records.append(os.read(fd, 8192).decode("utf-8", "replace"))
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten while reading; the next read goes on
                continue
    finally:
        os.close(fd)
    return "".join(records[-max_records:])


def _dmesg() -> str:
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def classify_log_tail(log_tail: str) -> Failure | None:
    """The result of a rank that wrote none but left an out-of-memory line in its log, or None: DeepSpeed's
    failed ``mlock`` of a swap buffer is written to stderr and the rank dies on the null buffer (SIGSEGV or an
    abort), before Python can raise."""
    found = oom_location("", log_tail)
    if found is None:
        return None
    where, line = found
    return {"status": "oom", "oom_on": where, "message": _one_line("rank log", line)}


def classify_exit(
    returncode: int | None,
    pid: int,
    *,
    killed_by_us: bool,
    kernel_log: str,
    oom_kills_before: int | None,
    oom_kills_after: int | None,
) -> Failure | None:
    """The result of a rank that wrote none: ``oom`` on the host when the OOM killer took it, else None.

    Only a SIGKILL this process did not send counts, in either form its exit status takes
    (:func:`ended_by_sigkill`); the kernel log naming ``pid`` decides, and where no log could be read a rise
    of the ``oom_kill`` counter during the probe does.
    """
    if killed_by_us or not ended_by_sigkill(returncode):
        return None
    marked = pid in oom_killed_pids(kernel_log)
    if not marked and not kernel_log and oom_kills_before is not None and oom_kills_after is not None:
        marked = oom_kills_after > oom_kills_before
    if not marked:
        return None
    return {
        "status": "oom",
        "oom_on": "host",
        "message": f"the kernel's OOM killer ended the rank (pid {pid}): the host ran out of memory",
    }
