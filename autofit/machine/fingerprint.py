"""Fingerprints: what a cached result depends on, so a changed input makes a new search.

- :func:`workload_fingerprint`: the model's structure (its module tree and every parameter's name,
  shape and dtype, built on the ``meta`` device so nothing is allocated), the shapes and dtypes of a
  one-sample batch, ``tokens_per_sample``, and the bytes of the entry's source file and of every local
  module it imports (:func:`local_sources`: the import closure of the entry file among the files under its
  folder, read from the source, so the add and the worker compute the same one). Editing the model file, a
  sibling module it imports, or a model that builds differently, changes it.
- :class:`MachineFingerprint`: the device model, its memory, the device count, the interconnect, the
  NVIDIA driver, the CUDA runtime torch was built with, NCCL and cuDNN (where CUDA), the versions of Python,
  torch, DeepSpeed, transformers, flash-attn, triton and autofit, and ``PYTORCH_CUDA_ALLOC_CONF`` (it changes
  the allocator, so the peaks). A worker detects its own (:func:`detect_machine`); any of these changing
  changes :meth:`MachineFingerprint.key`.
- :func:`request_hash`: the space, world size, global batch, ``--set`` values, memory budget and trials.

Nothing here imports torch at module level; :func:`workload_fingerprint` does, when called.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import socket
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS, Hardware
from autofit.core.hashing import digest
from autofit.machine.nvml import driver_version, nvml_records


@dataclass(frozen=True)
class MachineFingerprint:
    """One worker's machine, as far as a measured result depends on it."""

    device: str
    """Preset name of the device (``h100-80gb``, ``l4``, ``cpu``): what searches are queued for."""
    model: str
    """The device's own name (``NVIDIA H100 80GB HBM3``; the CPU's model name)."""
    memory_bytes: int
    """Memory of one device."""
    n_devices: int
    """Devices on this node."""
    interconnect: str
    """``nvlink``, ``pcie`` or ``none`` (a CPU)."""
    driver: str | None
    """NVIDIA driver version (NVML), None without one."""
    cuda: str | None
    """CUDA version torch was built with (``torch.version.cuda``)."""
    torch: str | None
    """torch's version."""
    deepspeed: str | None
    """DeepSpeed's version."""
    software: dict[str, str | None] = field(default_factory=dict)
    """Everything else a measurement depends on (:func:`software_versions`): Python, transformers, flash-attn,
    triton, autofit, NCCL, cuDNN, ``PYTORCH_CUDA_ALLOC_CONF``."""

    def key(self) -> str:
        """What the cache compares: everything but the device count (a search names the devices it uses)."""
        return digest({k: v for k, v in asdict(self).items() if k != "n_devices"})[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"key": self.key()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineFingerprint:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def device_name(hardware: Hardware) -> str:
    """The preset a detected device matches (``h100-80gb (NVIDIA H100 80GB HBM3)`` -> ``h100-80gb``)."""
    head = hardware.name.split(" ")[0]
    return head if head in PRESETS or head == "cpu" else hardware.name


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_machine(hardware: Hardware, n_devices: int | None = None) -> MachineFingerprint:
    """This machine's fingerprint for ``hardware`` (a preset or detected device); NVML where there is CUDA."""
    nvml = _nvml_facts() if hardware.kind == "cuda" else None
    torch_version = package_version("torch")
    return MachineFingerprint(
        device=device_name(hardware),
        model=nvml["model"] if nvml else _cpu_model() if hardware.kind == "cpu" else hardware.name,
        memory_bytes=nvml["memory_bytes"] if nvml else hardware.memory_bytes,
        n_devices=n_devices or (nvml["count"] if nvml else 1),
        interconnect=nvml["interconnect"] if nvml else ("none" if hardware.kind == "cpu" else "unknown"),
        driver=nvml["driver"] if nvml else None,
        cuda=_torch_cuda() if hardware.kind == "cuda" and torch_version else None,
        torch=torch_version,
        deepspeed=package_version("deepspeed"),
        software=software_versions(cuda=hardware.kind == "cuda" and torch_version is not None),
    )


def software_versions(cuda: bool) -> dict[str, str | None]:
    """The versions beyond torch's and DeepSpeed's that change a measured result (None: not installed), NCCL's
    (``torch.cuda.nccl.version``) and cuDNN's (``torch.backends.cudnn.version``) where ``cuda``, and the CUDA
    caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``: expandable segments change the peaks)."""

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        **{name: package_version(name) for name in ("transformers", "flash-attn", "triton", "autofit")},
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    if cuda:
        out |= _cuda_libraries()
    return out


def _cuda_libraries() -> dict[str, str | None]:
    import torch

    def attempt(read: Any) -> str | None:
        try:
            value = read()
        except Exception:  # no NCCL / cuDNN in this build
            return None
        return ".".join(map(str, value)) if isinstance(value, tuple) else None if value is None else str(value)

    return {"nccl": attempt(torch.cuda.nccl.version), "cudnn": attempt(torch.backends.cudnn.version)}


def _nvml_facts() -> dict[str, Any] | None:
    """Device 0's name, memory, the count, the driver and whether NVLink is up, from NVML (None without it)."""
    records = nvml_records()
    if not records:
        return None
    first = records[0]
    return {"model": first.name, "memory_bytes": first.memory_bytes, "count": len(records), "driver": driver_version(),
            "interconnect": "nvlink" if first.nvlink else "pcie"}


def _torch_cuda() -> str | None:
    import torch

    return torch.version.cuda


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def worker_name() -> str:
    """``host-pid-random``: who holds a search, as ``autofit schedule list`` shows it. The random part keeps it
    unique where host and pid repeat (containers: every worker is pid 1 of a pod named alike)."""

    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def check_device_name(name: str) -> str:
    """A hardware name a search may be queued for: a preset or ``cpu``."""
    key = name.lower()
    if key not in PRESETS and key != "cpu":
        raise AutofitError(f"a search is queued for a preset or cpu, but got hardware {name!r}; known: "
                           f"{', '.join((*PRESETS, 'cpu'))}")
    return key
