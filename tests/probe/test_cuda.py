"""The CUDA path of a probe: NVML's per-process peak, the budget, OOM classification, fp8 and flash attention.

Marked ``gpu``: skipped where no CUDA device is present (CI and the CPU development machines).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.machine.device import get_hardware
from autofit.probe.spec import probe_spec

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def test_cuda_probe_reports_nvml_peak_with_reserved_and_context_beside_it() -> None:
    from autofit.probe.run import run_probe

    hardware = get_hardware("auto")
    result = run_probe(probe_spec(f"{HERE / 'probe_workloads.py'}:medium", Config(micro_batch_size=2), hardware), timeout_s=600)
    assert result.status == "ok", result.message
    memory = result.device_memory
    assert memory["context_bytes"] > 0 and memory["max_memory_reserved_bytes"] > 0
    if memory["nvml_peak_bytes"] is not None:  # None inside a container whose pids NVML does not list
        assert result.peak_bytes == memory["nvml_peak_bytes"]
        # NVML sees the context and the allocator's reservations (and cuBLAS workspaces) together
        assert result.peak_bytes >= memory["max_memory_reserved_bytes"]
    assert result.step_time_s > 0


def test_memory_budget_is_enforced_on_cuda() -> None:
    from autofit.probe.run import run_probe

    hardware = get_hardware("auto")
    config = Config(micro_batch_size=64)
    entry = f"{ROOT / 'examples' / 'gpt.py'}:workload"
    free = run_probe(probe_spec(entry, config, hardware), timeout_s=600)
    assert free.status == "ok", free.message
    tight = run_probe(probe_spec(entry, config, hardware.with_memory(free.peak_bytes // 2)), timeout_s=600)
    assert (tight.status, tight.oom_on) == ("oom", "device"), tight.message


def test_cuda_fp8_probe_runs_through_torchao() -> None:
    pytest.importorskip("torchao.float8")
    from autofit.probe.run import run_probe

    hardware = get_hardware("auto")
    if not hardware.supports_precision("fp8"):
        pytest.skip("fp8 needs sm89 or newer")
    config = Config(micro_batch_size=8, precision="fp8")
    result = run_probe(probe_spec(f"{ROOT / 'examples' / 'gpt.py'}:workload", config, hardware), timeout_s=600)
    assert result.status == "ok", result.message


def test_cuda_flash_probe_runs_where_flash_attn_is_installed() -> None:
    pytest.importorskip("flash_attn")
    from autofit.probe.run import run_probe

    hardware = get_hardware("auto")
    config = Config(micro_batch_size=8, precision="bf16", attention="flash")
    result = run_probe(probe_spec(f"{ROOT / 'examples' / 'gpt.py'}:workload", config, hardware), timeout_s=600)
    assert result.status == "ok", result.message


def test_cuda_nvml_row_is_found_by_uuid_under_cuda_visible_devices() -> None:
    import os

    import pynvml

    from autofit.machine.nvml import open_handle, process_used_bytes

    torch.cuda.init()
    index = torch.cuda.device_count() - 1
    torch.empty(64 * 2**20, dtype=torch.uint8, device=f"cuda:{index}")
    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    handle = open_handle(pynvml, uuid, os.environ.get("CUDA_VISIBLE_DEVICES"), index)
    used = process_used_bytes(pynvml.nvmlDeviceGetComputeRunningProcesses(handle), os.getpid())
    if used is None:
        pytest.skip("NVML lists no row for this pid (a container's pid namespace)")
    assert used >= 64 * 2**20


def test_cuda_probe_past_the_device_is_oom() -> None:
    from autofit.probe.run import run_probe

    hardware = get_hardware("auto")
    config = Config(micro_batch_size=4096)
    result = run_probe(probe_spec(f"{ROOT / 'examples' / 'gpt.py'}:workload", config, hardware), timeout_s=600)
    assert result.status == "oom", result.message


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_16_bit_probe_runs(precision: str) -> None:
    from autofit.probe.run import run_probe

    hardware = get_hardware("auto")
    config = Config(micro_batch_size=8, precision=precision)
    result = run_probe(probe_spec(f"{ROOT / 'examples' / 'gpt.py'}:workload", config, hardware), timeout_s=600)
    assert result.status == "ok", result.message


def test_cuda_probe_records_the_allocator_history_into_a_snapshot(tmp_path: Path) -> None:
    import pickle

    from autofit.probe.run import run_probe

    path = tmp_path / "memory_snapshot.pickle"
    spec = probe_spec(f"{HERE / 'probe_workloads.py'}:medium", Config(micro_batch_size=2), get_hardware("auto"), steps=1,
                      memory_snapshot=path)
    result = run_probe(spec, timeout_s=600)
    assert result.status == "ok", result.message
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]  # torch.cuda.memory._snapshot()'s layout
    memory = result.device_memory
    assert 0 < memory["max_memory_allocated_bytes"] <= memory["max_memory_reserved_bytes"]
