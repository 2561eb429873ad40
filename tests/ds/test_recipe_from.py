"""The recipe read from what the user has (autofit.ds.recipe_from): a DeepSpeed JSON, checked against DeepSpeed's own
parse of it, and the Hugging Face Trainer's TrainingArguments (real objects, and their to_json_string output)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autofit.core.errors import AutofitError
from autofit.core.recipe import Recipe, for_plain_deepspeed, recipe_for, recipe_line
from autofit.ds.recipe_from import DEEPSPEED_OPTIMIZERS, ReadRecipe, from_deepspeed, from_training_arguments, read_recipe

ADAM_BF16 = {"train_batch_size": 8, "bf16": {"enabled": True},
             "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.1}}}


def _deepspeed_parse(ds: dict[str, Any]) -> tuple[str | None, str]:
    """DeepSpeed's own reading of ``ds``: its optimizer name and the precision its sections enable."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig(json.loads(json.dumps(ds)))
    precision = "bf16" if config.bfloat16_config.enabled else "fp16" if config.float16_config.enabled else "fp32"
    return config.optimizer_name, precision


@pytest.mark.parametrize(("ds", "optimizer", "hyperparameters"), [
    (ADAM_BF16, "adamw", {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}),
    ({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 0},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "adamw", {"lr": 1e-3}),
    ({"train_batch_size": 8, "optimizer": {"type": "Lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98],
                                                                     "weight_decay": 0.1}}},
     "lion", {"lr": 1e-4, "betas": (0.95, 0.98), "weight_decay": 0.1}),
    ({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}},
     "sgd", {"lr": 0.1, "momentum": 0.9}),
    ({"train_batch_size": 8, "bfloat16": {"enabled": True}, "optimizer": {"type": "Adafactor", "params": {"lr": 1e-3}}},
     "adafactor", {"lr": 1e-3}),
    # Adam in L2 mode computes AdamW's update when there is no decay to apply
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}},
     "adamw", {"lr": 1e-3}),
])
def test_a_deepspeed_json_states_what_deepspeed_reads_in_it(ds: dict[str, Any], optimizer: str,
                                                             hyperparameters: dict[str, Any]) -> None:
    read = from_deepspeed(ds)
    name, precision = _deepspeed_parse(ds)
    assert read.precision == precision
    assert DEEPSPEED_OPTIMIZERS[name] == optimizer  # the name as DeepSpeed normalizes it is the table's key
    assert read.optimizer == optimizer and dict(read.hyperparameters) == hyperparameters
    # what it states is a recipe autofit accepts
    assert Recipe(read.optimizer, read.precision, hyperparameters=read.hyperparameters).hyperparameters == hyperparameters


def test_auto_values_and_a_missing_optimizer_section_state_nothing() -> None:
    trainer_style = {"train_batch_size": "auto", "bf16": {"enabled": "auto"},
                     "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": 0.0}}}
    read = from_deepspeed(trainer_style)
    assert (read.optimizer, read.precision, dict(read.hyperparameters)) == ("adamw", None, {"weight_decay": 0.0})
    client = from_deepspeed({"train_batch_size": 8, "zero_optimization": {"stage": 2}})
    assert (client.optimizer, client.precision, dict(client.hyperparameters)) == (None, "fp32", {})
    assert _deepspeed_parse({"train_batch_size": 8})[1] == "fp32"  # DeepSpeed's own default


