"""examples/hf_trainer: the Hugging Face Trainer trains with the JSON autofit emits, its "autofit" section applied."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.ds.emit import deepspeed_config

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer"
_spec = importlib.util.spec_from_file_location("hf_trainer_train", EXAMPLE / "train.py")
assert _spec is not None and _spec.loader is not None
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


#: the Trainer's own checkpointing keyword (transformers 5 renamed ``gradient_checkpointing``)
CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__
                 else "gradient_checkpointing")


def _config(**changes: object) -> Config:
    values: dict[str, object] = dict(micro_batch_size=2, grad_accum_steps=2, checkpoint_ratio=0.5, precision="fp32",
                                     optimizer="adamw", zero_stage=1, offload_optimizer="none", offload_params="none",
                                     attention="eager")
    return Config(**(values | changes))  # type: ignore[arg-type]


def test_partial_ratio_wraps_the_first_layers_and_the_trainer_checkpoints_none() -> None:
    from autofit.ds.apply import is_checkpointed

    ds = deepspeed_config(_config(checkpoint_ratio=0.5), 1, "cpu")
    model, optimizer = train.prepare_model(ds)
    assert [is_checkpointed(layer) for layer in model.model.layers] == [True, True, False, False]
    assert model.config._attn_implementation == "eager"
    assert optimizer is None  # the JSON names AdamW: DeepSpeed builds it
    kwargs = train.trainer_arguments(ds, "out", 3)
    assert kwargs[CHECKPOINTING] is False
    assert (kwargs["per_device_train_batch_size"], kwargs["gradient_accumulation_steps"]) == (2, 2)
    assert kwargs["learning_rate"] == ds["optimizer"]["params"]["lr"]


def test_the_trainer_keeps_the_scripts_learning_rate_unless_the_user_gave_autofit_one() -> None:
    from autofit.core.recipe import Recipe

    auto = deepspeed_config(_config(), 1, "cpu", recipe=Recipe("adamw", "fp32"))
    assert auto["optimizer"]["params"]["lr"] == "auto"  # the Trainer fills it from its own arguments
    kwargs = train.trainer_arguments(auto, "out", 3, learning_rate=3e-4, weight_decay=0.05)
    assert (kwargs["learning_rate"], kwargs["weight_decay"]) == (3e-4, 0.05)
    given = deepspeed_config(_config(), 1, "cpu", recipe=Recipe("adamw", "fp32", hyperparameters={"lr": 2e-5}))
    kwargs = train.trainer_arguments(given, "out", 3, learning_rate=3e-4, weight_decay=0.05)
    assert (kwargs["learning_rate"], kwargs["weight_decay"]) == (2e-5, 0.05)  # the user's, as given to autofit


def test_full_ratio_is_the_trainers_own_checkpointing() -> None:
    from autofit.ds.apply import is_checkpointed

    ds = deepspeed_config(_config(checkpoint_ratio=1.0, attention="sdpa"), 1, "cpu")
    model, _ = train.prepare_model(ds)
    assert not any(is_checkpointed(layer) for layer in model.model.layers)
    assert train.trainer_arguments(ds, "out", 3)[CHECKPOINTING] is True
    assert model.config._attn_implementation == "sdpa"


def test_client_optimizers_go_the_trainers_way() -> None:
    pytest.importorskip("bitsandbytes")
    eight_bit = deepspeed_config(_config(optimizer="adamw8bit"), 1, "cpu")
    assert "optimizer" not in eight_bit
    assert train.trainer_arguments(eight_bit, "out", 3)["optim"] == "adamw_bnb_8bit"
    assert train.prepare_model(eight_bit)[1] is None
    lion = deepspeed_config(_config(optimizer="lion"), 1, "cpu")  # FusedLion is CUDA-only: a client optimizer
    assert "optim" not in train.trainer_arguments(lion, "out", 3)
    model, optimizer = train.prepare_model(lion)
    assert type(optimizer).__name__ == "Lion"
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}


@pytest.mark.slow
@pytest.mark.parametrize(("ratio", "precision", "optimizer"),
                         [(0.5, "fp32", "adamw"), (1.0, "fp32", "adamw"), (0.0, "bf16", "adafactor")])
def test_trainer_trains_three_steps_with_the_emitted_json(tmp_path: Path, ratio: float, precision: str,
                                                          optimizer: str) -> None:
    # bf16 on the CPU: what autofit emits where the CPU runs bf16 fastest (the Trainer needs use_cpu for it)
    from autofit.core.recipe import Recipe

    ds = deepspeed_config(_config(checkpoint_ratio=ratio, precision=precision, optimizer=optimizer), 1, "cpu",
                          recipe=Recipe(optimizer, precision))  # the JSON a user gets: 'auto' for the Trainer
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "train.py"), "--deepspeed", "ds_config.json", "--max-steps", "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert summary["global_step"] == 3
    assert 0.0 < summary["train_loss"] < 20.0  # a cross-entropy over 2048 tokens starts near ln 2048 = 7.6
