"""Device memory as the device sees it: NVML's per-process figure for a rank, sampled in a thread.

docs/design.md's CUDA memory contract ("Memory, measured"): ``peak_bytes`` is the most device memory NVML reports for the
rank's pid (``nvmlDeviceGetComputeRunningProcesses``) on the rank's own device, sampled from just
after the CUDA context exists through the measured steps: the context, NCCL's buffers, cuBLAS
workspaces and the caching allocator's reservations together. The device is found by UUID (torch's
``get_device_properties(i).uuid`` for the logical device ``i``), so ``CUDA_VISIBLE_DEVICES`` and
CUDA's own device order (``CUDA_DEVICE_ORDER``, FASTEST_FIRST by default, which NVML's indices do
not follow) cannot pick the wrong GPU; where the UUID is unknown ``CUDA_VISIBLE_DEVICES`` is read.

NVML reports pids of the host's pid namespace: inside a container the rank's own pid may not
appear. Then there is no NVML figure and the meter falls back to ``max_memory_reserved`` plus the
context (:mod:`autofit.probe.rank.meter`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from autofit.core.hardware import DeviceRecord

#: seconds between two NVML reads (a read costs ~0.1 ms; a training step at least milliseconds)
SAMPLE_INTERVAL_S = 0.005


def nvml_uuid(torch_uuid: str) -> str:
    """NVML's spelling of a device UUID (``GPU-xxxxxxxx-...``) from torch's (no prefix)."""
    text = str(torch_uuid).strip()
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def visible_device(cuda_visible_devices: str | None, local_index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry (an NVML index or a UUID) that logical device ``local_index`` is.

    Unset: the logical index is the physical one. CUDA reads the list up to its first invalid entry
    (an empty one here); a logical index past the list has no device.
    """
    if cuda_visible_devices is None:
        return str(local_index)
    entries = visible_device_entries(cuda_visible_devices)
    if local_index >= len(entries):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} has no device {local_index}")
    return entries[local_index]


def visible_device_entries(cuda_visible_devices: str) -> list[str]:
    """``CUDA_VISIBLE_DEVICES``'s entries (NVML indices or UUIDs), up to the first invalid one (an empty one
    here), where CUDA stops reading the list."""
    entries: list[str] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if not entry:
            break
        entries.append(entry)
    return entries


def process_used_bytes(processes: Iterable[Any], pid: int) -> int | None:
    """Device bytes NVML lists for ``pid`` (its rows summed), or None when it lists none for it.

    A row's ``usedGpuMemory`` is None where NVML cannot tell (NVML_VALUE_NOT_AVAILABLE, e.g. on
    Windows under WDDM); such rows count as unknown, not as zero.
    """
    used = [row.usedGpuMemory for row in processes if row.pid == pid]
    known = [int(u) for u in used if u is not None]
    return sum(known) if known else None


def open_handle(pynvml: Any, torch_uuid: str | None, cuda_visible_devices: str | None, local_index: int) -> Any:
    """The NVML handle of the rank's device: by torch's UUID, else through ``CUDA_VISIBLE_DEVICES``."""
    if torch_uuid:
        return pynvml.nvmlDeviceGetHandleByUUID(nvml_uuid(torch_uuid))
    entry = visible_device(cuda_visible_devices, local_index)
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)


class ProcessMemorySampler:
    """A daemon thread that reads ``read()`` (bytes or None) every ``interval_s`` and keeps the largest."""

    def __init__(self, read: Callable[[], int | None], interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.read = read
        self.interval_s = interval_s
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autofit-nvml-sampler", daemon=True)

    def start(self) -> ProcessMemorySampler:
        self.sample()
        self._thread.start()
        return self

    def sample(self) -> int | None:
        try:
            value = self.read()
        except Exception:  # NVML errors mid-run (a driver hiccup) lose one sample, not the probe
            return None
        if value is not None:
            self.peak_bytes = value if self.peak_bytes is None else max(self.peak_bytes, value)
        return value

    def stop(self) -> int | None:
        """Stop, take a last sample, and return the peak (None: NVML never listed the process)."""
        self._stop.set()
        self._thread.join(timeout=1.0)
        self.sample()
        return self.peak_bytes

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


def start_sampler(torch: Any, local_index: int, pid: int, cuda_visible_devices: str | None) -> ProcessMemorySampler | None:
    """Sample NVML's figure for ``pid`` on the rank's device; None without NVML (pynvml, the driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        torch_uuid = str(getattr(torch.cuda.get_device_properties(local_index), "uuid", "") or "")
        handle = open_handle(pynvml, torch_uuid or None, cuda_visible_devices, local_index)
    except Exception:  # no pynvml, no driver library, or an unknown device: no NVML figure
        return None
    return ProcessMemorySampler(lambda: process_used_bytes(pynvml.nvmlDeviceGetComputeRunningProcesses(handle), pid)).start()


def visible_cuda_devices() -> int | None:
    """CUDA devices this process may use: ``CUDA_VISIBLE_DEVICES`` where set, else what NVML counts."""
    listed = visible_cuda_device_list()
    return len(listed) if listed is not None else None


def visible_cuda_device_list() -> list[str] | None:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` entries: its own entries where set
    (up to the first empty one, where CUDA stops reading), else NVML's indices; None where neither is known."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return visible_device_entries(listed)
    records = nvml_records()
    return [str(i) for i in range(len(records))] if records is not None else None


def nvml_records() -> list[DeviceRecord] | None:
    """Every device NVML sees (honouring ``CUDA_VISIBLE_DEVICES`` only as NVML does: not at all), or
    None where NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
        records = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            records.append(
                DeviceRecord(
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    nvlink=any_nvlink(pynvml, handle),
                )
            )
        return records
    except Exception:  # no driver, no pynvml, no NVML in the container
        return None


def any_nvlink(pynvml: Any, handle: Any) -> bool:
    """Whether any of the device's NVLinks is active (an SXM board; a PCIe card answers NOT_SUPPORTED per link)."""
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                return True
        except pynvml.NVMLError:  # link not present (a PCIe card answers NOT_SUPPORTED)
            continue
    return False


def driver_version() -> str | None:
    """The NVIDIA driver's version from NVML; None without NVML."""
    try:
        import pynvml  # nvidia-ml-py, the optional 'cuda' extra

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # no driver, no pynvml, no NVML in the container
        return None
    return version.decode() if isinstance(version, bytes) else str(version)
