"""``hf:`` entries: the entry string, the task from the config, the batches, the one-line errors, the blocks."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autofit import AutofitError
from autofit.probe.spec import probe_spec
from autofit.workload.entry import load_workload
from autofit.workload.hf import HfEntry, HfOptions, hf_workload, load_config, task_from_config, with_hf_options
from autofit.workload.hf_tasks import attention_blocks

ROOT = Path(__file__).resolve().parents[2]


def _memory_accuracy():  # noqa: ANN202
    """benchmarks/accuracy/memory_accuracy.py, whose HF_TWINS pairs each shipped config with its hand-written twin."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_accuracy", ROOT / "benchmarks" / "accuracy" / "memory_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONFIGS = ROOT / "examples" / "hf_configs"
#: each shipped config and the task its ``architectures`` names
FAMILIES = {
    "llama_gqa": "causal-lm", "mixtral_moe": "causal-lm", "mistral_sliding": "causal-lm",
    "deepseek_v3_mla": "causal-lm", "t5_encdec": "seq2seq", "bert": "classification",
    "vit": "vision-classification",
}


def _one_line(exc: pytest.ExceptionInfo[AutofitError], *fragments: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_the_entry_string_round_trips_its_options_in_canonical_order() -> None:
    entry = HfEntry.parse("hf:org/name?task=seq2seq&target_len=64&seq_len=128&trust_remote_code=TRUE")
    assert entry == HfEntry("org/name", HfOptions(seq_len=128, target_len=64, task="seq2seq", trust_remote_code=True))
    assert entry.to_entry() == "hf:org/name?seq_len=128&target_len=64&task=seq2seq&trust_remote_code=true"
    assert HfEntry.parse(entry.to_entry()) == entry
    assert HfEntry.parse("hf:org/name").to_entry() == "hf:org/name"


@pytest.mark.parametrize(("entry", "fragment"), [
    ("hf:org/name?seq_len=0", "seq_len"),
    ("hf:org/name?seq_len=abc", "seq_len"),
    ("hf:org/name?task=translation", "task"),
    ("hf:org/name?attention=xformers", "attention"),
    ("hf:org/name?trust_remote_code=maybe", "trust_remote_code"),
    ("hf:org/name?batch=3", "unknown option 'batch'"),
    ("hf:org/name?seq_len=8&task=causal-lm&target_len=4", "target_len"),
    ("hf:", "source"),
])
def test_a_bad_option_in_the_entry_string_is_one_line_naming_it(entry: str, fragment: str) -> None:
    with pytest.raises(AutofitError) as exc:
        HfEntry.parse(entry)
    _one_line(exc, fragment)


def test_the_cli_options_fold_into_an_hf_entry_and_are_refused_for_any_other() -> None:
    assert with_hf_options("hf:org/name?task=masked-lm", seq_len=256) == "hf:org/name?seq_len=256&task=masked-lm"
    assert with_hf_options("hf:org/name?seq_len=64", seq_len=None, task="causal-lm", trust_remote_code=True) == \
        "hf:org/name?seq_len=64&task=causal-lm&trust_remote_code=true"
    assert with_hf_options("examples/mlp.py:workload") == "examples/mlp.py:workload"
    with pytest.raises(AutofitError) as exc:
        with_hf_options("examples/mlp.py:workload", seq_len=128, trust_remote_code=True)
    _one_line(exc, "only an hf: entry takes --seq-len, --trust-remote-code", "examples/mlp.py:workload")


def test_a_local_folder_is_made_absolute_for_processes_started_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    entry = HfEntry.parse("hf:examples/hf_configs/vit?seq_len=8").absolute()
    assert entry.to_entry() == f"hf:{CONFIGS / 'vit'}?seq_len=8"
    assert HfEntry.parse("hf:org/name").absolute().source == "org/name"


@pytest.mark.parametrize(("family", "task"), FAMILIES.items())
def test_the_task_comes_from_the_configs_architectures(family: str, task: str) -> None:
    assert task_from_config(load_config(str(CONFIGS / family)), family) == task


def test_an_architecture_outside_transformers_gets_its_task_from_its_name_and_a_bare_model_none(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    assert task_from_config(LlamaConfig(architectures=["MyOwnForCausalLM"]), "x") == "causal-lm"
    with pytest.raises(AutofitError) as exc:
        task_from_config(LlamaConfig(architectures=["LlamaModel"]), "x")
    _one_line(exc, "LlamaModel", "--task")
    with pytest.raises(AutofitError) as exc:
        task_from_config(LlamaConfig(), "x")
    _one_line(exc, "names no architectures", "--task")


def _shapes(batch: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in batch.items()}


def test_each_task_gets_its_inputs_and_labels_and_its_tokens_per_sample() -> None:
    llama = hf_workload(str(CONFIGS / "llama_gqa"), seq_len=32)
    assert _shapes(llama.batch(3)) == {"input_ids": (3, 32), "labels": (3, 32)}
    assert llama.tokens_per_sample == 32 and llama.name == "llama_gqa"
    masked = hf_workload(str(CONFIGS / "bert"), seq_len=16, task="masked-lm")
    assert _shapes(masked.batch(2)) == {"input_ids": (2, 16), "labels": (2, 16)}
    classify = hf_workload(str(CONFIGS / "bert"), seq_len=16)
    batch = classify.batch(2)
    assert _shapes(batch) == {"input_ids": (2, 16), "attention_mask": (2, 16), "labels": (2,)}
    assert int(batch["labels"].max()) < 4  # the config's num_labels
    t5 = hf_workload(str(CONFIGS / "t5_encdec"), seq_len=32, target_len=8)
    assert _shapes(t5.batch(2)) == {"input_ids": (2, 32), "attention_mask": (2, 32), "labels": (2, 8)}
    assert t5.tokens_per_sample == 40
    assert hf_workload(str(CONFIGS / "t5_encdec"), seq_len=32).tokens_per_sample == 64
    vit = hf_workload(str(CONFIGS / "vit"), seq_len=None)
    batch = vit.batch(2)
    assert _shapes(batch) == {"pixel_values": (2, 3, 64, 64), "labels": (2,)}
    assert batch["pixel_values"].dtype == torch.float32 and vit.tokens_per_sample is None


def test_the_model_is_fp32_with_the_asked_kernel_and_the_search_may_choose_it() -> None:
    workload = load_workload(f"hf:{CONFIGS / 'llama_gqa'}?seq_len=16&attention=eager")
    assert workload.searches_attention
    with torch.device("meta"):
        default = workload.build_model()
        sdpa = workload.build_model(attention="sdpa")
    assert default.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    assert {p.dtype for p in default.parameters()} == {torch.float32}
    # the config's own dtype (bf16 in most Hub configs) does not decide the build
    config = json.loads((CONFIGS / "llama_gqa" / "config.json").read_text())
    assert "dtype" not in config and "torch_dtype" not in config


def test_a_real_step_of_a_shipped_config_trains() -> None:
    workload = load_workload(f"hf:{CONFIGS / 'bert'}?seq_len=16&task=masked-lm")
    model = workload.build_model(attention="eager")
    loss = workload.compute_loss(model, workload.batch(2))
    loss.backward()
    assert torch.isfinite(loss) and model.bert.embeddings.word_embeddings.weight.grad is not None


def test_the_blocks_are_the_encoders_then_the_decoders_for_an_encoder_decoder() -> None:
    workload = load_workload(f"hf:{CONFIGS / 't5_encdec'}?seq_len=16")
    with torch.device("meta"):
        model = workload.build_model()
    blocks = workload.repeated_layers(model)
    assert blocks == [*model.encoder.block, *model.decoder.block]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()
        self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(8))


def test_the_blocks_are_the_lists_holding_attention_not_a_longer_list_of_experts() -> None:
    model = nn.Sequential(nn.ModuleList([_Block(), _Block()]))
    assert attention_blocks(model) == list(model[0])
    plain = nn.Sequential(nn.ModuleList(nn.Linear(2, 2) for _ in range(3)))
    assert attention_blocks(plain) == list(plain[0])  # no attention anywhere: the longest list


def test_a_text_task_needs_a_sequence_length_within_a_table_of_positions_and_vision_takes_none() -> None:
    with pytest.raises(AutofitError) as exc:
        load_workload(f"hf:{CONFIGS / 'llama_gqa'}")
    _one_line(exc, "--seq-len")
    with pytest.raises(AutofitError) as exc:  # BERT's learned positions: 128 rows
        load_workload(f"hf:{CONFIGS / 'bert'}?seq_len=4096")
    _one_line(exc, "seq_len=4096", "max_position_embeddings=128")
    assert load_workload(f"hf:{CONFIGS / 'llama_gqa'}?seq_len=4096").tokens_per_sample == 4096  # rotary: planned
    with pytest.raises(AutofitError) as exc:
        load_workload(f"hf:{CONFIGS / 'vit'}?seq_len=128")
    _one_line(exc, "image_size")


def test_a_name_neither_cached_nor_reachable_offline_is_one_line_saying_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AutofitError) as exc:
        load_workload("hf:autofit-tests/no-such-model?seq_len=8")
    _one_line(exc, "hf:autofit-tests/no-such-model", "local Hugging Face cache", "HF_HUB_OFFLINE", "hf download")


