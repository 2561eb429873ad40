"""Hardware presets, detection and the fingerprint."""

from __future__ import annotations

import pytest

from autofit.core.errors import AutofitError
from autofit.core.hardware import HARDWARE_NAMES, PRESETS, Hardware, default_gpus
from autofit.machine.device import cuda_devices_here, detect_cpu, get_hardware

PRESET_NAMES = ["h100-80gb", "h100-pcie-80gb", "h200", "a100-40gb", "a100-80gb", "l4", "rtx4090"]


def test_the_documented_names_exist():
    assert set(PRESET_NAMES) <= set(PRESETS)
    assert {*PRESET_NAMES, "cpu", "auto"} <= set(HARDWARE_NAMES)


@pytest.mark.parametrize("name", [*PRESET_NAMES, "cpu", "auto"])
def test_every_name_resolves_to_valid_hardware(name):
    hardware = get_hardware(name)
    assert isinstance(hardware, Hardware)
    assert hardware.memory_bytes > 0
    assert hardware.supports_precision("fp32")
    assert all(value > 0 for value in hardware.peak_flops.values())
    assert hardware.to_dict()["fingerprint"] == hardware.fingerprint()


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_are_cuda_with_flash_and_bf16(name):
    hardware = PRESETS[name]
    assert hardware.name == name
    assert hardware.kind == "cuda"
    assert hardware.supports_flash
    assert hardware.supports_precision("bf16")
    assert hardware.context_bytes > 0
    # bf16 tensor cores outrun fp32 on every one of them
    assert hardware.peak_flops["bf16"] > hardware.peak_flops["fp32"]
    # a measured ceiling or anchored step efficiency is a share of the datasheet's; 0 where none is sourced
    assert 0.0 <= hardware.matmul_ceiling <= 1.0
    assert 0.0 <= hardware.step_efficiency <= 1.0


@pytest.mark.parametrize(
    ("name", "fp8"),
    [("h100-80gb", True), ("h100-pcie-80gb", True), ("h200", True), ("a100-40gb", False), ("l4", True)],
)
def test_fp8_only_where_the_hardware_has_it(name, fp8):
    assert PRESETS[name].supports_precision("fp8") == fp8


def test_memory_sizes_are_ordered_as_the_cards():
    mem = {name: PRESETS[name].memory_bytes for name in PRESET_NAMES}
    assert mem["a100-40gb"] < mem["a100-80gb"]
    assert mem["h100-80gb"] == mem["h100-pcie-80gb"] < mem["h200"]
    assert mem["l4"] < mem["rtx4090"] < mem["a100-40gb"]


def test_cpu_is_the_process():
    cpu = detect_cpu()
    assert cpu.kind == "cpu"
    assert not cpu.supports_flash
    assert not cpu.supports_precision("fp8")
    assert cpu.context_bytes == 0


