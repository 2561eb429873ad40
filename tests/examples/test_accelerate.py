"""examples/accelerate: `accelerate launch --config_file` with the YAML autofit.ds.launchers writes trains through DeepSpeed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.core.recipe import Recipe
from autofit.ds.emit import deepspeed_config
from autofit.ds.launchers import accelerate_config, write_accelerate_config

pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize(("zero_stage", "optimizer"), [(0, "adamw"), (1, "lion")])
def test_accelerate_launch_trains_three_steps_with_the_written_config(tmp_path: Path, zero_stage: int,
                                                                      optimizer: str) -> None:
    # adamw: DeepSpeed's optimizer section (a DummyOptim in the script); lion on the CPU: a client optimizer
    config = Config(micro_batch_size=2, grad_accum_steps=2, checkpoint_ratio=0.5, precision="fp32", optimizer=optimizer,
                    zero_stage=zero_stage, offload_optimizer="none", offload_params="none", attention="sdpa")
    # the JSON a user gets from a search given no hyperparameters: each "auto", which accelerate fills only in part
    ds = deepspeed_config(config, 1, "cpu", recipe=Recipe(optimizer, "fp32"))
    assert "auto" in (ds.get("optimizer") or ds["autofit"]["client_optimizer"])["params"].values()
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    # the launched script runs in another directory: the YAML holds the JSON's absolute path
    yaml_path = write_accelerate_config(tmp_path / "accelerate.yaml",
                                        accelerate_config(ds, tmp_path / "ds_config.json", main_process_port=29532))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml_path),
         str(ROOT / "examples" / "accelerate" / "train.py"), str(ROOT / "examples" / "mlp.py") + ":workload",
         "--deepspeed", str(tmp_path / "ds_config.json"), "--max-steps", "3"],
        cwd=run_dir, env=env, capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert summary["global_step"] == 3  # DeepSpeed's engine counted 3 optimizer steps
    assert (summary["micro_batches"], summary["gradient_accumulation_steps"]) == (6, 2)
    assert all(math.isfinite(summary[key]) and summary[key] > 0 for key in ("first_loss", "last_loss"))  # MSE
