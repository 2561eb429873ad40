"""An ``hf:`` model's attention kernels come from its class (transformers' flags), and tasks it cannot train are one
line: Gemma-2 plans with the kernels it takes, Mamba with none, CLIP and Whisper with their own losses."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autofit import AutofitError
from autofit.core.software import Software
from autofit.core.space import space_from_dict
from autofit.machine.device import get_hardware
from autofit.planning.estimate import estimate
from autofit.planning.plan import Plan
from autofit.workload.hf import hf_workload

#: one candidate of every kernel the space lists, the rest fixed (one small trace)
SPACE = {"global_batch_size": 2, "micro_batch_size": [2], "precision": ["bf16"], "optimizer": ["adamw"],
         "zero_stage": [0], "checkpoint_ratio": [0.0], "compile": ["off"], "overlap_comm": [False],
         "bucket_scale": [1], "offload_optimizer": ["none"], "offload_params": ["none"]}


def _folder(tmp_path: Path, config: object, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    config.save_pretrained(folder)  # type: ignore[attr-defined]
    return str(folder)


def _one_line(info: pytest.ExceptionInfo[AutofitError], *fragments: str) -> None:
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def _plan(entry: str, workload: object, kernels: list[str]) -> Plan:
    space = space_from_dict(SPACE | {"attention": kernels}, name="kernels")
    return Plan.make(entry, workload, get_hardware("h100-80gb"), space, software=Software())  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_model_without_sdpa_plans_with_the_kernels_it_takes(tmp_path: Path) -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    if Gemma2ForCausalLM._supports_sdpa:  # transformers 5.0 built Gemma-2 with SDPA; later versions refuse it
        pytest.skip("this transformers builds Gemma-2 with sdpa")

    config = Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, architectures=["Gemma2ForCausalLM"])
    folder = _folder(tmp_path, config, "gemma2")
    workload = hf_workload(folder, seq_len=16)
    assert workload.kernels == ("eager", "flash") and "_supports_sdpa = False" in workload.kernel_note
    result = estimate(_plan(folder, workload, ["sdpa"]))  # the space's only kernel refused: the model's first
    assert {c.config.attention for c in result.candidates} == {"eager"}
    assert result.to_dict()["attention"] == {"kernels": ["eager", "flash"], "note": workload.kernel_note}
    with pytest.raises(AutofitError) as info:
        _plan(folder, workload, ["eager"]).make(folder, workload, get_hardware("h100-80gb"),
                                                space_from_dict(SPACE | {"attention": ["eager"]}, name="k"),
                                                fixed={"attention": "sdpa"}, software=Software())
    _one_line(info, "--set attention=sdpa cannot run", "eager, flash")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "falcon", "deepseek_v2"])
def test_flash_is_planned_by_default_where_sdpa_cannot_stand_in_as_it_is(tmp_path: Path, family: str) -> None:
    """Without flash-attn here, flash is traced through SDPA's flash backend: Gemma-2 refuses SDPA (its soft-capping
    flag), so transformers' SDPA function stands in under autofit's name; Falcon's multi-query attention hands SDPA
    one key head for all the query heads, which the flash backend takes as grouped-query attention, as flash-attn
    does; DeepSeek-V2's values are narrower than its queries, padded as transformers pads them for flash-attn. Each
    plans its default kernels, flash priced below eager (no S x S scores saved)."""
    from transformers import DeepseekV2Config, FalconConfig, Gemma2Config

    from autofit.trace.attention import SDPA_FLASH, flash_attn_installed

    if flash_attn_installed():
        pytest.skip("flash-attn is installed: flash traces through it")
    config = {
        "gemma2": lambda: Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       architectures=["Gemma2ForCausalLM"]),
        "falcon": lambda: FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       multi_query=True, new_decoder_architecture=False, alibi=False,
                                       architectures=["FalconForCausalLM"]),
        "deepseek_v2": lambda: DeepseekV2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                                                q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=8,
                                                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                                moe_intermediate_size=32, first_k_dense_replace=1, bos_token_id=0,
                                                eos_token_id=1, architectures=["DeepseekV2ForCausalLM"]),
    }[family]()
    folder = _folder(tmp_path, config, family)
    workload = hf_workload(folder, seq_len=64)
    result = estimate(_plan(folder, workload, ["eager", "flash"]))  # no sdpa beside eager: a CUDA plan keeps eager
    assert {c.config.attention for c in result.candidates} == set(workload.kernels) - {"sdpa"} == {"eager", "flash"}
    assert result.facts.attention_traces["flash"] == SDPA_FLASH
    traced = {k: result.facts.profile("bf16", k, False).points[-1].activation_bytes for k in ("eager", "flash")}
    assert traced["flash"] < traced["eager"]


def test_a_model_without_attention_plans_without_an_attention_key(tmp_path: Path) -> None:
    from transformers import MambaConfig

    config = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                         architectures=["MambaForCausalLM"])
    folder = _folder(tmp_path, config, "mamba")
    workload = hf_workload(folder, seq_len=4)
    assert workload.kernels == () and not workload.searches_attention and "no attention" in workload.kernel_note
    out = estimate(_plan(folder, workload, ["eager", "sdpa", "flash"])).to_dict()
    assert len(out["candidates"]) == 1 and out["attention"]["kernels"] == []
    candidate = out["candidates"][0]
    assert "attention" not in candidate["config"] and "attention" not in candidate["deepspeed"]["autofit"]
    assert "attention" not in json.dumps(candidate["deepspeed"]["autofit"]["config"])


def test_a_task_the_model_cannot_train_is_one_line(tmp_path: Path) -> None:
    from transformers import CLIPConfig, Speech2TextConfig, WhisperConfig

    clip = _folder(tmp_path, CLIPConfig(architectures=["CLIPModel"]), "clip")
    with pytest.raises(AutofitError) as info:
        hf_workload(clip, seq_len=None, task="vision-classification")
    _one_line(info, "contrastive dual encoder", "--task contrastive")
    whisper = _folder(tmp_path, WhisperConfig(architectures=["WhisperForConditionalGeneration"]), "whisper")
    with pytest.raises(AutofitError) as info:
        hf_workload(whisper, seq_len=16, task="seq2seq")
    _one_line(info, "no AutoModelForSeq2SeqLM class", "speech-seq2seq")
    speech = _folder(tmp_path, Speech2TextConfig(architectures=["Speech2TextForConditionalGeneration"]), "s2t")
    with pytest.raises(AutofitError) as info:
        hf_workload(speech, seq_len=16)
    _one_line(info, "cannot make the speech input of speech_to_text")


def test_contrastive_and_speech_tasks_train_with_their_own_losses(tmp_path: Path) -> None:
    from transformers import CLIPConfig, WhisperConfig

    text = {"vocab_size": 64, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 8, "patch_size": 4}
    clip = _folder(tmp_path, CLIPConfig(text_config=text, vision_config=vision, projection_dim=8,
                                        architectures=["CLIPModel"]), "clip")
    whisper = _folder(tmp_path, WhisperConfig(vocab_size=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                              decoder_start_token_id=3, d_model=16, encoder_layers=1, decoder_layers=1,
                                              encoder_attention_heads=2, decoder_attention_heads=2, num_mel_bins=8,
                                              max_source_positions=8, max_target_positions=16,
                                              encoder_ffn_dim=32, decoder_ffn_dim=32,
                                              architectures=["WhisperForConditionalGeneration"]), "whisper")
    for folder, layers in ((clip, 3), (whisper, 2)):
        workload = hf_workload(folder, seq_len=8)
        model = workload.build_model()
        assert len(workload.repeated_layers(model)) == layers and workload.tokens_per_sample is None
        loss = workload.compute_loss(model, workload.batch(2))
        assert loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()


@pytest.mark.slow
def test_a_model_without_attention_trains_from_a_json_that_names_no_kernel(tmp_path: Path) -> None:
    """The winner of a real search (one probe on this CPU) is written without an ``attention`` key, and the model
    builds and trains from that JSON as a user's script would (:func:`autofit.ds.apply.apply_to_model`)."""
    from hostile_helpers import autofit as run_autofit
    from transformers import MambaConfig

    config = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                         architectures=["MambaForCausalLM"])
    folder, out = _folder(tmp_path, config, "mamba"), tmp_path / "ds.json"
    res = run_autofit("run", f"hf:{folder}", "--seq-len", "8", "--hardware", "cpu", "--memory", "2GiB",
                      "--global-batch", "2", "--trials", "1", "--out", str(out), "--storage",
                      f"sqlite:///{tmp_path / 'a.db'}", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-600:]
    ds = json.loads(out.read_text())
    assert "attention" not in ds["autofit"] and "attention" not in ds["autofit"]["config"]
    from autofit.ds.apply import apply_to_model

    workload = hf_workload(folder, seq_len=8)
    model = workload.build_model(attention=ds["autofit"].get("attention"))
    apply_to_model(model, ds, workload.repeated_layers(model), workload.attention_of)
    loss = workload.compute_loss(model, workload.batch(2))
    loss.backward()
    assert torch.isfinite(loss)


