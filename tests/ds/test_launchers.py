"""autofit.ds.launchers: the emitted JSON turned into the Trainer's, Accelerate's and Lightning's arguments.

The conversions are checked here, fast; tests/examples/ trains 3 real steps through each launcher."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.ds.emit import deepspeed_config
from autofit.ds.launchers import (
    accelerate_config,
    fill_auto,
    lightning_arguments,
    trainer_arguments,
    trainer_keywords,
    write_accelerate_config,
)


def _ds(**changes: object) -> dict[str, Any]:
    values: dict[str, object] = dict(micro_batch_size=2, grad_accum_steps=3, checkpoint_ratio=0.0, precision="fp32",
                                     optimizer="adamw", zero_stage=1, offload_optimizer="none", offload_params="none",
                                     attention="sdpa")
    return deepspeed_config(Config(**(values | changes)), 1, "cpu")  # type: ignore[arg-type]


def _as_emitted(**changes: object) -> dict[str, Any]:
    """The JSON ``autofit run`` writes for a user who gave it no hyperparameters: each one ``"auto"``."""
    from autofit.core.recipe import Recipe

    values: dict[str, object] = dict(micro_batch_size=2, grad_accum_steps=3, checkpoint_ratio=0.0, precision="fp32",
                                     optimizer="adamw", zero_stage=1, offload_optimizer="none", offload_params="none",
                                     attention="sdpa")
    config = Config(**(values | changes))  # type: ignore[arg-type]
    return deepspeed_config(config, 1, "cpu", recipe=Recipe(config.optimizer, config.precision))


#: what a script hands fill_auto (torch.optim.AdamW's defaults, as the examples' are)
SCRIPT = {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}


def _recipe(ds: dict[str, Any]) -> dict[str, Any]:
    params = ds["optimizer"]["params"]
    return {"learning_rate": params["lr"], "weight_decay": params["weight_decay"]}


# --- the Hugging Face Trainer ---------------------------------------------------------------------------------------

def test_trainer_takes_batch_accumulation_clipping_and_precision_from_the_json() -> None:
    pytest.importorskip("transformers")
    ds = _ds(precision="bf16")
    kwargs = trainer_arguments(ds, output_dir="out", use_cpu=True, **_recipe(ds))
    assert (kwargs["per_device_train_batch_size"], kwargs["gradient_accumulation_steps"]) == (2, 3)
    assert kwargs["max_grad_norm"] == ds["gradient_clipping"]
    assert (kwargs["bf16"], kwargs["fp16"], kwargs["use_cpu"]) == (True, False, True)
    assert kwargs["output_dir"] == "out"
    assert kwargs["deepspeed"] == ds and kwargs["deepspeed"] is not ds  # the Trainer fills "auto" in its own copy


def test_trainer_keeps_the_users_hyperparameters_and_refuses_ones_the_json_contradicts() -> None:
    pytest.importorskip("transformers")
    ds = _ds()
    assert trainer_arguments(ds, learning_rate=ds["optimizer"]["params"]["lr"], weight_decay=0.01,
                             use_cpu=True)["learning_rate"] == ds["optimizer"]["params"]["lr"]
    with pytest.raises(AutofitError, match="optimizer.params.lr"):
        trainer_arguments(ds, learning_rate=3e-4, weight_decay=0.01, use_cpu=True)
    with pytest.raises(AutofitError, match="the Trainer's default"):  # 5e-5 is not the JSON's 1e-4
        trainer_arguments(ds, weight_decay=0.01, use_cpu=True)
    with pytest.raises(AutofitError, match="per_device_train_batch_size"):
        trainer_arguments(ds, per_device_train_batch_size=4, use_cpu=True, **_recipe(ds))


def test_trainer_leaves_auto_to_the_trainer_and_copies_no_hyperparameter() -> None:
    pytest.importorskip("transformers")
    ds = _ds()
    ds["optimizer"]["params"] |= {"lr": "auto", "weight_decay": "auto"}
    ds["train_micro_batch_size_per_gpu"] = "auto"
    ds["bf16"] = {"enabled": "auto"}
    kwargs = trainer_arguments(ds, use_cpu=True, per_device_train_batch_size=5)
    assert "learning_rate" not in kwargs and "weight_decay" not in kwargs
    assert kwargs["per_device_train_batch_size"] == 5  # the user's, the JSON said "auto"
    assert "bf16" not in kwargs
    assert kwargs["gradient_accumulation_steps"] == 3


def test_trainer_checkpointing_and_optimizer_from_the_autofit_section() -> None:
    full = trainer_keywords(_ds(checkpoint_ratio=1.0), {}, cuda_available=True,
                            field_names=frozenset({"activation_checkpointing"}))
    assert full["activation_checkpointing"] is True and full["use_cpu"] is False
    assert full["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    partial = trainer_keywords(_ds(checkpoint_ratio=0.5), {}, cuda_available=False)  # transformers 4's names
    assert partial["gradient_checkpointing"] is False  # apply_checkpointing wraps the layers instead
    selective = trainer_keywords(_ds(checkpoint_ratio=1.0, checkpoint_granularity="attention"), {}, cuda_available=False)
    assert selective["gradient_checkpointing"] is False
    eight_bit = _ds(optimizer="adamw8bit")
    assert trainer_keywords(eight_bit, {}, cuda_available=False)["optim"] == "adamw_bnb_8bit"
    assert "optim" not in trainer_keywords(_ds(optimizer="lion"), {}, cuda_available=False)  # handed in built
    assert trainer_keywords(_ds(), {"deepspeed": "ds.json"}, cuda_available=False)["deepspeed"] == "ds.json"


# --- fill_auto: the script's hyperparameters for launchers that fill no (or not every) "auto" ---------------------

def test_fill_auto_fills_every_auto_of_the_emitted_json_and_leaves_the_callers() -> None:
    ds = _as_emitted()
    assert ds["optimizer"]["params"]["betas"] == "auto"  # the JSON a user gets without --betas
    filled = fill_auto(ds, **SCRIPT)
    params = filled["optimizer"]["params"]
    assert (params["lr"], params["weight_decay"], params["betas"], params["eps"]) == (1e-3, 0.01, [0.9, 0.999], 1e-8)
    assert json.loads(json.dumps(filled)) == filled  # still a JSON document
    assert ds["optimizer"]["params"]["lr"] == "auto"  # the caller's is left as it was
    assert {k: v for k, v in filled.items() if k != "optimizer"} == {k: v for k, v in ds.items() if k != "optimizer"}


def test_fill_auto_keeps_the_users_numbers_and_fills_the_client_optimizer() -> None:
    from autofit.core.recipe import Recipe

    given = deepspeed_config(Config(micro_batch_size=2, grad_accum_steps=3, checkpoint_ratio=0.0, precision="fp32",
                                    optimizer="adamw", zero_stage=1, offload_optimizer="none", offload_params="none",
                                    attention="sdpa"), 1, "cpu", recipe=Recipe("adamw", "fp32", hyperparameters={"lr": 2e-5}))
    assert fill_auto(given, **SCRIPT)["optimizer"]["params"]["lr"] == 2e-5  # the user gave autofit this one
    lion = _as_emitted(optimizer="lion")  # FusedLion is CUDA-only: a client optimizer on the CPU
    assert "optimizer" not in lion
    filled = fill_auto(lion, **SCRIPT)
    assert filled["autofit"]["client_optimizer"]["params"] == {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999]}


def test_fill_auto_refuses_an_auto_it_cannot_fill_and_a_value_it_does_not_know() -> None:
    ds = _as_emitted()
    with pytest.raises(AutofitError, match=r"optimizer.params.betas is \"auto\".*fill_auto\(ds, betas=\.\.\.\)"):
        fill_auto(ds, lr=1e-3, weight_decay=0.01, eps=1e-8)
    with pytest.raises(AutofitError, match="autofit.client_optimizer.params.lr"):
        fill_auto(_as_emitted(optimizer="lion"), weight_decay=0.0, betas=(0.9, 0.99))
    with pytest.raises(AutofitError, match="unknown hyperparameter learning_rate"):
        fill_auto(ds, learning_rate=1e-3)
    with pytest.raises(AutofitError, match="betas must be two numbers"):
        fill_auto(ds, **(SCRIPT | {"betas": (0.9,)}))


def test_accelerate_fills_only_lr_and_weight_decay_and_takes_the_filled_json() -> None:
    # what Accelerator._prepare_deepspeed does with a DummyOptim (accelerate/accelerator.py): fill these two, no more
    pytest.importorskip("accelerate")
    from accelerate.utils import DeepSpeedPlugin

    from_dummy_optim = {"optimizer.params.lr": 1e-3, "optimizer.params.weight_decay": 0.01}
    as_emitted = DeepSpeedPlugin(hf_ds_config=_as_emitted())
    with pytest.raises(ValueError, match="optimizer.params.betas` not found in kwargs"):
        as_emitted.deepspeed_config_process(must_match=False, **from_dummy_optim)
    filled = DeepSpeedPlugin(hf_ds_config=fill_auto(_as_emitted(), **SCRIPT))
    filled.deepspeed_config_process(must_match=False, **from_dummy_optim)
    assert filled.deepspeed_config["optimizer"]["params"]["eps"] == 1e-8


# --- Accelerate -----------------------------------------------------------------------------------------------------

def test_accelerate_config_is_one_accelerate_reads(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    ds = _ds(zero_stage=3)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    written = write_accelerate_config(tmp_path / "cfg" / "accelerate.yaml",
                                      accelerate_config(ds, tmp_path / "ds.json", main_process_port=29533))
    assert [p.name for p in written.parent.iterdir()] == ["accelerate.yaml"]  # no temporary file left behind
    loaded = load_config_from_file(str(written))
    assert loaded.distributed_type == DistributedType.DEEPSPEED
    assert loaded.deepspeed_config == {"deepspeed_config_file": str(tmp_path / "ds.json"), "zero3_init_flag": True}
    assert (loaded.num_processes, loaded.main_process_port, loaded.use_cpu) == (1, 29533, False)
    assert loaded.mixed_precision is None  # precision is the JSON's: accelerate refuses it beside the file


def test_accelerate_config_refuses_what_deepspeed_would() -> None:
    ds = _ds()
    with pytest.raises(AutofitError, match="train_batch_size 6 .* num_processes=2"):
        accelerate_config(ds, "ds.json", num_processes=2)
    with pytest.raises(AutofitError, match="zero_optimization"):
        accelerate_config({k: v for k, v in ds.items() if k != "zero_optimization"}, "ds.json")
    with pytest.raises(AutofitError, match="machine_rank"):
        accelerate_config(ds, "ds.json", num_machines=2, machine_rank=2, num_processes=2, main_process_ip="10.0.0.1")
    with pytest.raises(AutofitError, match="main_process_ip"):
        accelerate_config(ds, "ds.json", num_machines=2, num_processes=2)
    two = accelerate_config(ds | {"train_batch_size": 12}, "ds.json", num_processes=2)
    assert two["num_processes"] == 2
    nodes = accelerate_config(ds | {"train_batch_size": 24}, "ds.json", num_processes=4, num_machines=2,
                              machine_rank=1, main_process_ip="10.0.0.1")
    assert nodes["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"


# --- Lightning ------------------------------------------------------------------------------------------------------

def test_lightning_takes_accumulation_as_its_trainers_and_precision_from_the_json() -> None:
    ds = _ds(precision="bf16")
    config, trainer_kwargs = lightning_arguments(ds)
    assert "gradient_accumulation_steps" not in config  # Lightning refuses it in the config
    assert ds["gradient_accumulation_steps"] == 3  # the caller's JSON is left as it was
    assert trainer_kwargs == {"accumulate_grad_batches": 3, "precision": "bf16-mixed"}
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["optimizer"] == ds["optimizer"]
    assert lightning_arguments(_ds())[1]["precision"] == "32-true"
    assert lightning_arguments(_ds(precision="fp16"))[1]["precision"] == "16-mixed"


def test_lightning_fills_no_auto() -> None:
    ds = _ds()
    ds["train_micro_batch_size_per_gpu"] = ds["gradient_accumulation_steps"] = ds["train_batch_size"] = "auto"
    config, trainer_kwargs = lightning_arguments(ds)
    assert not {"train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"} & set(config)
    assert "accumulate_grad_batches" not in trainer_kwargs
    ds["optimizer"]["params"]["lr"] = "auto"
    with pytest.raises(AutofitError, match="optimizer.params.lr"):
        lightning_arguments(ds)


def test_lightning_takes_the_emitted_json_once_the_script_filled_it() -> None:
    with pytest.raises(AutofitError, match=r"optimizer.params.lr is \"auto\".*fill_auto"):
        lightning_arguments(_as_emitted())
    config, _ = lightning_arguments(fill_auto(_as_emitted(), **SCRIPT))
    assert "auto" not in config["optimizer"]["params"].values()


def test_compile_reaches_the_trainer_and_accelerate_as_their_dynamo_setting(tmp_path: Path) -> None:
    """Both end in accelerate's dynamo plugin, which calls DeepSpeed's engine.compile() after initialize."""
    compiled, eager = _ds(compile="on"), _ds()
    assert trainer_keywords(compiled, {}, cuda_available=False)["torch_compile"] is True
    assert "torch_compile" not in trainer_keywords(eager, {}, cuda_available=False)
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file

    (tmp_path / "ds.json").write_text(json.dumps(compiled))
    written = write_accelerate_config(tmp_path / "accelerate.yaml", accelerate_config(compiled, tmp_path / "ds.json"))
    assert load_config_from_file(str(written)).dynamo_config == {"dynamo_backend": "INDUCTOR"}
    assert "dynamo_config" not in accelerate_config(eager, tmp_path / "ds.json")
