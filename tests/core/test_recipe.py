"""The user's recipe (autofit.core.recipe): the default search keeps it, each --allow tier adds exactly its substitutes,
the emitted JSON carries the user's hyperparameters (or "auto") and says what differs."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tuner"))
from tiny import ENTRY, tiny_workload  # noqa: E402

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.recipe import Recipe, differences, expand_allow, narrow_space, parse_hyperparameters, recipe_for
from autofit.core.space import load_space, space_from_dict
from autofit.ds.emit import check_with_deepspeed, deepspeed_config
from autofit.machine.device import get_hardware
from autofit.planning.estimate import estimate
from autofit.planning.ladder import ladder_plan, price_ladder
from autofit.planning.plan import Plan, default_recipe

ROOT = Path(__file__).resolve().parents[2]
H100 = get_hardware("h100-80gb")


def _no_bf16(hardware_name: str) -> object:
    hardware = get_hardware(hardware_name)
    return replace(hardware, peak_flops={k: v for k, v in hardware.peak_flops.items() if k != "bf16"})


def test_the_default_recipe_is_adamw_in_the_devices_training_precision() -> None:
    assert default_recipe(H100) == Recipe("adamw", "bf16")
    assert default_recipe(_no_bf16("a100-40gb")).precision == "fp16"  # type: ignore[arg-type]
    assert default_recipe(get_hardware("cpu")) == Recipe("adamw", "fp32")


def test_set_names_the_recipe_and_a_disagreeing_flag_is_refused() -> None:
    assert recipe_for({"optimizer": "lion"}, "cuda", True) == Recipe("lion", "bf16")
    assert recipe_for({}, "cuda", True, optimizer="SGD", precision="fp32") == Recipe("sgd", "fp32")
    with pytest.raises(AutofitError, match="--optimizer sgd and --set optimizer=lion disagree"):
        recipe_for({"optimizer": "lion"}, "cuda", True, optimizer="sgd")


@pytest.mark.parametrize(("optimizer", "precision", "near"), [
    ("adamw", "bf16", ("adamw8bit", "adam_mini", "fp8")),
    ("adamw", "fp32", ("adamw8bit", "adam_mini")),
    ("lion", "bf16", ("fp8",)),
    ("sgd", "fp32", ()),
])
def test_near_is_the_substitutes_that_apply_to_the_recipe(optimizer: str, precision: str, near: tuple[str, ...]) -> None:
    assert expand_allow(["near"], optimizer, precision) == near
    assert Recipe(optimizer, precision, allow=near).allow == near


@pytest.mark.parametrize(("allow", "message"), [
    ("lion", "name it as the recipe: --optimizer lion"),
    ("sgd", "name it as the recipe: --optimizer sgd"),
    ("adafactor", "name it as the recipe: --optimizer adafactor"),
    ("fp8", "not a substitute for the recipe adamw \\+ fp32"),
    ("nearish", "shortcuts: near"),
])
def test_a_different_optimizer_or_a_foreign_substitute_is_never_allowed(allow: str, message: str) -> None:
    with pytest.raises(AutofitError, match=message):
        Recipe("adamw", "fp32", allow=expand_allow([allow], "adamw", "fp32"))


def test_hyperparameters_are_checked_for_the_optimizer() -> None:
    recipe = Recipe("adamw", "bf16", hyperparameters=parse_hyperparameters(["lr=3e-4", "betas=0.9,0.95"]))
    assert recipe.hyperparameters == {"lr": 3e-4, "betas": (0.9, 0.95)}
    with pytest.raises(AutofitError, match="momentum=0.9 is not one adamw takes"):
        Recipe("adamw", "bf16", hyperparameters={"momentum": 0.9})
    with pytest.raises(AutofitError, match="lr must be a number > 0, but got 0"):
        Recipe("adamw", "bf16", hyperparameters={"lr": 0})
    with pytest.raises(AutofitError, match="betas must be two numbers"):
        Recipe("adamw", "bf16", hyperparameters={"betas": (0.9,)})
    with pytest.raises(AutofitError, match="unknown hyperparameter 'learning_rate'"):
        Recipe("adamw", "bf16", hyperparameters={"learning_rate": 1e-3})


def test_the_default_space_narrows_to_the_recipe_and_each_tier_adds_exactly_its_substitutes() -> None:
    space = load_space("default")
    exact = narrow_space(space, Recipe("adamw", "bf16"))
    assert (exact.values["optimizer"], exact.values["precision"]) == (("adamw",), ("bf16",))
    for allow, optimizers, precisions in [
        (("adamw8bit",), ("adamw", "adamw8bit"), ("bf16",)),
        (("adam_mini",), ("adamw", "adam_mini"), ("bf16",)),
        (("fp8",), ("adamw",), ("bf16", "fp8")),
        (("fp16",), ("adamw",), ("bf16", "fp16")),
        (expand_allow(["near"], "adamw", "bf16"), ("adamw", "adamw8bit", "adam_mini"), ("bf16", "fp8")),
    ]:
        narrowed = narrow_space(space, Recipe("adamw", "bf16", allow=allow))
        assert (narrowed.values["optimizer"], narrowed.values["precision"]) == (optimizers, precisions), allow
    # ZeRO++'s quantized communication is exact unless allowed; every other key keeps the space's values
    assert exact.values["quantized_weights"] == exact.values["quantized_gradients"] == (False,)
    recipe_keys = ("optimizer", "precision", "quantized_weights", "quantized_gradients")
    assert {k: v for k, v in exact.values.items() if k not in recipe_keys} == \
        {k: v for k, v in space.values.items() if k not in recipe_keys}


def test_a_space_without_the_recipes_value_is_one_clear_error() -> None:
    with pytest.raises(AutofitError, match="search space 'cluster' lists precision bf16, fp8, not the recipe's fp16"):
        narrow_space(load_space("cluster"), Recipe("adamw", "fp16"))


def test_differences_name_what_a_config_changes_and_what_it_means() -> None:
    recipe = Recipe("adamw", "bf16", allow=("fp8",))
    assert differences(recipe, Config(optimizer="adamw", precision="bf16")) == ()
    (fp8,) = differences(recipe, Config(precision="fp8"))
    assert (fp8.key, fp8.recipe, fp8.value, fp8.substitute, fp8.allowed) == ("precision", "bf16", "fp8", True, True)
    assert "float8" in fp8.meaning
    optimizer, precision = differences(recipe, Config(optimizer="sgd", precision="fp32"))
    assert not optimizer.substitute and "not the same training" in optimizer.meaning
    assert "more precise" in precision.meaning


@pytest.mark.slow
def test_the_default_estimate_never_yields_another_optimizer_or_precision() -> None:
    plan = Plan.make(ENTRY, tiny_workload(), H100, load_space("default"), global_batch=16)
    configs = {(c.optimizer, c.precision) for c in plan.candidates}
    assert configs == {("adamw", "bf16")}
    result = estimate(plan)
    assert result.recipe == Recipe("adamw", "bf16")
    for candidate in result.candidates:
        section = candidate.deepspeed["autofit"]
        assert section["differs_from_recipe"] == [] and section["recipe"]["optimizer"] == "adamw"
        assert candidate.deepspeed["optimizer"]["params"]["lr"] == "auto"


def test_allowing_near_adds_the_8bit_states_and_fp8_and_labels_them() -> None:
    recipe = Recipe("adamw", "bf16", allow=("adamw8bit", "fp8"))
    space = space_from_dict({"global_batch_size": 16, "micro_batch_size": [4], "optimizer": ["adamw", "adamw8bit", "lion"],
                             "precision": ["bf16", "fp8", "fp16"], "attention": ["sdpa"]}, name="small")
    plan = Plan.make(ENTRY, tiny_workload(), H100, space, global_batch=16, recipe=recipe)
    assert {c.optimizer for c in plan.candidates} <= {"adamw", "adamw8bit"}
    assert {c.precision for c in plan.candidates} <= {"bf16", "fp8"}
    assert any(c.optimizer == "adamw" and c.precision == "bf16" for c in plan.candidates)
    for candidate in estimate(plan).candidates:
        labelled = {d["value"] for d in candidate.deepspeed["autofit"]["differs_from_recipe"]}
        assert labelled == {candidate.config.optimizer, candidate.config.precision} - {"adamw", "bf16"}


def test_a_set_value_outside_the_recipe_is_refused() -> None:
    space = load_space("default")
    with pytest.raises(AutofitError, match="--set optimizer=lion is neither the recipe's optimizer adamw"):
        Plan.make(ENTRY, tiny_workload(), H100, space, global_batch=16, fixed={"optimizer": "lion"},
                  recipe=Recipe("adamw", "bf16"))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "lion", "adafactor"])
def test_the_json_carries_the_users_hyperparameters_and_deepspeed_accepts_it(optimizer: str) -> None:
    recipe = Recipe(optimizer, "bf16", hyperparameters={"lr": 3e-4, "weight_decay": 0.1})
    ds = deepspeed_config(Config(optimizer=optimizer, precision="bf16", zero_stage=1), 1, "cuda", recipe=recipe)
    assert ds["optimizer"]["params"]["lr"] == 3e-4 and ds["optimizer"]["params"]["weight_decay"] == 0.1
    assert ds["autofit"]["recipe"]["hyperparameters"] == {"lr": 3e-4, "weight_decay": 0.1}
    check_with_deepspeed(ds)


def test_without_hyperparameters_the_json_says_auto_for_the_trainer_and_deepspeed_accepts_it() -> None:
    ds = deepspeed_config(Config(precision="bf16"), 1, "cuda", recipe=Recipe("adamw", "bf16"))
    assert ds["optimizer"]["params"] | {} == {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"} | (
        {"torch_adam": True} if "torch_adam" in ds["optimizer"]["params"] else {})
    assert "Hugging Face Trainer" in ds["autofit"]["hyperparameters"]
    check_with_deepspeed(ds)
    # SGD's momentum is not one the Trainer fills: left to torch's default rather than made up
    sgd = deepspeed_config(Config(optimizer="sgd"), 1, "cuda", recipe=Recipe("sgd", "fp32"))
    assert "momentum" not in sgd["optimizer"]["params"]


def test_a_substitute_takes_the_recipes_hyperparameters_in_its_client_section() -> None:
    recipe = Recipe("adamw", "bf16", allow=("adamw8bit",), hyperparameters={"lr": 2e-4, "eps": 1e-6})
    ds = deepspeed_config(Config(optimizer="adamw8bit", precision="bf16"), 1, "cuda", recipe=recipe)
    assert ds["autofit"]["client_optimizer"]["params"] == {"lr": 2e-4, "weight_decay": "auto", "betas": "auto",
                                                           "eps": 1e-6}
    assert [d["value"] for d in ds["autofit"]["differs_from_recipe"]] == ["adamw8bit"]


def test_a_client_optimizer_fills_auto_from_the_script_and_refuses_to_make_one_up() -> None:
    import torch

    from autofit.ds.apply import client_optimizer

    ds = deepspeed_config(Config(optimizer="lion"), 1, "cpu", recipe=Recipe("lion", "fp32"))
    model = torch.nn.Linear(4, 4)
    with pytest.raises(AutofitError, match="lr is 'auto' in the JSON"):
        client_optimizer(model, ds)
    optimizer = client_optimizer(model, ds, lr=3e-3, weight_decay=0.0, betas=(0.9, 0.99))
    assert optimizer.param_groups[0]["lr"] == 3e-3


def test_a_probes_json_is_marked_as_measuring() -> None:
    ds = deepspeed_config(Config(), 1, "cpu")
    assert ds["autofit"]["hyperparameters"] == "measuring" and "recipe" not in ds["autofit"]
    assert isinstance(ds["optimizer"]["params"]["lr"], float)


def test_the_ladder_keeps_its_rungs_and_labels_what_differs_from_the_recipe() -> None:
    plan = ladder_plan(ENTRY, tiny_workload(), H100, world_size=1, global_batch=16)
    ladder = price_ladder(plan)
    assert len(ladder.rows) == 6
    labels = [row.recipe_label for row in ladder.rows]
    assert labels[0] == "not the recipe: fp32 for bf16"  # the fp32 baseline of a bf16 recipe
    assert labels[2] == "recipe"  # + mixed precision: bf16 AdamW is the recipe itself
    assert labels[3] == "substitute: adamw8bit for adamw"
    assert ladder.to_dict()["rungs"][3]["differs_from_recipe"][0]["allowed"] is False


@pytest.mark.slow
def test_the_7b_estimate_on_eight_h100s_keeps_adamw_and_bf16() -> None:
    """The issue's case: `autofit estimate examples/llama_7b.py:workload --hardware h100-80gb --gpus 8
    --global-batch 64` ranked fp8 with SGD, Lion and Adafactor in its top 25; the default recipe allows none."""
    from autofit.workload.entry import load_workload

    entry = f"{ROOT / 'examples' / 'llama_7b.py'}:workload"
    hardware = replace(H100, devices_per_node=8)
    plan = Plan.make(entry, load_workload(entry), hardware, load_space("default"), world_size=8, global_batch=64)
    assert {(c.optimizer, c.precision) for c in plan.candidates} == {("adamw", "bf16")}
    top = estimate(plan).candidates[:25]
    assert top and all(c.deepspeed["autofit"]["differs_from_recipe"] == [] for c in top)


def test_the_cli_states_the_recipe_and_its_tier() -> None:
    import json

    from click.testing import CliRunner

    from autofit.cli import main

    runner = CliRunner()
    args = ["estimate", ENTRY, "--hardware", "h100-80gb", "--global-batch", "16", "--set", "micro_batch_size=4",
            "--set", "zero_stage=0", "--set", "checkpoint_ratio=0", "--json"]
    exact = runner.invoke(main, args + ["--lr", "3e-4", "--betas", "0.9,0.95"])
    assert exact.exit_code == 0, exact.output
    candidates = json.loads(exact.stdout)["candidates"]
    assert {(c["config"]["optimizer"], c["config"]["precision"]) for c in candidates} == {("adamw", "bf16")}
    assert all(c["deepspeed"]["optimizer"]["params"]["lr"] == 3e-4 for c in candidates if c["fits"])
    assert candidates[0]["deepspeed"]["optimizer"]["params"]["betas"] == [0.9, 0.95]
    near = runner.invoke(main, args + ["--allow", "near"])
    assert near.exit_code == 0, near.output
    pairs = {(c["config"]["optimizer"], c["config"]["precision"]) for c in json.loads(near.stdout)["candidates"]}
    assert ("adamw", "bf16") in pairs and pairs <= {(o, p) for o in ("adamw", "adamw8bit", "adam_mini")
                                                   for p in ("bf16", "fp8")}
    named = runner.invoke(main, args + ["--optimizer", "lion"])
    assert {c["config"]["optimizer"] for c in json.loads(named.stdout)["candidates"]} == {"lion"}
    refused = runner.invoke(main, args + ["--allow", "lion"])
    assert refused.exit_code == 1 and "name it as the recipe: --optimizer lion" in refused.output


def test_script_mode_needs_the_users_rate_and_writes_no_auto() -> None:
    """An unmodified script hands the JSON to deepspeed.initialize, which fills no "auto" (DeepSpeed's AdamW then
    fails unpacking the string betas): the rate is required, the rest is left to the optimizer's defaults."""
    from autofit.core.recipe import for_plain_deepspeed

    with pytest.raises(AutofitError, match="--lr"):
        for_plain_deepspeed(Recipe("adamw", "fp32"))
    plain = for_plain_deepspeed(Recipe("adamw", "fp32", hyperparameters={"lr": 3e-4, "betas": (0.9, 0.95)}))
    ds = deepspeed_config(Config(micro_batch_size=2, optimizer="adamw"), device_kind="cpu", recipe=plain)
    params = {k: v for k, v in ds["optimizer"]["params"].items() if k != "torch_adam"}
    assert params == {"lr": 3e-4, "betas": [0.9, 0.95]}
    assert Recipe.from_dict(plain.to_dict()) == plain
