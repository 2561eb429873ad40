"""The Python API (autofit.commands): the same answers as the commands, typed options, one AutofitError per mistake."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import autofit
from autofit.cli import main
from autofit.commands import options as api_options
from autofit.commands.estimate import estimate as api_estimate
from autofit.commands.ladder import ladder as api_ladder
from autofit.commands.options import DeviceOptions, Options, RecipeOptions, SearchOptions
from autofit.commands.run import search as api_search
from autofit.core.errors import AutofitError
from autofit.planning.target import Target, cli_fields
from autofit.workload.entry import load_workload
from autofit.workload.types import Workload

ROOT = Path(__file__).resolve().parents[2]
TINY = f"{ROOT}/tests/tuner/tiny.py:tiny_workload"
#: every dimension fixed: one candidate, one trace (a GPU plan measures no CPU kernel footprint: quick)
FIXED: dict[str, Any] = {
    "micro_batch_size": 2, "checkpoint_ratio": 0.5, "precision": "bf16", "optimizer": "adamw", "zero_stage": 2,
    "offload_optimizer": "none", "offload_params": "none", "attention": "sdpa", "checkpoint_granularity": "block",
    "compile": "off",
    "overlap_comm": True, "contiguous_gradients": True, "bucket_scale": 4,
}


@pytest.fixture(scope="module")
def tiny() -> Workload:
    return load_workload(TINY)


def cli_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def test_import_autofit_is_light_and_its_api_is_functions_no_module_shadows() -> None:
    code = (
        "import sys, types; sys.modules['torch'] = None\n"
        "import autofit, autofit.commands.estimate, autofit.commands.run, autofit.commands.ladder\n"
        "import autofit.commands.probe, autofit.commands.schedule, autofit.cli\n"
        "import autofit.planning.estimate, autofit.planning.ladder, autofit.tuner.driver\n"
        "assert (autofit.estimate, autofit.search, autofit.ladder) == (autofit.commands.estimate.estimate, "
        "autofit.commands.run.search, autofit.commands.ladder.ladder)\n"
        "assert not {'optuna', 'sqlalchemy'} & set(sys.modules)\n"
        "assert not any(isinstance(getattr(autofit, n), types.ModuleType) for n in ('estimate', 'search', 'ladder'))\n"
        "assert type(sys.modules['autofit']) is types.ModuleType\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_shared_option_is_a_typed_keyword_with_the_commands_default() -> None:
    options = {f.name: f.default for f in cli_fields() if f.name != "entry"}
    options["set"] = options.pop("set_values")
    for function, left_out in ((api_estimate, set()), (api_search, set()), (api_ladder, {"space"})):
        parameters = inspect.signature(function).parameters
        assert list(parameters)[0] == "model"
        for name, default in options.items():
            if name in left_out:
                assert name not in parameters, (function.__name__, name)
                continue
            parameter = parameters[name]
            assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, (function.__name__, name)
            assert parameter.annotation != inspect.Parameter.empty, (function.__name__, name)
            expected = None if name == "set" else default  # set: a dict or strings, None for none
            assert parameter.default == expected, (function.__name__, name)
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()), function.__name__


@pytest.mark.slow
def test_estimate_answers_what_autofit_estimate_answers(tiny: Workload) -> None:
    command = cli_json("estimate", TINY, "--hardware", "h100-80gb", "--global-batch", "16", "--gpus", "2",
                       "--lr", "0.0003", *[arg for key, value in FIXED.items() for arg in ("--set", f"{key}={value}")])
    from_entry = autofit.estimate(TINY, hardware="h100-80gb", global_batch=16, gpus=2, set=FIXED, lr=3e-4)
    from_object = autofit.estimate(tiny, hardware="h100-80gb", global_batch=16, gpus=2,
                                   set=[f"{key}={value}" for key, value in FIXED.items()], lr="0.0003")
    assert from_entry.to_dict() == command == from_object.to_dict()
    (candidate,) = from_entry.candidates
    assert candidate.config.zero_stage == 2 and candidate.prediction.fits
    assert candidate.deepspeed["train_batch_size"] == 16 and candidate.deepspeed["zero_optimization"]["stage"] == 2
    assert candidate.deepspeed["zero_optimization"]["overlap_comm"] is True


def test_a_workload_object_on_the_cpu_is_priced_without_the_footprint_subprocess(tiny: Workload) -> None:
    """No other process can load a Workload object: the CPU kernel footprint keeps the cost model's default."""
    fixed = FIXED | {"precision": "fp32", "overlap_comm": False, "bucket_scale": 1}  # one rank: nothing to overlap
    result = autofit.estimate(tiny, hardware="cpu", memory="2GiB", global_batch=16, set=fixed)
    assert result.facts is not None and result.facts.kernel_footprint_bytes == {}
    (candidate,) = result.candidates
    assert candidate.prediction.peak_bytes > 0 and candidate.prediction.fits