@pytest.mark.parametrize(("ds", "fragment"), [
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "1-bit Adam"),
    ({"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3}}}, "0/1 Adam"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "LAMB"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.01}}}, "L2"),
    ({"optimizer": {"type": "RMSprop", "params": {"lr": 1e-3}}}, "'RMSprop' is not one autofit models"),
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "torch_autocast"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both enabled"),
])
def test_what_autofit_does_not_model_is_one_line_naming_it_and_the_flag(ds: dict[str, Any], fragment: str) -> None:
    with pytest.raises(AutofitError) as exc:
        from_deepspeed(ds, source="ds.json (DeepSpeed JSON)")
    message = str(exc.value)
    assert "\n" not in message and fragment in message and message.startswith("ds.json")
    assert "--" in message or "enable the one" in message  # how to state the recipe instead


def _args(tmp_path: Path, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


@pytest.mark.parametrize(("optim", "optimizer", "keys"), [
    ("adamw_torch", "adamw", {"lr", "weight_decay", "betas", "eps"}),
    ("adamw_torch_fused", "adamw", {"lr", "weight_decay", "betas", "eps"}),
    ("adamw_bnb_8bit", "adamw8bit", {"lr", "weight_decay", "betas", "eps"}),
    ("paged_adamw_8bit", "adamw8bit", {"lr", "weight_decay", "betas", "eps"}),
    ("lion_32bit", "lion", {"lr", "weight_decay", "betas"}),
    ("adafactor", "adafactor", {"lr", "weight_decay"}),
    ("sgd", "sgd", {"lr", "weight_decay"}),
])
def test_training_arguments_give_the_trainers_optimizer_and_its_values(tmp_path: Path, optim: str, optimizer: str,
                                                                       keys: set[str]) -> None:
    args = _args(tmp_path, optim=optim, learning_rate=2e-4, weight_decay=0.1, adam_beta2=0.95, adam_epsilon=1e-6)
    read = from_training_arguments(args)
    assert (read.optimizer, read.precision) == (optimizer, "fp32")
    assert set(read.hyperparameters) == keys and read.hyperparameters["lr"] == 2e-4
    if "betas" in keys:
        assert read.hyperparameters["betas"] == (0.9, 0.95)
    # the object and its JSON say the same
    assert from_training_arguments(json.loads(args.to_json_string())) == read


def test_training_arguments_precision_sgd_momentum_and_an_unmodelled_optim(tmp_path: Path) -> None:
    assert from_training_arguments(_args(tmp_path, bf16=True)).precision == "bf16"
    sgd = from_training_arguments(_args(tmp_path, optim="sgd", optim_args="momentum=0.9,nesterov=True"))
    assert sgd.hyperparameters["momentum"] == 0.9
    with pytest.raises(AutofitError, match="optim 'galore_adamw' is not one autofit models.*--optimizer"):
        from_training_arguments(_args(tmp_path, optim="galore_adamw", optim_target_modules=["q"]))


def test_a_training_arguments_file_with_a_deepspeed_optimizer_trains_that_one_filled_from_the_arguments(
        tmp_path: Path) -> None:
    ds = {"train_batch_size": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "Lion", "params": {"lr": "auto", "betas": "auto", "weight_decay": 0.05}}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    args = json.loads(_args(tmp_path, bf16=True, learning_rate=1e-4, weight_decay=0.05, adam_beta2=0.98).to_json_string())
    # as to_json_string writes TrainingArguments(deepspeed="ds.json"), without starting the distributed backend
    # that constructing one with a DeepSpeed JSON does (half a minute here)
    path = tmp_path / "training_args.json"
    path.write_text(json.dumps(args | {"deepspeed": "ds.json"}))
    read = read_recipe(path)
    assert read.source == "training_args.json (TrainingArguments) and its DeepSpeed JSON"
    assert (read.optimizer, read.precision) == ("lion", "bf16")
    assert dict(read.hyperparameters) == {"lr": 1e-4, "betas": (0.9, 0.98), "weight_decay": 0.05}


def test_read_recipe_tells_the_two_files_apart_and_refuses_what_is_not_json(tmp_path: Path) -> None:
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps(ADAM_BF16))
    assert read_recipe(ds).source == "ds_config.json (DeepSpeed JSON)"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AutofitError, match="--recipe-from .*bad.json: cannot read it as JSON"):
        read_recipe(bad)
    with pytest.raises(AutofitError, match="cannot read it as JSON"):
        read_recipe(tmp_path / "missing.json")


@pytest.mark.parametrize(("content", "fragment"), [
    ({"optimizer": 5}, '"optimizer" must be an object with a string "type"'),
    ({"optimizer": {"type": 5, "params": "x"}}, '"optimizer" must be an object with a string "type"'),
    ({"optimizer": {"type": "AdamW", "params": "x"}}, '"optimizer.params" must be an object'),
    ({"learning_rate": "abc"}, "lr must be a number, but got 'abc'"),
    ({"learning_rate": 1e-4, "adam_beta1": "0.9"}, "betas must be a number"),
    ({}, "neither a DeepSpeed JSON .* nor a TrainingArguments JSON"),
    ({"steps": 10}, "neither a DeepSpeed JSON"),
    ([], "expected a JSON object, but got list"),
])
def test_a_file_of_the_wrong_shape_is_one_line_naming_what_is_wrong(tmp_path: Path, content: Any,
                                                                    fragment: str) -> None:
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(content))
    with pytest.raises(AutofitError, match=fragment):
        read_recipe(path)


