"""Held-out benchmark: a Qwen2-shaped decoder LM built from its transformers config (random weights).

The shape of issue 11's report: 8 layers, hidden 512, grouped-query attention with 8 query and 2
key/value heads, vocabulary 32,000, sequence 256: about 57 M parameters, half of them in the
embedding and the untied LM head, so the logits (n x 256 x 32,000) dominate the activations.
"""

from __future__ import annotations

import torch

from autofit import Workload

VOCAB_SIZE = 32_000
SEQ_LEN = 256


def build_model(attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    if attention not in ("eager", "sdpa"):
        raise ValueError(f"attention must be 'eager' or 'sdpa' on this benchmark, but got {attention=}")
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
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
    return Workload(model=build_model, batch=make_batch, tokens_per_sample=SEQ_LEN, name="qwen2-57m")
