"""A search taken over by a worker on a host that differs in RAM, cores or GPU count keeps its study; another
device does not, and its error never carries the storage's password."""

from __future__ import annotations

from dataclasses import replace

import pytest
from queue_helpers import ENTRY, sgd_space

from autofit.core.errors import AutofitError
from autofit.core.recipe import Recipe
from autofit.machine.device import get_hardware
from autofit.planning.plan import Plan
from autofit.tuner.study import open_study
from autofit.workload.entry import load_workload

GIB = 2**30


def _plan(hardware, world_size: int = 4) -> Plan:  # noqa: ANN001
    return Plan.make(ENTRY, load_workload(ENTRY), hardware, sgd_space([4, 8]), world_size=world_size, global_batch=32,
                     recipe=Recipe("sgd", "fp32"))


@pytest.mark.slow
def test_hosts_differing_in_ram_cores_or_gpu_count_share_a_search_and_another_device_does_not(pg_url: str) -> None:
    url = pg_url.replace("postgres@", "postgres:Zq9-pw@", 1)
    four = replace(get_hardware("h100-80gb"), devices_per_node=4, host_memory_bytes=512 * GIB)
    open_study(_plan(four), url, "takeover", 0.1)
    eight = replace(four, devices_per_node=8, host_memory_bytes=2048 * GIB, name="h100-80gb (NVIDIA H100 80GB HBM3)")
    open_study(_plan(eight), url, "takeover", 0.1)  # more GPUs on the node and RAM, the detected name: same search
    with pytest.raises(AutofitError, match="another entry, device") as raised:
        open_study(_plan(get_hardware("a100-80gb")), url, "takeover", 0.1)
    assert "Zq9-pw" not in str(raised.value) and "postgres:***@" in str(raised.value)
    with pytest.raises(AutofitError):  # two ranks on a node instead of four: another topology
        open_study(_plan(replace(four, devices_per_node=2)), url, "takeover", 0.1)


@pytest.mark.slow
def test_cpu_hosts_differing_in_ram_and_cores_share_a_search(sqlite_url: str) -> None:
    cpu = get_hardware("cpu")
    small = replace(cpu, memory_bytes=16 * GIB, host_memory_bytes=16 * GIB, peak_flops={k: 1e11 for k in cpu.peak_flops})
    big = replace(cpu, memory_bytes=64 * GIB, host_memory_bytes=64 * GIB, peak_flops={k: 9e11 for k in cpu.peak_flops})
    open_study(_plan(small, 1), sqlite_url, "cpu", 0.1)
    open_study(_plan(big, 1), sqlite_url, "cpu", 0.1)
    with pytest.raises(AutofitError):  # a memory budget (--memory) is part of the search
        open_study(_plan(big.with_memory(GIB), 1), sqlite_url, "cpu", 0.1)
