"""This machine's devices: the CPU, CUDA devices through NVML or torch, matched to the presets of
:mod:`autofit.core.hardware`.
"""

from __future__ import annotations

import os
from dataclasses import replace

from autofit.core.errors import AutofitError
from autofit.core.hardware import (
    GB,
    HARDWARE_NAMES,
    PRESETS,
    Hardware,
    _closest_preset,
    node_hardware,
    unmatched_cuda_device,
)
from autofit.machine.nvml import nvml_records, visible_cuda_devices


def get_hardware(name: str, memory_bytes: int | None = None) -> Hardware:
    """A preset, ``cpu`` (this machine's CPU) or ``auto`` (CUDA device 0 if any, else the CPU)."""
    key = name.lower()
    if key in PRESETS:
        hardware = PRESETS[key]
    elif key == "cpu":
        hardware = detect_cpu()
    elif key == "auto":
        hardware = detect_cuda() or detect_cpu()
    else:
        raise AutofitError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE_NAMES)}")
    return hardware.with_memory(memory_bytes) if memory_bytes is not None else hardware


def detect_cpu() -> Hardware:
    """This machine's CPU as the device: its RAM is the memory, its cores the compute.

    The nominal FLOP/s (cores x 2.5 GHz x 32 fp32 FLOP/cycle, AVX2 FMA) is only a
    starting point: probes calibrate an efficiency per dtype, which is how a CPU
    without native bf16 is learned rather than assumed.
    """
    total = _meminfo_bytes("MemTotal") or 8 * GB
    n_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    nominal = n_cores * 2.5e9 * 32
    peak_flops = {"fp32": nominal, "bf16": nominal} | ({"fp16": nominal} if cpu_runs_fp16() else {})
    return Hardware(
        name="cpu",
        kind="cpu",
        memory_bytes=total,
        peak_flops=peak_flops,
        memory_bandwidth_bytes_per_s=20 * GB,
        intra_node_bytes_per_s=5 * GB,  # gloo over loopback shared memory
        inter_node_bytes_per_s=1.25 * GB,
        pcie_bytes_per_s=20 * GB,  # "offload" to the same RAM: a memory copy
        nvme_bytes_per_s=2 * GB,
        context_bytes=0,
        supports_flash=False,
        host_memory_bytes=total,
    )


def cpu_runs_fp16() -> bool:
    """Whether DeepSpeed trains fp16 on this CPU: its CPU accelerator lists fp16 only where oneDNN has fp16
    kernels (deepspeed/accelerator/cpu_accelerator.py ``is_fp16_supported``), and ``deepspeed.initialize``
    refuses fp16 elsewhere ("Type fp16 is not supported on your device", runtime/engine.py)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def detect_cuda() -> Hardware | None:
    """The node's CUDA devices, every one of them through NVML (:func:`node_hardware`), else device 0
    through torch matched to the closest preset by name and memory; None without CUDA."""
    records = nvml_records()
    matched = node_hardware(records) if records else None
    if matched is not None:
        return with_this_host(matched)
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    closest = _closest_preset(props.name, props.total_memory)
    if closest is not None:
        key, preset = closest
        return with_this_host(replace(preset, name=f"{key} ({props.name})", memory_bytes=props.total_memory,
                                      compute_capability=(props.major, props.minor)))
    return with_this_host(unmatched_cuda_device(props.name, props.total_memory, (props.major, props.minor)))


def with_this_host(hardware: Hardware) -> Hardware:
    """``hardware`` (a preset matched to this node's GPUs) with this node's host memory, not the preset's: an
    H100 cloud node may have 128 GiB where the preset's DGX H100 has 2 TB, and offload and the host's builds are
    priced against it."""
    total = _meminfo_bytes("MemTotal")
    return replace(hardware, host_memory_bytes=total) if total else hardware


def cuda_devices_here() -> int:
    """CUDA devices this process may use: ``CUDA_VISIBLE_DEVICES`` where set, else NVML's count
    (:func:`autofit.machine.nvml.visible_cuda_devices`), else torch's (``torch.cuda.device_count``); 0 without CUDA."""

    visible = visible_cuda_devices()
    if visible is not None:
        return visible
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count())


def _meminfo_bytes(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