def _tiny_mamba(tmp_path: Path) -> str:
    from transformers import MambaConfig

    config = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                         architectures=["MambaForCausalLM"])
    return _folder(tmp_path, config, "mamba")


@pytest.mark.slow
def test_a_slow_scan_model_is_refused_in_seconds_not_after_each_steps_limit(tmp_path: Path) -> None:
    """Mamba's reference scan loops over the tokens: at 100,000 of them a trace step would run for hours. With each
    step allowed an hour, the plan is still one line within two minutes (a step at a short length, timed and carried
    to the length), and a length it can step through plans."""
    from hostile_helpers import autofit as run_autofit
    from hostile_helpers import env as test_env

    folder = _tiny_mamba(tmp_path)
    args = ("estimate", f"hf:{folder}", "--hardware", "cpu", "--memory", "2GiB", "--global-batch", "2", "--no-cache")
    env = test_env() | {"AUTOFIT_TRACE_STEP_S": "3600"}
    refused = run_autofit(*args, "--seq-len", "100000", cwd=tmp_path, timeout=120, environ=env)
    lines = [line for line in refused.stderr.splitlines() if line.startswith("autofit: error")]
    assert refused.returncode == 1 and len(lines) == 1 and "loops over the tokens" in lines[0], refused.stderr[-600:]
    planned = run_autofit(*args, "--seq-len", "48", "--json", cwd=tmp_path, timeout=300, environ=env)
    assert planned.returncode == 0 and json.loads(planned.stdout)["candidates"], planned.stderr[-600:]


