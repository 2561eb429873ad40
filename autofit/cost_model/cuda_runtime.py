"""CUDA device memory that is no tensor of the model: an additive term, priced first and learned from a probe.

What NVML reports for a training process (the probe's measured peak, :mod:`autofit.probe.rank.meter`) is what
PyTorch's caching allocator reserved plus what lives outside it:

* the CUDA context (:attr:`autofit.core.hardware.Hardware.context_bytes`), with the kernels loaded lazily as they
  are first called (``CUDA_MODULE_LOADING=LAZY``, the default since CUDA 11.7);
* NCCL's buffers, allocated by NCCL itself (``cudaMalloc`` / ``cuMem*``, not the caching allocator) when a
  communicator connects: ``NCCL_BUFFSIZE`` (default 4 MiB, NCCL's environment-variable documentation) for
  the Simple protocol per channel and per peer connection; a ring connects each rank to two peers (the one it
  sends to, the one it receives from). NCCL picks the channel count by topology (up to 32 on NVLink); the
  prior assumes :data:`NCCL_CHANNELS`. None on one rank.

* the code a training step loads after the context exists: with lazy loading each kernel's module comes with its
  first call (PyTorch's own kernels, cuBLAS and cuBLASLt, DeepSpeed's fused optimizer): :data:`STEP_MODULES_BYTES`,
  measured, not derived: 804 MiB on the H100 (NVML's per-process peak less ``max_memory_reserved`` less the context
  the probe metered at its start, the search's two probes alike; docs/results/gpu-truth.md has the H200's, the same
  total outside the allocator with the same software).

Inside the allocator but no tensor of the model: cuBLAS's workspaces, one per handle and stream, allocated
through the caching allocator at the first matmul of each (aten/src/ATen/cuda/CublasHandlePool.cpp,
``getChosenWorkspaceSize``: ``CUBLAS_WORKSPACE_CONFIG`` defaults to ``:4096:8``, 32 MiB, from compute capability 9 on
(Hopper, Blackwell) and to ``:4096:2:16:8``, 8.1 MiB, before it, after cuBLAS's ``cublasSetWorkspace``
recommendation). Handles are per thread, so training holds two: the forward's, and the backward's on autograd's
device thread (:data:`CUBLAS_HANDLES`, :func:`training_workspace_bytes`).

These are an offset, not a ratio: the same hundreds of MiB whatever the model. So the prediction adds them
(:func:`runtime_bytes`), calibration learns the outside-allocator part from the first probes as a measured
offset (NVML peak less the allocator's peak, :func:`measured_outside_allocator_bytes`) and fits its ratio to
the rest only, and ``--memory``'s allocator cap leaves room for them (:mod:`autofit.probe.rank.meter`). The CPU
path has no such term (its runtime is priced by :class:`~autofit.cost_model.coefficients.Coefficients`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from autofit.core.hardware import Hardware

MIB = 2**20
#: NCCL_BUFFSIZE's default: the Simple protocol's buffer per channel and peer connection (NCCL env docs)
NCCL_BUFFSIZE = 4 * MIB
#: channels per communicator the prior assumes (NCCL chooses 2-32 by topology): an assumption the first
#: probe's measurement replaces, not a measured figure
NCCL_CHANNELS = 16
#: peer connections per channel of a ring: the next rank (send) and the previous (receive)
RING_PEERS = 2
#: what a training step's kernels load outside the allocator after the context (module docstring): NVML peak
#: 1,386,217,472 B less ``max_memory_reserved`` less the metered context 543,162,368 B, on both probes of
#: benchmarks/results/gpu_check/h100_2026-11-27_run2_search_trials.json (torch 2.11, CUDA 13.0, DeepSpeed 0.19.8)
STEP_MODULES_BYTES = 843_055_104
#: cuBLAS workspace per handle: ``:4096:8`` from compute capability 9 on, ``:4096:2:16:8`` before (CublasHandlePool.cpp)
CUBLAS_WORKSPACE_HOPPER = 4096 * 1024 * 8
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
#: the first compute capability major torch gives cuBLAS the larger workspace on (``parseChosenWorkspaceSize``:
#: ``major == 9 || major == 10 || major == 12``; earlier releases: sm90 alone)
HOPPER_MAJOR = 9
#: cuBLAS handles a training step holds (handles are per thread): the forward's, and autograd's backward thread's
CUBLAS_HANDLES = 2


def nccl_buffer_bytes(world_size: int) -> int:
    """NCCL's own device buffers of one rank's communicator (the prior; see the module docstring)."""
    return 0 if world_size <= 1 else NCCL_CHANNELS * RING_PEERS * NCCL_BUFFSIZE


def cublas_workspace_bytes(hardware: Hardware) -> int:
    """One cuBLAS workspace (a handle's, on the default stream) on ``hardware``, decided as torch decides it: by the
    device's compute capability (``parseChosenWorkspaceSize``), not its name."""
    capability = tuple(hardware.compute_capability or ())  # a list once through JSON (a probe's spec)
    return CUBLAS_WORKSPACE_HOPPER if capability and capability[0] >= HOPPER_MAJOR else CUBLAS_WORKSPACE_DEFAULT


def training_workspace_bytes(hardware: Hardware) -> int:
    """What cuBLAS's workspaces of a training process hold on ``hardware``: one a handle, :data:`CUBLAS_HANDLES`."""
    return CUBLAS_HANDLES * cublas_workspace_bytes(hardware)


def priced_outside_allocator_bytes(hardware: Hardware, world_size: int) -> int:
    """What lives outside the caching allocator before any probe says: the context, the step's kernels and NCCL's
    buffers."""
    return int(hardware.context_bytes + STEP_MODULES_BYTES + nccl_buffer_bytes(world_size))


def outside_allocator_bytes(hardware: Hardware, world_size: int, learned: int | None) -> int:
    """The outside-allocator term: ``learned`` from probes where there is one, else priced."""
    return int(learned) if learned is not None else priced_outside_allocator_bytes(hardware, world_size)


def runtime_bytes(hardware: Hardware, world_size: int, learned: int | None) -> int:
    """The whole additive term of a CUDA rank: outside the allocator, plus cuBLAS's workspace within it; 0 on
    the CPU."""
    if hardware.kind != "cuda":
        return 0
    return outside_allocator_bytes(hardware, world_size, learned) + training_workspace_bytes(hardware)


def measured_outside_allocator_bytes(device_memory: Mapping[str, int | None]) -> int | None:
    """What a CUDA probe held outside the allocator at its peak: NVML's per-process peak less the allocator's
    peak (``max_memory_reserved``); None where NVML had no figure (a container without per-process rows)."""
    nvml = device_memory.get("nvml_peak_bytes")
    reserved = device_memory.get("max_memory_reserved_bytes")
    if nvml is None or reserved is None or nvml <= 0:
        return None
    return max(0, int(nvml) - int(reserved))


def learned_outside_allocator_bytes(measured: Sequence[int | None]) -> int | None:
    """The offset calibration learns from the probes' measurements (the median; one probe: its own)."""
    known = [m for m in measured if m is not None]
    return int(statistics.median(known)) if known else None
