"""Devices: presets, detection and a stable fingerprint.

Figures are vendor datasheet numbers for dense math (no sparsity):
NVIDIA H100 SXM5 / H200 / A100 / L4 / RTX 4090 datasheets and the Ada and
Hopper architecture whitepapers. Memory is what ``nvidia-smi`` reports as total
(MiB). A CPU preset makes no assumption about bf16 speed: it claims the same
nominal FLOP/s for every dtype, and probes calibrate the truth.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from autofit.core.errors import AutofitError

GB = 10**9
MIB = 2**20
TFLOPS = 10**12
#: where :attr:`Hardware.matmul_ceiling` comes from: Stas Bekman's mamf-finder.py runs, "Maximum Achievable Matmul
#: FLOPS comparison table" (bf16, CUDA 12.1-12.5): A100 SXM 267.9 of 312 TFLOPS (85.9 %), H100 SXM 792.1 of 989
#: (80.1 %), GH200 821.0 of 989 (83.0 %), A100 PCIe 256.4 of 312 (82.2 %)
MAMF_SOURCE = ("https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md"
               "#maximum-achievable-matmul-flops-comparison-table")
#: where :attr:`Hardware.step_efficiency` comes from: one run per GPU, Llama-2-7B, sequence 4096, batch 2 a GPU, no
#: checkpointing, PyTorch FSDP: 3,700 tokens/s a GPU on 128 A100 80GB, 7,500 on 96 H100 80GB (Table 1); over the
#: prior at 1.0 (``python -m benchmarks.accuracy.published_gpu --anchors``): A100 0.80, H100 0.63. Those two rows are left
#: out of that benchmark's errors
STEP_EFFICIENCY_SOURCE = "https://pytorch.org/blog/maximizing-training/"


@dataclass(frozen=True)
class Hardware:
    """One device of a training job, and how it is connected."""

    name: str
    """Preset name (``h100-80gb``) or ``cpu``/detected name."""
    kind: str
    """``cuda`` or ``cpu``: decides how memory is measured and what a probe launches."""
    memory_bytes: int
    """Memory one training process may use on the device."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    """Dense peak FLOP/s per compute dtype (fp32, bf16, fp16, fp8); a missing dtype is unsupported."""
    matmul_ceiling: float = 0.0
    """The most of ``peak_flops`` a matmul reaches here, measured: the maximum achievable matmul FLOP/s (MAMF)
    over the datasheet's, bf16, best shape (:data:`MAMF_SOURCE`); 0: not measured for this device."""
    step_efficiency: float = 0.0
    """How much of that roofline (matmuls at ``matmul_ceiling``, the other kernels at the achieved bandwidth) a
    whole training step reaches here: a published run's measured throughput over what autofit's prior predicts for
    it at 1.0 (:data:`STEP_EFFICIENCY_SOURCE`); launch gaps, shapes below the best, synchronisation, clocks under
    sustained load. 0: no run anchors this device."""
    memory_bandwidth_bytes_per_s: float = 0.0
    """Device memory bandwidth."""
    intra_node_bytes_per_s: float = 0.0
    """Per-device bus bandwidth between devices of a node (NVLink; PCIe where there is none)."""
    inter_node_bytes_per_s: float = 0.0
    """Per-device network bandwidth between nodes."""
    pcie_bytes_per_s: float = 0.0
    """Host <-> device bandwidth, one direction (what CPU offload moves over)."""
    nvme_bytes_per_s: float = 0.0
    """NVMe read/write bandwidth (what NVMe offload moves over)."""
    context_bytes: int = 0
    """Memory the runtime takes before any tensor (the CUDA context); 0 on the CPU."""
    supports_flash: bool = False
    """Whether flash attention kernels run here (CUDA, sm80 and newer)."""
    host_memory_bytes: int = 0
    """Host RAM of one node: every rank's process, model build and offloaded states share it."""
    devices_per_node: int = 0
    """Devices (ranks) that share one node, ``--gpus``; 0: every rank on one node."""
    compute_capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor): the preset's, or the device's where torch detected it; None on the
    CPU. What the libraries decide by (cuBLAS's workspace size, :mod:`autofit.cost_model.cuda_runtime`)."""

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise AutofitError(f"hardware kind must be cuda or cpu, but got {self.kind!r}")
        if self.memory_bytes <= 0:
            raise AutofitError(f"hardware memory must be positive, but got {self.memory_bytes!r}")
        if self.devices_per_node < 0:
            raise AutofitError(f"devices_per_node must be >= 0, but got {self.devices_per_node!r}")
        if self.compute_capability is not None:  # a JSON round trip gives a list
            object.__setattr__(self, "compute_capability", tuple(self.compute_capability))

    def ranks_on_a_node(self, world_size: int) -> int:
        """Ranks that share one node's host and intra-node links."""
        return min(world_size, self.devices_per_node) if self.devices_per_node > 0 else world_size

    def n_nodes(self, world_size: int) -> int:
        """Nodes a job of ``world_size`` ranks spans."""
        per_node = self.ranks_on_a_node(world_size)
        return -(-world_size // per_node)

    def supports_precision(self, precision: str) -> bool:
        return precision in self.peak_flops

    def with_memory(self, memory_bytes: int) -> Hardware:
        return replace(self, memory_bytes=memory_bytes)

    def fingerprint(self) -> str:
        """A stable short hash of everything that changes a prediction."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """JSON's own types (the capability a list), and the fingerprint."""
        data = asdict(self)
        if data["compute_capability"] is not None:
            data["compute_capability"] = list(data["compute_capability"])
        return data | {"fingerprint": self.fingerprint()}


def _hopper(name: str, memory_mib: int, bandwidth: float, matmul_ceiling: float = 0.801) -> Hardware:
    """An H100 SXM's datasheet; its step efficiency anchored on H100 80GB SXM (``STEP_EFFICIENCY_SOURCE``)."""
    return Hardware(
        name=name,
        kind="cuda",
        memory_bytes=memory_mib * MIB,
        peak_flops={"fp32": 67 * TFLOPS, "bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "fp8": 1979 * TFLOPS},
        matmul_ceiling=matmul_ceiling,  # H100 SXM (MAMF_SOURCE)
        step_efficiency=0.63,
        memory_bandwidth_bytes_per_s=bandwidth,
        intra_node_bytes_per_s=450 * GB,  # NVLink 4: 900 GB/s bidirectional
        inter_node_bytes_per_s=50 * GB,  # 400 Gb/s InfiniBand NDR per GPU
        pcie_bytes_per_s=64 * GB,  # PCIe Gen5 x16, one direction
        nvme_bytes_per_s=6 * GB,
        context_bytes=530 * MIB,
        supports_flash=True,
        host_memory_bytes=2048 * GB,
        compute_capability=(9, 0),
    )


def _ampere(name: str, memory_mib: int, bandwidth: float) -> Hardware:
    return Hardware(
        name=name,
        kind="cuda",
        memory_bytes=memory_mib * MIB,
        peak_flops={"fp32": 19.5 * TFLOPS, "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS},
        matmul_ceiling=0.859,  # A100 SXM (MAMF_SOURCE)
        step_efficiency=0.80,  # A100 80GB (STEP_EFFICIENCY_SOURCE)
        memory_bandwidth_bytes_per_s=bandwidth,
        intra_node_bytes_per_s=300 * GB,  # NVLink 3: 600 GB/s bidirectional
        inter_node_bytes_per_s=25 * GB,  # 200 Gb/s HDR per GPU
        pcie_bytes_per_s=32 * GB,  # PCIe Gen4 x16
        nvme_bytes_per_s=5 * GB,
        context_bytes=480 * MIB,
        supports_flash=True,
        compute_capability=(8, 0),
        host_memory_bytes=1024 * GB,
    )


def _hopper_pcie(name: str, memory_mib: int) -> Hardware:
    """H100 PCIe (NVIDIA H100 Tensor Core GPU datasheet, "H100 PCIe" column; 300-350 W): FP32 51 TFLOPS,
    BF16/FP16 1,513 and FP8 3,026 TFLOPS with sparsity, so 756 and 1,513 dense; HBM2e at 2 TB/s; PCIe Gen5
    128 GB/s (64 one direction). Its NVLink bridge joins pairs only, so the node's links are PCIe's."""
    return replace(
        _hopper(name, memory_mib, 2.0e12),
        peak_flops={"fp32": 51 * TFLOPS, "bf16": 756 * TFLOPS, "fp16": 756 * TFLOPS, "fp8": 1513 * TFLOPS},
        matmul_ceiling=0.0,  # not measured
        intra_node_bytes_per_s=64 * GB,
    )


PRESETS: dict[str, Hardware] = {
    "h100-80gb": _hopper("h100-80gb", 81559, 3.35e12),
    "h100-pcie-80gb": _hopper_pcie("h100-pcie-80gb", 81559),
    "h200": _hopper("h200", 143771, 4.8e12, matmul_ceiling=0.830),  # GH200's: the same GH100 die with HBM3e
    "a100-40gb": _ampere("a100-40gb", 40960, 1.555e12),
    "a100-80gb": _ampere("a100-80gb", 81920, 2.039e12),
    "l4": Hardware(
        name="l4",
        kind="cuda",
        memory_bytes=23034 * MIB,
        peak_flops={"fp32": 30.3 * TFLOPS, "bf16": 121 * TFLOPS, "fp16": 121 * TFLOPS, "fp8": 242.5 * TFLOPS},
        memory_bandwidth_bytes_per_s=300 * GB,
        intra_node_bytes_per_s=32 * GB,  # no NVLink: PCIe Gen4
        inter_node_bytes_per_s=12.5 * GB,
        pcie_bytes_per_s=32 * GB,
        nvme_bytes_per_s=3 * GB,
        context_bytes=400 * MIB,
        supports_flash=True,
        host_memory_bytes=256 * GB,
        compute_capability=(8, 9),
    ),
    "rtx4090": Hardware(
        name="rtx4090",
        kind="cuda",
        memory_bytes=24564 * MIB,
        # fp16/bf16 tensor math with fp32 accumulate; fp8 likewise (Ada whitepaper, dense)
        peak_flops={"fp32": 82.6 * TFLOPS, "bf16": 165.2 * TFLOPS, "fp16": 165.2 * TFLOPS, "fp8": 330.3 * TFLOPS},
        memory_bandwidth_bytes_per_s=1008 * GB,
        intra_node_bytes_per_s=32 * GB,
        inter_node_bytes_per_s=12.5 * GB,
        pcie_bytes_per_s=32 * GB,
        nvme_bytes_per_s=7 * GB,
        context_bytes=400 * MIB,
        supports_flash=True,
        host_memory_bytes=128 * GB,
        compute_capability=(8, 9),
    ),
}
HARDWARE_NAMES = (*PRESETS, "cpu", "auto")


@dataclass(frozen=True)
class DeviceRecord:
    """One visible GPU as NVML describes it (``nvmlDeviceGetName``, ``nvmlDeviceGetMemoryInfo``,
    ``nvmlDeviceGetNvLinkState`` over its links)."""

    name: str
    """The device's name (``NVIDIA H100 80GB HBM3``, ``NVIDIA H100 PCIe``)."""
    memory_bytes: int
    """Total device memory."""
    nvlink: bool
    """Whether any NVLink is active: SXM boards have them, PCIe cards (without a bridge) do not."""


def node_hardware(records: list[DeviceRecord]) -> Hardware | None:
    """The preset every visible device of a node matches (None: no preset does); one line of error
    for a mixed node.

    A device without an active NVLink gets its intra-node bandwidth from PCIe (an H100 PCIe is no SXM
    part: NVLink 4's 450 GB/s does not apply), and its name says so, where it has peers or its name says PCIe.
    """
    if not records:
        raise AutofitError("no CUDA device visible")
    kinds = sorted({(r.name, round(r.memory_bytes / GB), r.nvlink) for r in records})
    if len(kinds) > 1:
        seen = "; ".join(f"{name} {gb} GB {'NVLink' if link else 'PCIe'}" for name, gb, link in kinds)
        raise AutofitError(f"mixed node: the visible devices differ ({seen}); set CUDA_VISIBLE_DEVICES to one kind")
    first = records[0]
    base = _closest_preset(first.name, first.memory_bytes)
    if base is None:
        return None
    key, preset = base
    hardware = replace(preset, name=f"{key} ({first.name})", memory_bytes=first.memory_bytes)
    # a lone device's links are moot (it has no peer; a lone SXM H100 shows none active): PCIe where its name says so
    if not first.nvlink and "pcie" not in key and (len(records) > 1 or "pcie" in first.name.lower()):
        hardware = replace(hardware, name=f"{key} PCIe ({first.name})", intra_node_bytes_per_s=preset.pcie_bytes_per_s)
    return replace(hardware, devices_per_node=len(records))


#: form factors a preset's name may carry (``h100-pcie-80gb``): a device whose name says one gets that preset
FORM_FACTORS = ("pcie",)


def _closest_preset(device_name: str, memory_bytes: int) -> tuple[str, Hardware] | None:
    """The preset of the device's family and memory; where the name says its form factor ("NVIDIA H100 PCIe"),
    the preset of that form factor, else the family's plain (SXM) one."""
    compact = device_name.lower().replace(" ", "")
    matches = [
        (key, preset) for key, preset in PRESETS.items()
        if key.split("-")[0] in compact and abs(preset.memory_bytes - memory_bytes) < 0.1 * preset.memory_bytes
    ]
    said = [f for f in FORM_FACTORS if f in compact]
    specific = [(k, p) for k, p in matches if any(f in k.split("-") for f in said)]
    plain = [(k, p) for k, p in matches if not any(f in k.split("-") for f in FORM_FACTORS)]
    chosen = specific or plain
    return chosen[0] if chosen else None


def preset_for_device(device_name: str, memory_bytes: int) -> str | None:
    """The name of the preset a device (named ``device_name`` by NVML or torch, ``memory_bytes`` of memory) is,
    by :func:`_closest_preset`'s rule; None when it is none of them."""
    found = _closest_preset(device_name, memory_bytes)
    return found[0] if found else None


def unmatched_cuda_device(name: str, memory_bytes: int, capability: tuple[int, int]) -> Hardware:
    """A CUDA device no preset matches (torch's name, memory and compute capability): the nearest architecture's
    preset under the device's own name, memory and capability."""
    major = capability[0]
    base = PRESETS["h100-80gb"] if major >= 9 else PRESETS["a100-80gb"]
    # bf16 tensor math needs sm80 (Ampere), fp8 sm89 (Ada/Hopper): an older card must not claim them
    flops = {
        dtype: value
        for dtype, value in base.peak_flops.items()
        if not (dtype == "bf16" and capability < (8, 0)) and not (dtype == "fp8" and capability < (8, 9))
    }
    return replace(base, name=name, memory_bytes=memory_bytes, peak_flops=flops, supports_flash=major >= 8,
                   compute_capability=capability)


def default_gpus(gpus: int | None, hardware: str, kind: str, detected: int | None) -> int:
    """Devices per node: ``gpus`` where the user gave it; else, with ``hardware`` ``auto`` detecting a CUDA device
    (``kind`` the detected device's), the ``detected`` count of visible GPUs (:func:`cuda_devices_here`); else 1
    (a named preset plans for one device unless told more, and the CPU is one device)."""
    if gpus is not None:
        return gpus
    if hardware.lower() == "auto" and kind == "cuda" and detected is not None and detected >= 1:
        return detected
    return 1