def test_a_folder_without_config_json_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(AutofitError) as exc:
        load_workload(f"hf:{tmp_path}?seq_len=8")
    _one_line(exc, str(tmp_path), "no config.json")


REMOTE_CONFIG = """
from transformers import LlamaConfig

class TinyRemoteConfig(LlamaConfig):
    model_type = "autofit_tiny_remote"
"""


def test_a_configs_own_code_runs_only_when_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import dynamic_module_utils

    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "configuration_tiny.py").write_text(textwrap.dedent(REMOTE_CONFIG))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "autofit_tiny_remote", "architectures": ["TinyRemoteForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tiny.TinyRemoteConfig"}, "hidden_size": 64,
    }))
    with pytest.raises(AutofitError) as exc:
        load_workload(f"hf:{folder}?seq_len=8")
    _one_line(exc, "--trust-remote-code")
    # transformers copies the trusted code into its modules cache: a temporary one here
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    config = load_config(str(folder), trust_remote_code=True)
    assert type(config).__name__ == "TinyRemoteConfig" and config.hidden_size == 64
    assert task_from_config(config, "remote") == "causal-lm"


def test_a_queued_hf_entry_is_absolute_and_its_fingerprint_follows_its_config_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autofit.schedule.submit import absolute_entry
    from autofit.workload.sources import workload_fingerprint

    folder = tmp_path / "llama"
    folder.mkdir()
    config = json.loads((CONFIGS / "llama_gqa" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    entry = absolute_entry("hf:llama?seq_len=16")
    assert entry == f"hf:{folder}?seq_len=16"
    before = workload_fingerprint(entry, load_workload(entry))
    # a change the module tree does not show (the rotary base) is still another workload
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0}))
    assert workload_fingerprint(entry, load_workload(entry)) != before


