"""The CLI contracts: JSON shapes, exactly one candidate when everything is fixed, one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from autofit.cli import main
from autofit.core.config import CONFIG_KEYS
from autofit.planning.target import cli_fields

ROOT = Path(__file__).resolve().parent.parent
MLP = f"{ROOT}/examples/mlp.py:workload"
ALL_FIXED = [
    "--set", "micro_batch_size=2", "--set", "checkpoint_ratio=0.5", "--set", "precision=fp32",
    "--set", "optimizer=adamw", "--set", "zero_stage=1", "--set", "offload_optimizer=none",
    "--set", "offload_params=none", "--set", "attention=sdpa", "--set", "checkpoint_granularity=block",
    "--set", "compile=off",
    "--set", "overlap_comm=off", "--set", "contiguous_gradients=true", "--set", "bucket_scale=1",
    "--set", "hpz_partition_size=1", "--set", "tensor_parallel=1",
]


def invoke(*args: str) -> object:
    return CliRunner().invoke(main, list(args))


@pytest.mark.slow
def test_estimate_with_every_dimension_fixed_returns_exactly_that_candidate() -> None:
    result = invoke("estimate", MLP, "--hardware", "cpu", "--memory", "4GiB", "--global-batch", "8",
                    "--space", "cpu", *ALL_FIXED, "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["hardware"]["memory_bytes"] == 4 * 2**30
    (candidate,) = document["candidates"]
    assert candidate["config"] == {
        "micro_batch_size": 2, "grad_accum_steps": 4, "checkpoint_ratio": 0.5, "precision": "fp32",
        "optimizer": "adamw", "zero_stage": 1, "offload_optimizer": "none", "offload_params": "none",
        "attention": "sdpa", "checkpoint_granularity": "block", "compile": "off", "overlap_comm": False,
        "contiguous_gradients": True, "bucket_scale": 1, "hpz_partition_size": 1, "tensor_parallel": 1,
        "sequence_parallel": 1, "tiled_mlp": False, "tiled_loss": False, "offload_activations": "none",
        "quantized_weights": False, "quantized_gradients": False,
    }
    predicted = candidate["predicted"]
    assert set(predicted["breakdown"]) == {"params", "grads", "optimizer", "activations", "other"}
    assert sum(predicted["breakdown"].values()) == predicted["peak_bytes"]
    assert predicted["step_time_s"] > 0
    assert candidate["fits"] is True and candidate["reason"] is None
    ds = candidate["deepspeed"]
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 1


@pytest.mark.slow
def test_estimate_ranks_fitting_candidates_by_predicted_step_time() -> None:
    result = invoke("estimate", MLP, "--hardware", "cpu", "--memory", "300MiB", "--global-batch", "8",
                    "--space", "cpu", "--set", "precision=fp32", "--set", "zero_stage=0", "--json")
    assert result.exit_code == 0, result.output
    candidates = json.loads(result.stdout)["candidates"]
    fits = [c["fits"] for c in candidates]
    assert fits == sorted(fits, reverse=True)  # fitting ones first
    times = [c["predicted"]["step_time_s"] for c in candidates if c["fits"]]
    assert times == sorted(times)
    assert all(c["reason"] for c in candidates if not c["fits"])
    assert all(set(c["config"]) == set(CONFIG_KEYS) for c in candidates)
    # under a budget half of them fit: a DeepSpeed JSON for each config that would run, none for one that would not
    peaks = sorted(c["predicted"]["peak_bytes"] for c in candidates)
    budget = int(peaks[len(peaks) // 2] / (1 - 0.1)) // 2**20  # the default 10% margin (docs/design.md, "What fits")
    result = invoke("estimate", MLP, "--hardware", "cpu", "--memory", f"{budget}MiB", "--global-batch", "8",
                    "--space", "cpu", "--set", "precision=fp32", "--set", "zero_stage=0", "--json")
    halved = json.loads(result.stdout)["candidates"]
    assert 0 < sum(c["fits"] for c in halved) < len(halved)
    assert all(c["deepspeed"]["train_batch_size"] == 8 for c in halved if c["fits"])
    assert all(c["deepspeed"] is None for c in halved if not c["fits"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["estimate", f"{ROOT}/examples/missing.py:workload", "--hardware", "cpu"], "no such file"),
        (["estimate", f"{ROOT}/examples/mlp.py:nope", "--hardware", "cpu"], "has no function 'nope'"),
        (["estimate", MLP, "--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
        (["estimate", MLP, "--hardware", "cpu", "--memory", "lots"], "cannot parse memory size 'lots'"),
        (["estimate", MLP, "--hardware", "cpu", "--set", "colour=blue"], "unknown config key 'colour'"),
        (["estimate", MLP, "--hardware", "cpu", "--set", "zero_stage=7"], "zero_stage must be one of"),
        (["estimate", MLP, "--hardware", "cpu", "--space", "/nonexistent.yaml"], "/nonexistent.yaml"),
        (["estimate", MLP, "--hardware", "cpu", "--set", "attention=flash"], "flash"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(args: list[str], message: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autofit: error: ")
    assert message in lines[0]
    assert "Traceback" not in result.output


def test_bad_hosts_are_one_line_before_any_trace(tmp_path: Path) -> None:
    binary = tmp_path / "hosts.bin"
    binary.write_bytes(Path(sys.executable).read_bytes()[:4096])  # a program, not a hostfile
    shared = ["estimate", MLP, "--hardware", "cpu", "--nodes", "2"]
    for hosts, message in ((str(binary), f"cannot read the hostfile {binary}"),
                           ("onlyone", "--hosts names 1 host(s) (onlyone) for --nodes 2"),
                           ("-oProxyCommand=x,b", "'-oProxyCommand=x' is not a host name")):
        result = invoke(*shared, "--hosts", hosts)
        assert result.exit_code == 1, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("autofit: error: ") and message in lines[0], lines


def test_entry_that_raises_is_reported_not_crashed(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def workload():\n    raise RuntimeError('no data here')\n")
    result = invoke("estimate", f"{bad}:workload", "--hardware", "cpu")
    assert result.exit_code == 1
    assert "raised RuntimeError: no data here" in result.stderr


def test_entry_that_returns_the_wrong_type(tmp_path: Path) -> None:
    bad = tmp_path / "wrong.py"
    bad.write_text("def workload():\n    return 42\n")
    result = invoke("estimate", f"{bad}:workload", "--hardware", "cpu")
    assert result.exit_code == 1
    assert "must return an autofit.Workload" in result.stderr


def _shared_commands() -> dict[str, click.Command]:
    """Every command that takes the shared options, by its name on the command line."""
    schedule = main.commands["schedule"]
    assert isinstance(schedule, click.Group)
    return {"estimate": main.commands["estimate"], "probe": main.commands["probe"], "ladder": main.commands["ladder"],
            "run": main.commands["run"], "schedule add": schedule.commands["add"]}


def _describe(param: click.Parameter) -> tuple[object, ...]:
    """What a user sees of one parameter: its spelling, default, type, repeatability and help."""
    return (tuple(param.opts), param.default, repr(param.type), param.multiple, getattr(param, "help", None),
            getattr(param, "show_default", None), param.metavar)


def test_the_shared_options_are_on_every_command_with_the_same_defaults() -> None:
    shared = [f.name for f in cli_fields()] + ["as_json", "debug"]
    described = {}
    for name, command in _shared_commands().items():
        params = {param.name: param for param in command.params}
        assert set(shared) <= set(params), (name, set(shared) - set(params))
        # the command's own options come after the shared ones, which keep the order of the Target's fields
        assert [param.name for param in command.params[: len(shared)]] == shared, name
        described[name] = {key: _describe(params[key]) for key in shared}
    first = described.pop("estimate")
    for name, options in described.items():
        assert options == first, name
    # the Target's defaults are the command line's, so a notebook and the CLI ask for the same thing
    defaults = {f.name: f.default for f in cli_fields()}
    estimate = {param.name: param.default for param in main.commands["estimate"].params}
    assert {key: estimate[key] for key in defaults if key != "entry"} == {
        "hardware": "auto", "memory": None, "margin": 0.1, "gpus": None, "nodes": 1, "hosts": None, "global_batch": None,
        "space": None,
        "set_values": (), "nvme_path": None, "seq_len": None, "task": None, "trust_remote_code": False,
        "optimizer": None, "precision": None, "allow": (), "lr": None,
        "weight_decay": None, "betas": None, "eps": None, "momentum": None, "recipe_from": None, "software": None,
    } == {key: value for key, value in defaults.items() if key != "entry"}
    assert main.commands["run"].params[0].required is False  # script mode: ENTRY or --script
    assert main.commands["estimate"].params[0].required is True


def test_no_help_cites_internal_documents() -> None:
    runner = CliRunner()
    for name in _shared_commands():
        text = runner.invoke(main, [*name.split(), "--help"]).output
        assert "seed" not in text.lower(), name


@pytest.mark.slow
def test_estimate_an_hf_config_folder_with_its_sequence_length_and_task() -> None:
    result = invoke("estimate", f"hf:{ROOT}/examples/hf_configs/bert", "--seq-len", "64", "--task", "masked-lm",
                    "--hardware", "h100-80gb", "--global-batch", "4", *ALL_FIXED, "--json")
    assert result.exit_code == 0, result.output
    (candidate,) = json.loads(result.stdout)["candidates"]
    assert candidate["fits"] is True and candidate["predicted"]["peak_bytes"] > 0


def test_the_hf_options_on_another_entry_and_an_hf_entry_without_its_sequence_length_are_one_line_each() -> None:
    result = invoke("estimate", MLP, "--seq-len", "64", "--hardware", "cpu")
    assert result.exit_code == 1
    assert result.stderr.strip() == f"autofit: error: only an hf: entry takes --seq-len, but the entry is {MLP!r}"
    result = invoke("estimate", f"hf:{ROOT}/examples/hf_configs/llama_gqa", "--hardware", "cpu")
    assert result.exit_code == 1
    assert "needs a sequence length: pass --seq-len" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.slow
def test_estimate_names_the_models_parameters_as_transformers_counts_them() -> None:
    """The Llama-shaped example past its max_position_embeddings (128, rotary positions): planned, with the note in
    the JSON and a warning line on stderr; the parameter count is the model transformers builds from the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = ROOT / "examples" / "hf_configs" / "llama_gqa"
    long_context_off = ["--set", "sequence_parallel=1", "--set", "tiled_mlp=false", "--set", "tiled_loss=false",
                        "--set", "offload_activations=none"]
    result = invoke("estimate", f"hf:{folder}", "--seq-len", "256", "--hardware", "h100-80gb", "--global-batch", "4",
                    *ALL_FIXED, *long_context_off, "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    (candidate,) = document["candidates"]
    assert candidate["fits"] is True
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    n_params = sum(p.numel() for p in model.parameters())
    (note,) = document["model"]["notes"]
    assert document["model"] == {"name": "llama_gqa", "n_params": n_params, "n_trainable_params": n_params,
                                 "notes": [note]}
    assert "seq_len=256 is past the config's max_position_embeddings=128" in note
    assert f"autofit: warning: {note}" in result.stderr.splitlines()


@pytest.mark.slow
def test_clip_estimates_without_a_sequence_length_at_its_configs(tmp_path: Path) -> None:
    """``autofit estimate hf:<CLIP> --hardware cpu --memory 2GiB --global-batch 4`` without --seq-len: the text is
    planned at the config's max_position_embeddings, said under the model's line."""
    from transformers import CLIPConfig

    text = {"vocab_size": 64, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 8, "patch_size": 4}
    CLIPConfig(text_config=text, vision_config=vision, projection_dim=8,
               architectures=["CLIPModel"]).save_pretrained(tmp_path / "clip")
    result = invoke("estimate", f"hf:{tmp_path / 'clip'}", "--hardware", "cpu", "--memory", "2GiB", "--global-batch", "4",
                    *ALL_FIXED)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("model: clip, ") and lines[0].endswith(" trainable)")
    assert lines[1] == ("  note: seq_len=16: the config's max_position_embeddings, the length its text is trained at "
                        "(contrastive); --seq-len N plans another")
    assert "1 of 1 candidates fit" in result.stdout
    result = invoke("estimate", f"hf:{tmp_path / 'clip'}", "--seq-len", "17", "--hardware", "cpu")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1  # CLIP's text positions are a learned table
    assert "seq_len=17 is past the config's max_position_embeddings=16" in result.stderr
