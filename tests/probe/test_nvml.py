"""The pure parts of the CUDA memory contract, on the CPU: which device, which NVML row, the budget cap.

NVML rows are built with pynvml's own structs and its own conversion (what
``nvmlDeviceGetComputeRunningProcesses`` returns); the GPU half is in ``test_cuda.py``.
"""

from __future__ import annotations

import os
import time
import uuid
from types import SimpleNamespace

import pytest

from autofit.machine.nvml import ProcessMemorySampler, nvml_uuid, process_used_bytes, visible_device
from autofit.probe.rank.meter import Meter, allocator_fraction

pynvml = pytest.importorskip("pynvml")


def row(pid: int, used: int | None):
    """One process row as pynvml hands it out (``None`` where NVML says NVML_VALUE_NOT_AVAILABLE)."""
    raw = used if used is not None else pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    obj = pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_t(pid=pid, usedGpuMemory=raw))
    if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        obj.usedGpuMemory = None
    return obj


def test_the_rank_reads_its_own_row():
    me = os.getpid()
    rows = [row(me + 1, 70 * 2**30), row(me, 3 * 2**30), row(me + 2, 2**30)]
    assert process_used_bytes(rows, me) == 3 * 2**30  # not the other tenants', not total - free
    assert process_used_bytes(rows, me + 7) is None  # no row: unknown (a container's pid namespace)
    assert process_used_bytes([row(me, None)], me) is None  # NVML_VALUE_NOT_AVAILABLE is unknown, not 0


def test_cuda_visible_devices_maps_the_logical_device():
    assert visible_device(None, 1) == "1"
    assert visible_device("3,1", 0) == "3" and visible_device("3,1", 1) == "1"
    gpu = f"GPU-{uuid.uuid4()}"
    assert visible_device(f"{gpu},2", 0) == gpu
    with pytest.raises(ValueError):
        visible_device("4,,5", 1)  # CUDA stops at the first invalid entry
    with pytest.raises(ValueError):
        visible_device("0", 1)


def test_uuids_are_spelled_as_nvml_spells_them():
    device = uuid.uuid4()
    assert nvml_uuid(str(device)) == f"GPU-{device}"
    assert nvml_uuid(f"GPU-{device}") == f"GPU-{device}"
    assert nvml_uuid(f"MIG-{device}") == f"MIG-{device}"


def test_the_sampler_keeps_the_peak_of_what_it_read():
    readings = iter([1, 5, 3, None] + [2] * 1000)
    sampler = ProcessMemorySampler(lambda: next(readings), interval_s=0.001).start()
    time.sleep(0.05)
    assert sampler.stop() == 5
    failing = ProcessMemorySampler(lambda: 1 // 0).start()  # an NVML error loses samples, not the probe
    assert failing.stop() is None


def test_reading_the_peak_at_a_checkpoint_keeps_the_sampler_running():
    """The probe reads the peak after the build and after ``deepspeed.initialize``; NVML must go on sampling
    through the steps, where the peak is (a read that stopped the sampler lost everything after the build)."""
    level = [1]
    meter = Meter.__new__(Meter)  # a CUDA meter without a GPU: the NVML sampler and an allocator that reports 0
    meter.cuda, meter.context_bytes = True, 0
    meter.torch = SimpleNamespace(cuda=SimpleNamespace(max_memory_reserved=lambda: 0))
    meter.sampler = ProcessMemorySampler(lambda: level[0], interval_s=0.001).start()
    assert meter.peak_bytes(final=False) == 1
    level[0] = 7
    time.sleep(0.05)
    level[0] = 2
    assert meter.peak_bytes(final=False) == 7
    assert meter.peak_bytes() == 7


def test_memory_budget_caps_the_allocator_at_the_budget_less_the_context():
    gib = 2**30
    assert allocator_fraction(80 * gib, gib // 2, 80 * gib) is None  # the whole card: nothing to enforce
    fraction = allocator_fraction(40 * gib, gib // 2, 80 * gib)
    assert fraction is not None and fraction * 80 * gib + gib // 2 == pytest.approx(40 * gib)
    assert allocator_fraction(gib // 4, gib // 2, 80 * gib) == 0.0