def test_cpu_offers_exactly_the_precisions_deepspeeds_cpu_accelerator_trains():
    """fp16 only where DeepSpeed's CPU accelerator has it (``deepspeed.initialize`` refuses it elsewhere)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = CPU_Accelerator()
    offered = set(detect_cpu().peak_flops)
    assert ("fp16" in offered) == bool(accelerator.is_fp16_supported())
    assert ("bf16" in offered) == bool(accelerator.is_bf16_supported())


def test_names_are_case_insensitive():
    assert get_hardware("H100-80GB") == PRESETS["h100-80gb"]


@pytest.mark.parametrize("name", ["h100", "v100", "", "gpu"])
def test_unknown_hardware_names_it_and_lists_the_known(name):
    with pytest.raises(AutofitError) as info:
        get_hardware(name)
    assert repr(name) in str(info.value)
    assert "h100-80gb" in str(info.value)


def test_fingerprint_is_stable_and_short():
    a, b = get_hardware("a100-40gb"), get_hardware("a100-40gb")
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16
    assert a.fingerprint() != get_hardware("a100-80gb").fingerprint()


def test_fingerprint_changes_with_memory():
    h100 = PRESETS["h100-80gb"]
    smaller = h100.with_memory(h100.memory_bytes - 2**30)
    assert smaller.fingerprint() != h100.fingerprint()
    assert smaller.with_memory(h100.memory_bytes).fingerprint() == h100.fingerprint()


def test_with_memory_changes_only_memory():
    h100 = PRESETS["h100-80gb"]
    smaller = h100.with_memory(2 * 2**30)
    assert smaller.memory_bytes == 2 * 2**30
    assert smaller.peak_flops == h100.peak_flops and smaller.name == h100.name
    assert h100.memory_bytes != smaller.memory_bytes  # the preset itself is untouched
    assert get_hardware("h100-80gb", memory_bytes=2 * 2**30) == smaller


@pytest.mark.parametrize("memory_bytes", [0, -1])
def test_with_memory_refuses_no_memory(memory_bytes):
    with pytest.raises(AutofitError, match=repr(memory_bytes)):
        PRESETS["l4"].with_memory(memory_bytes)


def test_hardware_validates_its_kind():
    with pytest.raises(AutofitError, match="tpu"):
        Hardware(name="x", kind="tpu", memory_bytes=1)


def _h100(name: str = "NVIDIA H100 80GB HBM3", nvlink: bool = True):  # noqa: ANN202
    from autofit.core.hardware import DeviceRecord

    return DeviceRecord(name=name, memory_bytes=81559 * 2**20, nvlink=nvlink)


def test_node_detection_reads_every_device_and_tells_pcie_from_sxm():
    from autofit.core.hardware import PRESETS, DeviceRecord, node_hardware

    sxm = node_hardware([_h100() for _ in range(8)])
    assert sxm.devices_per_node == 8
    assert sxm.intra_node_bytes_per_s == PRESETS["h100-80gb"].intra_node_bytes_per_s
    pcie = node_hardware([_h100("NVIDIA H100 PCIe", nvlink=False) for _ in range(4)])
    assert pcie.name == "h100-pcie-80gb (NVIDIA H100 PCIe)" and pcie.devices_per_node == 4
    assert pcie.intra_node_bytes_per_s == PRESETS["h100-80gb"].pcie_bytes_per_s < sxm.intra_node_bytes_per_s
    # its own FLOPs and bandwidth (the datasheet's PCIe column), not SXM's
    assert pcie.peak_flops["bf16"] < sxm.peak_flops["bf16"] and pcie.peak_flops["fp32"] < sxm.peak_flops["fp32"]
    assert pcie.memory_bandwidth_bytes_per_s < sxm.memory_bandwidth_bytes_per_s
    bridged = node_hardware([_h100("NVIDIA H100 PCIe", nvlink=True) for _ in range(2)])  # an NVLink bridge pairs two
    assert bridged.peak_flops == pcie.peak_flops
    # a PCIe card of a family with no PCIe preset keeps the family's figures, with PCIe's links
    a100 = node_hardware([DeviceRecord("NVIDIA A100-PCIE-40GB", 40960 * 2**20, nvlink=False)])
    assert a100.name == "a100-40gb PCIe (NVIDIA A100-PCIE-40GB)"
    assert a100.intra_node_bytes_per_s == PRESETS["a100-40gb"].pcie_bytes_per_s


def test_a_lone_sxm_device_without_active_links_keeps_its_name_and_this_hosts_memory(monkeypatch):
    """As a lent H100 machine showed it (2026-11-27): one NVIDIA H100 80GB HBM3, no NVLink active (no peer), 128 GiB
    of host memory. It is the SXM part, not "PCIe"; its host memory is the machine's, not a DGX's 2 TB."""
    import autofit.machine.device as device
    from autofit.core.hardware import PRESETS, node_hardware

    alone = node_hardware([_h100(nvlink=False)])
    assert alone.name == "h100-80gb (NVIDIA H100 80GB HBM3)" and alone.peak_flops == PRESETS["h100-80gb"].peak_flops
    monkeypatch.setattr(device, "nvml_records", lambda: [_h100(nvlink=False)])
    detected = device.detect_cuda()
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    assert detected.host_memory_bytes == total != PRESETS["h100-80gb"].host_memory_bytes


@pytest.mark.slow
def test_the_h100_pcie_preset_prices_a_slower_step_than_sxm():
    from autofit.core.config import Config
    from autofit.cost_model import predict
    from tests.toy_facts import FACTS

    config = Config(precision="bf16", micro_batch_size=2, grad_accum_steps=1)
    sxm = predict(config, FACTS, PRESETS["h100-80gb"])
    pcie = predict(config, FACTS, PRESETS["h100-pcie-80gb"])
    assert pcie.step_time_s > sxm.step_time_s


def test_a_mixed_node_is_one_line_of_error():
    from autofit.core.hardware import node_hardware

    with pytest.raises(AutofitError, match="mixed node") as caught:
        node_hardware([_h100(), _h100("NVIDIA H100 PCIe", nvlink=False)])
    assert "\n" not in str(caught.value)
    with pytest.raises(AutofitError, match="no CUDA device"):
        node_hardware([])


@pytest.mark.parametrize(
    ("gpus", "hardware", "kind", "detected", "expected"),
    [
        (None, "auto", "cuda", 8, 8),  # auto on a CUDA machine: every visible GPU
        (None, "AUTO", "cuda", 2, 2),
        (3, "auto", "cuda", 8, 3),  # what the user gave wins
        (None, "auto", "cpu", None, 1),  # auto found no CUDA: the CPU is one device
        (None, "auto", "cuda", 0, 1),  # detection counted nothing (CUDA_VISIBLE_DEVICES="")
        (None, "h100-80gb", "cuda", 8, 1),  # a preset plans for one device unless told more
        (4, "h100-80gb", "cuda", None, 4),
        (None, "cpu", "cpu", None, 1),
    ],
)
def test_gpus_default_to_what_detection_found_only_with_auto(gpus, hardware, kind, detected, expected):
    assert default_gpus(gpus, hardware, kind, detected) == expected


def test_the_h100_pcie_card_is_a_preset_of_its_own():
    from autofit.core.hardware import node_hardware

    pcie = node_hardware([_h100("NVIDIA H100 PCIe", nvlink=False) for _ in range(2)])
    assert pcie.name == "h100-pcie-80gb (NVIDIA H100 PCIe)"
    assert pcie.peak_flops["bf16"] < PRESETS["h100-80gb"].peak_flops["bf16"]
    assert pcie.memory_bandwidth_bytes_per_s < PRESETS["h100-80gb"].memory_bandwidth_bytes_per_s
    assert node_hardware([_h100()]).name == "h100-80gb (NVIDIA H100 80GB HBM3)"  # the SXM part keeps its preset


def test_the_probe_lists_the_visible_devices_as_the_meter_maps_them(monkeypatch):
    """autofit.probe.run's device list and autofit.machine.nvml.visible_device read CUDA_VISIBLE_DEVICES alike: to its
    first empty entry, where CUDA stops."""
    from autofit.machine.nvml import visible_cuda_device_list, visible_device

    for listed, entries in (("3, 1", ["3", "1"]), ("4,,5", ["4"]), ("", [])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
        assert visible_cuda_device_list() == entries and cuda_devices_here() == len(entries)
        assert [visible_device(listed, i) for i in range(len(entries))] == entries
