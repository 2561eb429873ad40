"""A worker's checks before it starts, claims and imports: the pure functions with real-looking inputs, and the
command on this CPU machine."""

from __future__ import annotations

from dataclasses import replace

import pytest
from click.testing import CliRunner

from autofit.cli import main
from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS, DeviceRecord, node_hardware
from autofit.schedule.checks import check_device, detected_devices, preset_matches

MIB = 2**20
H100_SXM = ("NVIDIA H100 80GB HBM3", 81559 * MIB)
H100_PCIE = ("NVIDIA H100 PCIe", 81559 * MIB)
A100_80 = ("NVIDIA A100-SXM4-80GB", 81920 * MIB)
A100_40 = ("NVIDIA A100-SXM4-40GB", 40960 * MIB)
L40S = ("NVIDIA L40S", 46068 * MIB)


def test_a_gpu_preset_passes_only_on_its_own_gpu() -> None:
    check_device("h100-80gb", [H100_SXM] * 8)
    check_device("H100-PCIE-80GB", [H100_PCIE] * 2)
    check_device("a100-40gb", [A100_40])
    check_device("auto", [A100_80])
    check_device("cpu", [A100_80])  # CPU probes run on a GPU machine too
    check_device("cpu", [])


@pytest.mark.parametrize(("preset", "devices", "says"), [
    ("h100-80gb", [A100_80] * 8, "NVIDIA A100-SXM4-80GB (80 GiB): start it with --hardware a100-80gb"),
    ("a100-80gb", [A100_40], "--hardware a100-40gb"),  # the family right, the memory not
    ("h100-80gb", [H100_PCIE], "--hardware h100-pcie-80gb"),  # the PCIe card is not the SXM part
    ("h100-pcie-80gb", [H100_SXM], "--hardware h100-80gb"),
    ("l4", [L40S], "NVIDIA L40S (45 GiB): start it with --hardware auto"),  # "l4" in "l40s", not its memory
    ("h100-80gb", [H100_SXM, A100_80], "A100"),  # one wrong device of a node is enough
    ("h100-80gb", [], "no CUDA device"),
])
def test_a_gpu_preset_on_another_gpu_is_refused_in_one_line(preset: str, devices: list, says: str) -> None:
    with pytest.raises(AutofitError, match=f"worker --hardware {preset}") as raised:
        check_device(preset, devices)
    assert says in str(raised.value) and "\n" not in str(raised.value)



@pytest.mark.parametrize("device", [H100_SXM, H100_PCIE, A100_80, A100_40, L40S, ("NVIDIA A100 80GB PCIe", 81920 * MIB)])
def test_a_worker_accepts_exactly_the_preset_detection_gives_its_gpu(device: tuple[str, int]) -> None:
    detected = node_hardware([DeviceRecord(device[0], device[1], nvlink="PCIe" not in device[0])])
    accepted = [key for key in PRESETS if preset_matches(key, *device)]  # one rule for both
    assert accepted == ([detected.name.split(" ")[0]] if detected else [])

def test_the_worker_command_refuses_a_gpu_preset_on_this_cpu_machine_and_starts_with_cpu(sqlite_url: str) -> None:
    assert detected_devices() == []  # no GPU here
    runner = CliRunner()
    refused = runner.invoke(main, ["worker", "--storage", sqlite_url, "--hardware", "h100-80gb", "--idle-exit", "0"])
    assert refused.exit_code == 1 and "no CUDA device" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
    started = runner.invoke(main, ["worker", "--storage", sqlite_url, "--hardware", "cpu", "--idle-exit", "0"])
    assert started.exit_code == 0, started.output


def test_a_cuda_worker_runs_one_node_and_a_cpu_worker_simulates_nodes_here() -> None:
    from autofit.schedule.checks import check_nodes

    check_nodes("cuda", 1)
    check_nodes("cpu", 4)  # agents on loopback, as `autofit run --nodes 4 --hardware cpu`
    with pytest.raises(AutofitError, match="--nodes 2: .* one worker per node"):
        check_nodes("cuda", 2)
    refused = CliRunner().invoke(main, ["worker", "--storage", "sqlite:///unused.db", "--hardware", "h100-80gb",
                                        "--nodes", "2"])
    assert refused.exit_code == 1 and "--nodes 2" in refused.output


def test_a_worker_claims_no_search_over_more_nodes_than_it_launches(sqlite_url: str) -> None:
    from autofit.machine.device import get_hardware
    from autofit.machine.fingerprint import detect_machine
    from autofit.schedule import queue
    from autofit.schedule.request import SearchRequest

    request = SearchRequest(entry="m.py:f", hardware="cpu", gpus=1, nodes=2, global_batch=8, space={}, space_name="s",
                            fixed={}, trials=2)
    search_id = queue.add_search(sqlite_url, request, "wfp").id
    machine = detect_machine(get_hardware("cpu"))
    assert queue.claim(sqlite_url, "one-node", machine, nodes=1) is None
    held = queue.claim(sqlite_url, "two-nodes", machine, nodes=2)
    assert held is not None and held.id == search_id


def test_a_worker_plans_a_multi_node_search_with_the_devices_per_node_it_was_queued_with() -> None:
    from queue_helpers import ENTRY, sgd_space

    from autofit.core.recipe import Recipe
    from autofit.machine.device import get_hardware
    from autofit.schedule.submit import make_request
    from autofit.schedule.worker import plan_for
    from autofit.workload.entry import load_workload
    from autofit.workload.sources import workload_fingerprint

    detected = get_hardware("l4")  # a node of 8 (a worker's detected hardware counts its node's GPUs)
    request = make_request(ENTRY, detected, gpus=2, nodes=2, global_batch=32, space=sgd_space([4, 8]), fixed={},
                           trials=2, memory_bytes=None, recipe=Recipe("sgd", "fp32"))
    plan = plan_for(request, workload_fingerprint(ENTRY, load_workload(ENTRY)), replace(detected, devices_per_node=8))
    assert plan.world_size == 4 and plan.hardware.devices_per_node == 2 and plan.hardware.n_nodes(4) == 2