#: each shipped config as an entry, and its hand-written twin in benchmarks/ or examples/ (same model, same batch):
#: the table the memory benchmark's --hf-twins rows are built from
ESTIMATED = _memory_accuracy().HF_TWINS
#: one candidate with every key fixed: bf16, ZeRO-2, half the blocks checkpointed (the blocks matter)
FIXED = {"micro_batch_size": 4, "checkpoint_ratio": 0.5, "checkpoint_granularity": "block", "precision": "bf16",
         "optimizer": "adamw", "zero_stage": 2, "offload_optimizer": "none", "offload_params": "none",
         "attention": "sdpa", "compile": "off", "overlap_comm": False, "contiguous_gradients": True, "bucket_scale": 1,
         "hpz_partition_size": 1, "tensor_parallel": 1, "sequence_parallel": 1, "tiled_mlp": False, "tiled_loss": False,
         "offload_activations": "none", "quantized_weights": False, "quantized_gradients": False}


def _estimated_peak(entry: str, hardware: str = "h100-80gb", attention: str = "sdpa") -> tuple[int, int]:
    """What ``autofit estimate ENTRY --set ...`` predicts for :data:`FIXED` with ``attention``: the peak and the
    parameters."""
    from autofit.core.space import load_space
    from autofit.machine.device import get_hardware
    from autofit.planning.estimate import estimate
    from autofit.planning.plan import Plan

    fixed = {**FIXED, "attention": attention}
    plan = Plan.make(entry, load_workload(entry), get_hardware(hardware), load_space(None), world_size=2,
                     global_batch=8, fixed=fixed)
    (candidate,) = estimate(plan).candidates
    assert candidate.config.to_dict() == {**fixed, "grad_accum_steps": 1}
    assert candidate.prediction.fits, candidate.prediction.reason
    return candidate.prediction.peak_bytes, plan.facts.n_params