def test_a_kernel_the_model_cannot_run_is_left_out_of_the_plan_with_why(tmp_path: Path) -> None:
    """A model whose flash stand-in cannot be built: the plan keeps its other kernels and says why flash is not
    among them; with no kernel left, one error line."""
    from autofit.trace.attention import flash_attn_installed
    from autofit.workload.types import Workload

    if flash_attn_installed():
        pytest.skip("flash-attn is installed: flash traces through it")

    def build(attention: str = "eager") -> torch.nn.Module:
        if attention != "eager":
            raise ValueError(f"this model has no {attention} attention")
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))

    workload = Workload(model=build, batch=lambda n: torch.randn(n, 8), name="eager-only",
                        loss=lambda model, batch: model(batch).sum(), attention_kernels=("eager", "flash"))
    out = estimate(_plan("eager-only", workload, ["eager", "flash"])).to_dict()
    assert {c["config"]["attention"] for c in out["candidates"]} == {"eager"}
    (why,) = [r["reason"] for r in out["rejected"] if r["config"] == {"attention": "flash"}]
    assert "attention=flash could not be traced" in why and "no sdpa attention" in why
    with pytest.raises(AutofitError) as info:
        estimate(_plan("eager-only", replace(workload, attention_kernels=("flash",)), ["flash"]))
    _one_line(info, "cannot be traced with attention=flash")
