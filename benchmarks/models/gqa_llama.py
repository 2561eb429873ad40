"""Held-out benchmark: a small LLaMA with grouped-query attention (transformers, random weights).

8 query heads share 2 key/value heads, so K/V projections (and their activations)
are a quarter of the query side: a cost model that assumes ``n_kv_heads ==
n_heads`` overestimates both parameters and activations here. SwiGLU MLP, RMSNorm,
rotary positions, untied LM head. The default layers (the longest
``nn.ModuleList``) are the decoder layers.
"""

from __future__ import annotations

import torch

from autofit import Workload

VOCAB_SIZE = 4096
SEQ_LEN = 128


def build_model(attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if attention not in ("eager", "sdpa"):
        raise ValueError(f"attention must be 'eager' or 'sdpa' on this benchmark, but got {attention=}")
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
        attn_implementation=attention,
    )
    return AutoModelForCausalLM.from_config(config)


def make_batch(n: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB_SIZE, (n, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids}


def workload() -> Workload:
    return Workload(model=build_model, batch=make_batch, tokens_per_sample=SEQ_LEN, name="llama-gqa-tiny")