@pytest.mark.slow
def test_ladder_is_priced_as_autofit_ladder_prices_it(tiny: Workload) -> None:
    command = cli_json("ladder", TINY, "--hardware", "h100-80gb", "--global-batch", "16", "--gpus", "2")
    lines: list[str] = []
    ladder = autofit.ladder(tiny, hardware="h100-80gb", global_batch=16, gpus=2, say=lines.append)
    assert ladder.to_dict() == command
    assert [row.rung.name for row in ladder.rows][0] == "baseline" and len(ladder.rows) == 6
    assert all(row.measured is None for row in ladder.rows) and lines == ["autofit: tracing tiny"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: autofit.estimate(42), "model must be an autofit.Workload, an entry point"),  # type: ignore[arg-type]
        (lambda m: autofit.estimate(m, gpus=0), "gpus must be an integer >= 1, but got gpus=0"),
        (lambda m: autofit.estimate(m, set=42), "set must be a dict of config keys"),  # type: ignore[arg-type]
        (lambda m: autofit.estimate(m, set={"zero_stage": 7}), "zero_stage"),
        (lambda m: autofit.estimate(m, lr=True), "lr must be a number, but got lr=True"),
        (lambda m: autofit.estimate(m, seq_len=64), "only an hf: entry takes --seq-len"),
        (lambda m: autofit.search(m), r"autofit.search runs the model in subprocesses.*pass the entry point"),  # type: ignore[arg-type]
        (lambda m: autofit.ladder(m, global_batch=16, measure=True), r"ladder\(measure=True\) runs the model in subprocesses"),
        (lambda m: autofit.ladder(m), "autofit ladder needs --global-batch"),
    ],
)
def test_a_mistake_is_one_autofit_error_before_anything_is_traced(tiny: Workload, call: Any, message: str) -> None:
    with pytest.raises(AutofitError, match=message):
        call(tiny)


def test_options_are_spelled_as_the_command_line_spells_them() -> None:
    assert api_options.set_pairs({"zero_stage": 2, "checkpoint_ratio": 0.5}) == ("zero_stage=2", "checkpoint_ratio=0.5")
    assert api_options.set_pairs("zero_stage=2") == ("zero_stage=2",) and api_options.set_pairs(None) == ()
    assert api_options.hyperparameter((0.9, 0.95), "betas") == "0.9,0.95"
    assert api_options.hyperparameter(3e-4, "lr") == "0.0003"
    assert api_options.names("fp8", "allow") == ("fp8",) and api_options.names(["fp8", "near"], "allow") == ("fp8", "near")
    options = Options.from_keywords(hardware="cpu", memory=2**30, space=Path("cpu.yaml"), optimizer="sgd",
                                    allow="fp16", lr=0.1, momentum=0.9)
    assert options.device == DeviceOptions(hardware="cpu", memory=2**30)
    assert options.search == SearchOptions(space=Path("cpu.yaml"))
    assert options.recipe == RecipeOptions(optimizer="sgd", allow="fp16", lr=0.1, momentum=0.9)
    assert options.target(TINY) == Target(
        entry=TINY, hardware="cpu", memory=2**30, space="cpu.yaml", optimizer="sgd", allow=("fp16",), lr="0.1",
        momentum="0.9")


def test_the_sections_hold_every_option_of_the_target_once() -> None:
    """Each CLI option (a Target field) is one section field, named alike (``set`` is ``--set``'s set_values):
    a Target makes its sections and back, and a new Target field without a section's fails here."""
    target = Target(entry=TINY, hardware="h100-80gb", memory="2GiB", gpus=2, nodes=2, hosts="a,b", global_batch=16,
                    space="cpu", set_values=("zero_stage=2",), nvme_path="/nvme", seq_len=64, task="causal-lm",
                    trust_remote_code=True, optimizer="sgd", precision="fp32", allow=("bf16",), recipe_from="ds.json",
                    lr="0.1", weight_decay="0.01", betas="0.9,0.95", eps="1e-08", momentum="0.9")
    assert Options.from_target(target).target(TINY) == target
    names = [f.name for section in api_options.SECTIONS.values() for f in dataclasses.fields(section)]
    assert len(names) == len(set(names))
    assert {api_options.TARGET_NAMES.get(n, n) for n in names} == {f.name for f in cli_fields()} - {"entry"}
    assert list(api_options.SECTIONS) == [f.name for f in dataclasses.fields(Options)]


def test_an_unknown_keyword_is_pythons_type_error(tiny: Workload) -> None:
    with pytest.raises(TypeError, match="harware"):
        autofit.estimate(tiny, harware="cpu")
    with pytest.raises(TypeError, match="space"):
        autofit.ladder(tiny, space="cpu")
    with pytest.raises(TypeError):
        autofit.estimate(tiny, "cpu")


SPACE = """\
global_batch_size: 16
micro_batch_size: [2, 4]
checkpoint_ratio: [0.0]
precision: [fp32]
optimizer: [sgd]
zero_stage: [0]
attention: [sdpa]
"""


@pytest.mark.slow  # real probes: DeepSpeed steps in subprocesses on the CPU, ~1 min on 2 cores
def test_search_returns_the_winner_writes_its_json_and_a_report(tmp_path: Path) -> None:
    space = tmp_path / "tiny.yaml"
    space.write_text(SPACE)
    events: list[Any] = []
    result = autofit.search(TINY, trials=2, out=tmp_path / "ds.json", report=tmp_path / "report",
                            storage=f"sqlite:///{tmp_path / 'study.db'}", hardware="cpu", memory="1GiB", space=space,
                            optimizer="sgd", precision="fp32", lr=0.01, on_event=events.append)
    assert json.loads((tmp_path / "ds.json").read_text()) == result.deepspeed
    assert result.deepspeed["train_batch_size"] == 16 and result.config.micro_batch_size in (2, 4)
    assert result.trials and any(t.config == result.config and t.phase == "verify" for t in result.trials)
    assert result.report_path == str(tmp_path / "report" / "index.html") and Path(result.report_path).is_file()
    assert events and events[-1].best is not None
