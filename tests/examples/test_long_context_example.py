"""examples/long_context: Ulysses SP = 2 on two CPU ranks (gloo) from the JSON autofit emits, TiledMLP and the tiled
loss on: a script of its own through ``autofit.apply`` trains the losses of one rank without SP, and the Hugging
Face Trainer trains 3 steps with the ``parallelism_config`` the launchers hand it. The same script with DeepSpeed's
AutoTP (``tensor_parallel`` 2) from the emitted JSON: the losses of one rank without TP, and the Trainer's 3 steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.ds.emit import deepspeed_config
from autofit.probe.launch import free_port

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "long_context" / "train.py"


def _run(tmp_path: Path, name: str, ranks: int, loop: str, **keys: object) -> list[dict]:
    values: dict = dict(micro_batch_size=1, precision="fp32", optimizer="adamw", zero_stage=3, attention="sdpa")
    ds_path = tmp_path / f"{name}.json"
    ds_path.write_text(json.dumps(deepspeed_config(Config(**(values | keys)), ranks, "cpu")))  # type: ignore[arg-type]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(free_port()), str(TRAIN), "--deepspeed", str(ds_path), "--loop", loop, "--max-steps", "3",
               "--output-dir", str(tmp_path / name)]
    # its own session: a timeout ends the ranks too, not only the launcher
    run = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        stdout, stderr = run.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        raise
    assert run.returncode == 0, (stdout + stderr)[-3000:]
    # one file a rank: the ranks share one stdout, where their RESULT lines can interleave
    results = [json.loads(path.read_text()) for path in (tmp_path / name).glob("result-rank*.json")]
    assert len(results) == ranks, (stdout + stderr)[-3000:]
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.slow
def test_sp2_with_tiling_trains_the_losses_and_gradients_of_one_rank(tmp_path: Path) -> None:
    one = _run(tmp_path, "sp1", 1, "deepspeed")[0]
    both = _run(tmp_path, "sp2", 2, "deepspeed", sequence_parallel=2, tiled_mlp=True, tiled_loss=True)
    for rank in both:
        assert rank["local_tokens"] == (one["local_tokens"] + 1) // 2  # its half of the sequence padded to even
        assert rank["losses"] == pytest.approx(one["losses"], abs=1e-5)
        assert rank["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)  # not sp x (Finding 1)


@pytest.mark.slow
def test_the_trainer_trains_three_steps_with_sp2_from_the_emitted_json(tmp_path: Path) -> None:
    results = _run(tmp_path, "trainer", 2, "trainer", sequence_parallel=2, tiled_mlp=True, tiled_loss=True)
    assert [r["global_step"] for r in results] == [3, 3]
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 3
    assert all(5.0 < loss < 7.0 for loss in results[0]["losses"])  # ln(512) = 6.24 at random weights


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_tp2_from_the_emitted_json_trains_the_losses_of_one_rank(tmp_path: Path, stage: int) -> None:
    one = _run(tmp_path, f"tp1-z{stage}", 1, "deepspeed", zero_stage=stage)[0]
    both = _run(tmp_path, f"tp2-z{stage}", 2, "deepspeed", zero_stage=stage, tensor_parallel=2)
    worst = max(abs(a - b) / abs(b) for rank in both for a, b in zip(rank["losses"], one["losses"], strict=True))
    print(f"ZeRO-{stage}: losses {one['losses']} at TP 1; worst relative difference at TP 2 {worst:.1e}")
    for rank in both:
        assert rank["losses"] == pytest.approx(one["losses"], rel=1e-3)


@pytest.mark.slow
def test_the_trainer_trains_three_steps_with_tp2_from_the_emitted_json(tmp_path: Path) -> None:
    results = _run(tmp_path, "trainer-tp2", 2, "trainer", zero_stage=3, tensor_parallel=2)
    assert [r["global_step"] for r in results] == [3, 3]
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 3
