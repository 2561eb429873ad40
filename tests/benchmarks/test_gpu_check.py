"""benchmarks/gpu_check.py: the one-command GPU check, run as its dry run on the CPU (a tiny model, tiny limits):
every step is recorded in the JSON and the markdown, whatever became of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.slow
def test_the_dry_run_records_every_step_in_the_json_and_the_markdown(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
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
    # the probes the GPU check measures, built as the search builds them, ran: an error in the step's own code fails
    # it; a step or a probe past its limit (a loaded machine) is a result
    accuracy = report["steps"]["accuracy"]
    assert accuracy["status"] in ("ok", "timeout"), accuracy.get("log_tail")
    assert all(row["status"] in ("ok", "timeout") for row in accuracy["result"].get("rows", [])), accuracy["result"]
    assert done.returncode == (0 if all(s["status"] in ("ok", "skipped") for s in report["steps"].values()) else 1)


def test_a_step_past_its_limit_is_killed_and_recorded_and_the_next_one_runs(tmp_path: Path) -> None:
    import time

    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    assert gpu_check.wait(process, time.monotonic() + 1, lambda: None) == "timeout"
    assert time.monotonic() - start < 10 and process.returncode is not None


def test_the_gpu_grid_covers_the_checked_configs() -> None:
    import gpu_check_steps

    configs = gpu_check_steps.checked_configs(gpu_check.GPU)
    labels = [c.label() for c in configs]
    assert len(labels) == len(set(labels)) == 6
    assert {c.zero_stage for c in configs} == {0, 3} and {c.checkpoint_ratio for c in configs} == {0.0, 1.0}
    assert {c.attention for c in configs} == {"sdpa", "flash"} and {c.precision for c in configs} == {"bf16", "fp8"}
    assert [c.compile for c in configs].count("on") == 1
    space = gpu_check_steps.space_values(gpu_check.GPU)
    for config in configs:  # each checked config is a candidate of the step's space
        assert all(config.to_dict()[key] in values for key, values in space.items() if isinstance(values, list))
    assert sum(gpu_check.GPU.limits_s.values()) <= 9 * 60 and gpu_check.GPU.budget_s < 9 * 60
