"""The CUDA path of a probe: allocator statistics, the context, OOM classification, flash attention.

Marked ``gpu``: skipped where no CUDA device is present (CI and the CPU development machines).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autofit.config import Config
from autofit.hardware import get_hardware

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def test_cuda_probe_reports_reserved_memory_plus_context() -> None:
    from autofit.probe import run_probe

    hardware = get_hardware("auto")
    result = run_probe(f"{HERE / 'probe_workloads.py'}:medium", Config(micro_batch_size=2), hardware, timeout_s=600)
    assert result.status == "ok", result.message
    assert result.peak_bytes > hardware.context_bytes > 0
    assert result.step_time_s > 0


def test_cuda_probe_past_the_device_is_oom() -> None:
    from autofit.probe import run_probe

    hardware = get_hardware("auto")
    config = Config(micro_batch_size=4096)
    result = run_probe(f"{ROOT / 'examples' / 'gpt.py'}:workload", config, hardware, timeout_s=600)
    assert result.status == "oom", result.message


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_16_bit_probe_runs(precision: str) -> None:
    from autofit.probe import run_probe

    hardware = get_hardware("auto")
    result = run_probe(f"{ROOT / 'examples' / 'gpt.py'}:workload", Config(micro_batch_size=8, precision=precision),
                       hardware, timeout_s=600)
    assert result.status == "ok", result.message
