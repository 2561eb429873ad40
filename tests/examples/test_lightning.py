"""examples/lightning: Lightning's DeepSpeedStrategy trains with the JSON autofit emits, split by autofit.ds.launchers."""

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

pytest.importorskip("lightning")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize(("zero_stage", "optimizer"), [(0, "adamw"), (1, "lion")])
def test_lightning_trains_three_steps_with_the_emitted_json(tmp_path: Path, zero_stage: int, optimizer: str) -> None:
    # adamw: DeepSpeed's optimizer section; lion on the CPU: a client optimizer from configure_optimizers
    config = Config(micro_batch_size=2, grad_accum_steps=2, checkpoint_ratio=0.5, precision="fp32", optimizer=optimizer,
                    zero_stage=zero_stage, offload_optimizer="none", offload_params="none", attention="sdpa")
    # the JSON a user gets from a search given no hyperparameters: each "auto", which Lightning does not fill
    ds = deepspeed_config(config, 1, "cpu", recipe=Recipe(optimizer, "fp32"))
    assert "auto" in (ds.get("optimizer") or ds["autofit"]["client_optimizer"])["params"].values()
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MASTER_PORT="29534")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning" / "train.py"), str(ROOT / "examples" / "mlp.py") + ":workload",
         "--deepspeed", "ds_config.json", "--max-steps", "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert (summary["global_step"], summary["deepspeed_global_steps"]) == (3, 3)  # Lightning's and DeepSpeed's count
    assert summary["micro_batches"] == 6  # accumulate_grad_batches=2, from the JSON
    assert all(math.isfinite(summary[key]) and summary[key] > 0 for key in ("first_loss", "last_loss"))  # MSE
