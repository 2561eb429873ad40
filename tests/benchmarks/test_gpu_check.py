"""benchmarks/gpu/gpu_check.py: the one-command GPU check, run as its dry run on the CPU (a tiny model, tiny limits):
every step is recorded in the JSON and the markdown, whatever became of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import gpu_check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_dry_run_records_every_step_in_the_json_and_the_markdown(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.gpu_check", "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500, check=False)
    report = json.loads((out / "gpu_check.json").read_text())
    markdown = (out / "gpu_check.md").read_text()
    assert report["dry_run"] is True and list(report["steps"]) == list(gpu_check.STEPS)
    for name, step in report["steps"].items():
        assert step["status"] in ("ok", "failed", "timeout", "skipped"), (name, step)
        assert f"| {name} | {step['status']} |" in markdown
    assert report["steps"]["install"]["status"] == "skipped"  # no --install
    assert report["steps"]["env"]["status"] == "ok", report["steps"]["env"].get("log_tail")
    assert report["steps"]["env"]["result"]["autofit_software"]["source"] == "here"
    assert report["steps"]["pytest"]["status"] == "ok"  # the gpu tests skip without CUDA
    # the grid's configs and the host's micro-benchmarks ran: an error in the step's own code fails it; a step past
    # its limit (a loaded machine) is a result
    grid = report["steps"]["grid"]
    assert grid["status"] in ("ok", "timeout"), grid.get("log_tail")
    rows = [row for model in grid["result"]["models"].values() for row in model.get("rows", [])]
    assert rows and all(row["status"] in ("ok", "skipped") for row in rows), rows
    ran = [row for row in rows if row["status"] == "ok"]
    assert all(len(row["step_times_s"]) == gpu_check.DRY.steps and row["step_times_s"][0] > 0 for row in ran)
    assert "| mb1x1 fp32 sgd z0 ckpt0 sdpa | ok |" in markdown
    host = report["steps"]["host"]
    assert host["status"] in ("ok", "timeout"), host.get("log_tail")
    assert host["status"] == "timeout" or host["result"]["launch"]["queued_s"] > 0
    assert done.returncode == (0 if all(s["status"] in ("ok", "skipped") for s in report["steps"].values()) else 1)


def test_a_step_past_its_limit_is_killed_and_recorded_and_the_next_one_runs(tmp_path: Path) -> None:
    import time

    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    assert gpu_check.wait(process, time.monotonic() + 1, lambda: None) == "timeout"
    assert time.monotonic() - start < 10 and process.returncode is not None


def test_a_step_past_its_limit_takes_the_children_it_ran_with_it(tmp_path: Path) -> None:
    """A step's child (run_child: a host benchmark, an op build) leads a process group of its own in the step's
    session; killing the step at its limit kills it too, not only the step's own group."""
    import os
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    step = ("import sys, time; from pathlib import Path; from benchmarks.gpu.gpu_check_steps import run_child; "
            f"run_child([sys.executable, '-c', {child!r}], time.time() + 60, Path({str(tmp_path / 'child.log')!r}))")
    process = subprocess.Popen([sys.executable, "-c", step], cwd=ROOT, start_new_session=True,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and process.poll() is None, "the step never started its child"
        time.sleep(0.1)
    assert gpu_check.wait(process, time.monotonic(), lambda: None) == "timeout"
    child_pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child_pid):
        assert time.monotonic() < deadline, "the step's child outlived the step"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def test_the_gpu_grid_spans_micro_batch_zero_and_checkpointing_on_two_models_one_held_out() -> None:
    models = gpu_check.GPU.grid
    assert [m.held_out for m in models].count(True) == 1 and len(models) == 2
    for model in models:
        items = model.items(gpu_check.GPU.precision, gpu_check.GPU.optimizer)
        labels = [item["label"] for item in items]
        assert len(labels) == len(set(labels))
        configs = [item["config"] for item in items if item["alloc_conf"] is None]
        assert len(configs) == len(model.micro_batches) * 4  # ZeRO 0 and 3, checkpointing off and on
        assert {c["zero_stage"] for c in configs} == {0, 3} and {c["checkpoint_ratio"] for c in configs} == {0.0, 1.0}
        assert any(item["history"] for item in items)
    assert any(item["alloc_conf"] for m in models for item in m.items("bf16", "adamw"))  # expandable_segments once
    assert {mb for m in models for mb in m.micro_batches} >= {1, 16}
    assert sum(gpu_check.GPU.limits_s.values()) <= 9 * 60 and gpu_check.GPU.budget_s < 9 * 60
    assert sum(m.limit_s for m in models) <= gpu_check.GPU.limits_s["grid"]
