"""``flash`` without flash-attn is traced as SDPA's flash backend; where that runs every SDPA call exactly as SDPA's
own choice does, the trace takes ``sdpa``'s profiles for ``flash`` instead of tracing it again
(:func:`autofit.trace.step.flash_traces_as_sdpa`), and they are the profiles tracing ``flash`` alone makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from autofit.trace import trace_workload
from autofit.trace.attention import SDPA_FLASH, flash_attn_installed
from autofit.trace.step import flash_traces_as_sdpa
from autofit.workload.hf import hf_workload

pytestmark = pytest.mark.skipif(flash_attn_installed(), reason="flash-attn is installed: flash traces through it")


def _saved(folder: Path, config: object) -> str:
    config.save_pretrained(folder)  # type: ignore[attr-defined]
    return str(folder)


def _llama(tmp_path: Path, layers: int, kv_heads: int, dropout: float = 0.0) -> str:
    from transformers import LlamaConfig

    return _saved(tmp_path / f"llama-{layers}-{kv_heads}-{dropout}", LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=kv_heads, attention_dropout=dropout, max_position_embeddings=64,
        architectures=["LlamaForCausalLM"]))


@pytest.mark.parametrize("layers", [2, 12], ids=["whole", "cut-and-scaled"])
def test_flash_takes_sdpas_profiles_where_they_are_the_ones_its_own_trace_makes(tmp_path: Path, layers: int) -> None:
    """A grouped-query Llama (``enable_gqa`` calls, the CPU's flash kernel either way), traced whole (2 layers) and
    cut (12): ``flash`` beside ``sdpa`` holds exactly the profiles ``flash`` traced alone holds, for every layout."""
    workload = hf_workload(_llama(tmp_path, layers, kv_heads=2), seq_len=32)
    assert flash_traces_as_sdpa(workload, "bf16", "cuda")
    kwargs = {"precisions": ("bf16",), "checkpoint_ratios": (0.0, 0.5, 1.0), "micro_batches": (1, 2),
              "sdpa_dispatch": "cuda"}
    both = trace_workload(workload, attentions=("sdpa", "flash"), **kwargs)
    alone = trace_workload(workload, attentions=("flash",), **kwargs)
    flash = {key: profile for key, profile in both.profiles.items() if profile.attention == "flash"}
    assert flash and flash == alone.profiles
    assert both.attention_traces["flash"] == alone.attention_traces["flash"] == SDPA_FLASH
    assert list(both.profiles)[:len(flash)] == [key.replace("flash", "sdpa") for key in flash]  # sdpa's first, as traced


def test_flash_is_traced_itself_where_the_stand_in_runs_a_call_otherwise(tmp_path: Path) -> None:
    """One key head broadcast without ``enable_gqa`` (SDPA's math path; the stand-in takes it grouped),
    DeepSeek-V2's values narrower than its queries (the math path; the stand-in pads them), and attention dropout on
    a CPU target (the CPU's flash kernel takes none; a CUDA target's trace drops it, so there it is the same)."""
    from tiny_attention import broadcast_mqa_workload
    from transformers import DeepseekV2Config

    deepseek = _saved(tmp_path / "deepseek", DeepseekV2Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, vocab_size=128, max_position_embeddings=64,
        architectures=["DeepseekV2ForCausalLM"]))
    assert not flash_traces_as_sdpa(broadcast_mqa_workload(), "bf16", "cuda")
    assert not flash_traces_as_sdpa(hf_workload(deepseek, seq_len=32), "bf16", "cuda")
    with_dropout = hf_workload(_llama(tmp_path, 2, kv_heads=2, dropout=0.1), seq_len=32)
    assert not flash_traces_as_sdpa(with_dropout, "fp32", "cpu")
    assert flash_traces_as_sdpa(with_dropout, "fp32", "cuda")
