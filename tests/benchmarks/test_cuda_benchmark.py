"""benchmarks/accuracy/cuda_accuracy.py: on a machine without CUDA it says so in one line; its configs cover the grid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autofit.core.hardware import PRESETS
from autofit.core.software import Software

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]

from benchmarks.accuracy import cuda_accuracy  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark would run")
def test_without_cuda_it_exits_with_one_line():
    done = subprocess.run([sys.executable, "-m", "benchmarks.accuracy.cuda_accuracy", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1
    assert done.stdout.strip().splitlines() == [
        "cuda_accuracy: no CUDA device on this machine; run it where `nvidia-smi` lists a GPU (H100/H200)"
    ]


def test_the_grid_is_bf16_and_fp8_by_every_zero_stage_and_fp8_is_pruned_below_sm89():
    configs = cuda_accuracy.configs_for(4, quick=False)
    assert {(c.precision, c.zero_stage) for c in configs} == {(p, z) for p in ("bf16", "fp8") for z in range(4)}
    kept, reasons = cuda_accuracy.runnable(configs, PRESETS["h100-80gb"], 8, Software())
    # fp8 with ZeRO-3 is pruned by the space's own rule (rules.fp8_not_with_zero3), with torchao's reason
    assert kept == [c for c in configs if (c.precision, c.zero_stage) != ("fp8", 3)]
    assert reasons and all("Float8Linear" in r for r in reasons)
    kept, reasons = cuda_accuracy.runnable(configs, PRESETS["a100-80gb"], 8, Software())
    assert {c.precision for c in kept} == {"bf16"} and all("no fp8 support" in r for r in reasons)


@pytest.mark.parametrize("name", sorted(cuda_accuracy.MODELS))
def test_each_benchmark_model_has_half_a_billion_parameters_and_repeated_layers(name):
    pytest.importorskip("transformers")
    from autofit.workload.entry import load_workload

    entry, micro_batch = cuda_accuracy.MODELS[name]
    workload = load_workload(str(ROOT / entry))
    with torch.device("meta"):
        model = workload.build_model("sdpa")
    assert sum(p.numel() for p in model.parameters()) >= 0.5e9
    assert len(workload.repeated_layers(model)) >= 24
    batch = workload.batch(2)
    assert all(t.shape[0] == 2 for t in batch.values())


# -- in parts, resumed from the results file -------------------------------------------------------------------

DEVICE = "NVIDIA H100 80GB HBM3"


def _row(model, config, status="ok"):
    return {"model": model, "label": config.label(), "status": status, "config": config.to_dict(), "wall_s": 90.0}


def test_the_parts_cover_the_grid_once_each_a_model_in_one_precision():
    for quick in (False, True):
        parts = cuda_accuracy.parts_of(list(cuda_accuracy.MODELS), quick)
        assert [p.number for p in parts] == list(range(1, 2 * len(cuda_accuracy.MODELS) + 1))
        grid = [(m, c.label()) for m in cuda_accuracy.MODELS
                for c in cuda_accuracy.configs_for(cuda_accuracy.MODELS[m][1], quick)]
        split = [(p.model, c.label()) for p in parts for c in p.configs]
        assert sorted(split) == sorted(grid) and len(set(split)) == len(split)
        assert all(len(p.configs) == (2 if quick else 4) and {c.precision for c in p.configs} == {p.precision}
                   for p in parts)


def test_a_part_resumes_where_its_results_file_stopped(tmp_path):
    part = cuda_accuracy.parts_of(["llama"], quick=False)[0]
    path = tmp_path / "cuda_accuracy.json"
    results = cuda_accuracy.load_results(path, DEVICE, 8)
    assert results["rows"] == [] and cuda_accuracy.pending(part, results) == list(part.configs)
    first, second, *rest = part.configs
    cuda_accuracy.add_row(path, results, _row("llama", first))
    cuda_accuracy.add_row(path, results, _row("llama", second, status="timeout"))
    # a later command reads the file back: both rows are skipped, a failed one re-run only when asked
    again = cuda_accuracy.load_results(path, DEVICE, 8)
    assert [r["label"] for r in again["rows"]] == [first.label(), second.label()]
    assert cuda_accuracy.pending(part, again) == rest
    assert cuda_accuracy.pending(part, again, retry_failed=True) == [second, *rest]
    cuda_accuracy.add_row(path, again, _row("llama", second))  # the retry replaces the failed row
    assert [r["status"] for r in cuda_accuracy.load_results(path, DEVICE, 8)["rows"]] == ["ok", "ok"]
    # another part's rows and another model's rows of the same label are not this part's
    other = cuda_accuracy.parts_of(["gpt2"], quick=False)[0]
    assert cuda_accuracy.pending(other, again) == list(other.configs)
    with pytest.raises(SystemExit, match="holds rows of NVIDIA H100 80GB HBM3 x 8, this is NVIDIA H200 x 8"):
        cuda_accuracy.load_results(path, "NVIDIA H200", 8)


def test_a_run_starts_no_row_it_cannot_finish_within_its_budget():
    budget = cuda_accuracy.PART_BUDGET_S
    assert cuda_accuracy.room_for_a_row(0.0, [], budget) == budget
    assert cuda_accuracy.room_for_a_row(budget - cuda_accuracy.FIRST_ROW_S + 1, [], budget) == 0.0
    assert cuda_accuracy.room_for_a_row(300.0, [100.0, 200.0], budget) == budget - 300.0
    assert cuda_accuracy.room_for_a_row(400.0, [100.0, 200.0], budget) == 0.0


def test_the_parts_listing_and_an_unknown_part_need_no_gpu(tmp_path, capsys):
    part = cuda_accuracy.parts_of(list(cuda_accuracy.MODELS), quick=False)[1]
    results = cuda_accuracy.load_results(tmp_path / "cuda_accuracy.json", DEVICE, 8)
    cuda_accuracy.add_row(tmp_path / "cuda_accuracy.json", results, _row(part.model, part.configs[0]))
    assert cuda_accuracy.main(["--parts", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8 and lines[1].startswith(f"part 2: {part.model} {part.precision}, 4 rows (1 measured)")
    assert cuda_accuracy.main(["--part", "9", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().out.strip() == "cuda_accuracy: no part 9; there are 8 (--parts lists them)"