@pytest.mark.slow
@pytest.mark.parametrize("family", ESTIMATED)
def test_each_family_estimates_through_hf_as_its_hand_written_twin(family: str) -> None:
    options, twin = ESTIMATED[family]
    entry = f"hf:{CONFIGS / family}" + (f"?{options}" if options else "")
    # SDPA where the installed transformers builds the class with it (T5 from 5.15 on), else its first kernel
    kernels = load_workload(entry).kernels or ("sdpa",)
    attention = "sdpa" if "sdpa" in kernels else kernels[0]
    peak, n_params = _estimated_peak(entry, attention=attention)
    assert peak > 2 * n_params  # bf16 weights alone
    if twin is not None:
        twin_peak, twin_params = _estimated_peak(f"{ROOT / twin}", attention=attention)
        assert n_params == twin_params
        assert abs(peak - twin_peak) <= 0.02 * twin_peak, (peak, twin_peak)


@pytest.mark.slow
def test_a_cpu_plan_measures_the_hf_models_footprint_in_a_process_that_reloads_the_entry() -> None:
    """The footprint runs in a fresh process given only the entry string: the options travel inside it."""
    entry = f"hf:{CONFIGS / 'llama_gqa'}?seq_len=128"
    peak, _ = _estimated_peak(entry, "cpu")
    twin_peak, _ = _estimated_peak(f"{ROOT / 'benchmarks/models/gqa_llama.py:workload'}", "cpu")
    # the two footprints are two measurements (0.4 % apart here), not one number
    assert abs(peak - twin_peak) <= 0.02 * twin_peak, (peak, twin_peak)


@pytest.mark.slow
def test_an_hf_entry_probes_under_zero3_with_the_searched_kernel() -> None:
    """A real probe: each rank re-loads the entry string, builds the model with from_config under zero.Init."""
    from autofit.core.config import Config
    from autofit.machine.device import get_hardware
    from autofit.probe.run import run_probe

    entry = f"hf:{CONFIGS / 'mixtral_moe'}?seq_len=32"
    config = Config(precision="bf16", zero_stage=3, micro_batch_size=2, checkpoint_ratio=0.5, attention="eager")
    result = run_probe(probe_spec(entry, config, get_hardware("cpu"), world_size=2, steps=1), timeout_s=300)
    assert result.status == "ok", result.message
    assert result.tokens_per_s == pytest.approx(32 * result.samples_per_s)
    # ZeRO-3: each of the two ranks holds half the 9.4 M parameters
    assert result.per_rank_param_elements == [pytest.approx(9443584 / 2, rel=0.01)] * 2
