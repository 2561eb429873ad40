"""benchmarks/cuda_accuracy.py: on a machine without CUDA it says so in one line; its configs cover the grid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autofit.hardware import PRESETS
from autofit.software import Software

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import cuda_accuracy  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark would run")
def test_without_cuda_it_exits_with_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_accuracy.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1
    assert done.stdout.strip().splitlines() == [
        "cuda_accuracy: no CUDA device on this machine; run it where `nvidia-smi` lists a GPU (H100/H200)"
    ]


def test_the_grid_is_bf16_and_fp8_by_every_zero_stage_and_fp8_is_pruned_below_sm89(monkeypatch):
    configs = cuda_accuracy.configs_for(4, quick=False)
    assert {(c.precision, c.zero_stage) for c in configs} == {(p, z) for p in ("bf16", "fp8") for z in range(4)}
    monkeypatch.setattr("autofit.space.detect_software", lambda: Software())  # not this machine's libraries
    kept, _ = cuda_accuracy.runnable(configs, PRESETS["h100-80gb"], 8)
    assert kept == configs
    kept, reasons = cuda_accuracy.runnable(configs, PRESETS["a100-80gb"], 8)
    assert {c.precision for c in kept} == {"bf16"} and all("no fp8 support" in r for r in reasons)


@pytest.mark.parametrize("name", sorted(cuda_accuracy.MODELS))
def test_each_benchmark_model_has_half_a_billion_parameters_and_repeated_layers(name):
    pytest.importorskip("transformers")
    from autofit.workload import load_workload

    entry, micro_batch = cuda_accuracy.MODELS[name]
    workload = load_workload(str(ROOT / entry))
    with torch.device("meta"):
        model = workload.build_model("sdpa")
    assert sum(p.numel() for p in model.parameters()) >= 0.5e9
    assert len(workload.repeated_layers(model)) >= 24
    batch = workload.batch(2)
    assert all(t.shape[0] == 2 for t in batch.values())