def test_training_arguments_without_optim_train_with_the_trainers_default() -> None:
    """A TrainingArguments JSON that leaves ``optim`` out trains with the library's default (an AdamW)."""
    read = from_training_arguments({"learning_rate": 1e-4, "bf16": True})
    assert (read.optimizer, read.precision, dict(read.hyperparameters)) == ("adamw", "bf16", {"lr": 1e-4})


def test_the_read_recipe_fills_what_the_flags_leave_and_a_disagreement_is_refused() -> None:
    read = from_deepspeed(ADAM_BF16, source="ds.json (DeepSpeed JSON)")
    recipe = recipe_for({}, "cpu", True, read=read)
    assert (recipe.optimizer, recipe.precision) == ("adamw", "bf16")  # the JSON's bf16, not the CPU's fp32 default
    assert recipe.hyperparameters["lr"] == 3e-4
    assert recipe.source == "ds.json (DeepSpeed JSON): optimizer, precision, lr, weight_decay, betas, eps"
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    assert "read from ds.json (DeepSpeed JSON)" in recipe_line(recipe.to_dict())
    assert "source" not in Recipe().to_dict()
    # the same values stated twice are fine; different ones are one error naming the file
    assert recipe_for({}, "cpu", True, optimizer="adamw", hyperparameters={"lr": 3e-4}, read=read) == recipe
    with pytest.raises(AutofitError, match="ds.json .* says optimizer adamw, the command line lion"):
        recipe_for({}, "cpu", True, optimizer="lion", read=read)
    with pytest.raises(AutofitError, match="says precision bf16, the command line fp32"):
        recipe_for({"precision": "fp32"}, "cpu", True, read=read)
    with pytest.raises(AutofitError, match="says lr=0.0003, the command line 0.001"):
        recipe_for({}, "cpu", True, hyperparameters={"lr": 1e-3}, read=read)
    # what the source leaves out comes from the flags and the defaults
    partial = ReadRecipe(source="x", hyperparameters={"lr": 1e-3})
    assert recipe_for({}, "cuda", True, optimizer="sgd", read=partial) == Recipe(
        "sgd", "bf16", hyperparameters={"lr": 1e-3}, source="x: lr")


def test_script_mode_takes_the_rate_from_the_scripts_deepspeed_json() -> None:
    """No --lr: the JSON the script trains with gives it, so the written JSON carries the user's values, no auto."""
    recipe = for_plain_deepspeed(recipe_for({}, "cpu", False, read=from_deepspeed(ADAM_BF16)))
    assert recipe.optimizer_params("adamw") == {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}
    with pytest.raises(AutofitError, match="--recipe-from"):
        for_plain_deepspeed(recipe_for({}, "cpu", False, read=from_deepspeed({"train_batch_size": 8})))


@pytest.mark.slow
def test_the_cli_reads_the_recipe_from_a_file_and_says_so(tmp_path: Path) -> None:
    import sys

    from click.testing import CliRunner

    from autofit.cli import main

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tuner"))
    from tiny import ENTRY

    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps(ADAM_BF16))
    args = ["estimate", ENTRY, "--hardware", "h100-80gb", "--global-batch", "16", "--set", "micro_batch_size=4",
            "--set", "zero_stage=0", "--set", "checkpoint_ratio=0", "--recipe-from", str(ds)]
    result = CliRunner().invoke(main, args + ["--json"])
    assert result.exit_code == 0, result.output
    candidate = json.loads(result.stdout)["candidates"][0]
    assert (candidate["config"]["optimizer"], candidate["config"]["precision"]) == ("adamw", "bf16")
    assert candidate["deepspeed"]["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95],
                                                             "eps": 1e-8}
    assert candidate["deepspeed"]["autofit"]["recipe"]["source"].startswith("ds_config.json (DeepSpeed JSON)")
    table = CliRunner().invoke(main, args)
    assert "read from ds_config.json (DeepSpeed JSON)" in table.output
    refused = CliRunner().invoke(main, args + ["--optimizer", "lion"])
    assert refused.exit_code == 1 and "says optimizer adamw, the command line lion" in refused.output
