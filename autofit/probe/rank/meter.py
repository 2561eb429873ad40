"""Memory metering of one probe rank, as docs/design.md's "Memory, measured" defines it.

CPU (the process is the device): ``VmHWM - VmRSS`` after the imports, the high-water
mark reset after them, and a watchdog that ends the process with ``oom`` once RSS
passes the budget. CUDA: the most device memory NVML lists for this process, sampled in a thread
from the context's creation through the steps (:mod:`autofit.machine.nvml`); ``max_memory_reserved``
and the context beside it, and their sum where NVML has no figure. ``--memory`` is enforced:
``torch.cuda.set_per_process_memory_fraction`` caps the caching allocator at the budget less the
context and what NCCL will add outside the allocator once it connects (priced by world size,
:func:`autofit.cost_model.cuda_runtime.nccl_buffer_bytes`: the context is measured before NCCL starts),
so a candidate past it fails with the allocator's own out-of-memory error. cuBLAS's workspace is allocated
through the allocator, within the cap.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from autofit.machine.nvml import ProcessMemorySampler, start_sampler
from autofit.probe.rank import memory


class Meter:
    """Start metering at construction (after the imports); :meth:`peak_bytes` reads the peak so far.

    ``on_exceeded(used_bytes)`` is called from the CPU watchdog's thread once resident memory
    passes ``budget_bytes`` (``None``: no budget); it is never called on CUDA. ``later_outside_bytes``: CUDA,
    what will live outside the allocator beyond the context measured here (NCCL's buffers), left out of the
    allocator's cap under ``device_budget_bytes``. ``prepaid_bytes``: CPU, resident bytes a warm parent made before
    this rank was forked that a fresh rank makes after its baseline (:mod:`autofit.probe.rank.zygote`): the
    baseline is lowered by them, so the peak counts them as a fresh rank's does.
    """

    def __init__(self, torch: Any, kind: str, budget_bytes: int | None, on_exceeded: Callable[[int], None],
                 device_budget_bytes: int | None = None, later_outside_bytes: int = 0, prepaid_bytes: int = 0) -> None:
        self.torch = torch
        self.cuda = kind == "cuda"
        self.context_bytes = 0
        self.baseline_bytes = 0
        self.watchdog: memory.RssWatchdog | None = None
        self.sampler: ProcessMemorySampler | None = None
        if self.cuda:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            self.context_bytes = cuda_context_bytes(torch, local_rank)
            self.sampler = start_sampler(torch, local_rank, os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"))
            if device_budget_bytes is not None:
                enforce_budget(torch, local_rank, device_budget_bytes, self.context_bytes + later_outside_bytes)
            torch.cuda.reset_peak_memory_stats()
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
            self.baseline_bytes = memory.rss_bytes() - prepaid_bytes
            memory.reset_peak()
            self.watchdog = memory.RssWatchdog(self.baseline_bytes, budget_bytes, on_exceeded).start()

    def peak_bytes(self, final: bool = True) -> int:
        """Most memory held since metering started (CUDA: NVML's per-process peak, else reserved + context).

        ``final=False`` reads the peak so far and keeps metering (the build and initialize checkpoints);
        the final read stops the NVML sampler after one last sample."""
        if self.cuda:
            allocator = int(self.torch.cuda.max_memory_reserved()) + self.context_bytes
            if self.sampler is None:
                return allocator
            if final:
                nvml = self.sampler.stop()
            else:
                self.sampler.sample()
                nvml = self.sampler.peak_bytes
            return nvml if nvml is not None else allocator
        seen = self.watchdog.max_rss_bytes if self.watchdog else 0
        return max(memory.hwm_bytes(), seen) - self.baseline_bytes

    def sync(self) -> None:
        """Wait for the device's queued work (a no-op on the CPU)."""
        if self.cuda:
            self.torch.cuda.synchronize()

    def stop_watchdog(self) -> None:
        if self.watchdog:
            self.watchdog.stop()

    def report(self) -> dict[str, int | None]:
        """What the probe JSON shows beside ``peak_bytes`` (CUDA: each source of the figure)."""
        if not self.cuda:
            return {}
        return {
            "nvml_peak_bytes": self.sampler.peak_bytes if self.sampler else None,
            "max_memory_reserved_bytes": int(self.torch.cuda.max_memory_reserved()),
            "max_memory_allocated_bytes": int(self.torch.cuda.max_memory_allocated()),
            "context_bytes": self.context_bytes,
        }


def allocator_fraction(budget_bytes: int, context_bytes: int, total_bytes: int) -> float | None:
    """The caching allocator's share of the device that keeps the process within ``budget_bytes``;
    None when the budget is the whole device (nothing to enforce)."""
    if budget_bytes >= total_bytes:
        return None
    return max(0.0, budget_bytes - context_bytes) / total_bytes


def enforce_budget(torch: Any, device_index: int, budget_bytes: int, context_bytes: int) -> None:
    """``--memory`` on CUDA: cap the caching allocator (``set_per_process_memory_fraction``)."""
    _, total = torch.cuda.mem_get_info(device_index)
    fraction = allocator_fraction(budget_bytes, context_bytes, int(total))
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, device_index)


def cuda_context_bytes(torch: Any, device_index: int) -> int:
    """Device memory this process holds outside PyTorch's caching allocator (the CUDA context).

    NVML's per-process figure when available; else ``total - free`` right after the
    context is created, which assumes the GPU is otherwise idle.
    """
    free, total = torch.cuda.mem_get_info(device_index)  # creates the context
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory) - int(torch.cuda.memory_reserved(device_index))
    except Exception:  # no NVML, or no per-process accounting in a container
        pass
    return int(total - free) - int(torch.cuda.memory_reserved(device_index))
