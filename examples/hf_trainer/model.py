"""A small LLaMA-style causal LM from transformers, built from its config (random weights, no download).

``autofit run examples/hf_trainer/model.py:workload --hardware cpu --memory 2GiB --global-batch 8 --space cpu``
searches it; ``examples/hf_trainer/train.py`` then trains it with the Hugging Face ``Trainer`` and the
emitted JSON. The attention kernel is searched through ``attn_implementation`` (``eager`` or ``sdpa``;
``flash`` is ``flash_attention_2`` and needs flash-attn on CUDA), and the repeated layers checkpointing
may wrap are the decoder's ``model.model.layers``.
"""

from __future__ import annotations

import torch

from autofit import Workload

VOCAB_SIZE = 2048
SEQ_LEN = 128
#: autofit's attention names -> transformers' ``attn_implementation``
ATTN_IMPLEMENTATION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}


def build_model(attention: str = "sdpa") -> torch.nn.Module:
    """A 4-layer LlamaForCausalLM (1.5 M parameters), fp32, with the given attention kernel."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if attention not in ATTN_IMPLEMENTATION:
        raise ValueError(f"attention must be one of {', '.join(ATTN_IMPLEMENTATION)}, but got {attention=}")
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        use_cache=False,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation=ATTN_IMPLEMENTATION[attention])


def make_batch(n: int) -> dict[str, torch.Tensor]:
    """``n`` random sequences; the model shifts the labels itself (``labels = input_ids``)."""
    input_ids = torch.randint(0, VOCAB_SIZE, (n, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def workload() -> Workload:
    return Workload(
        model=build_model,
        batch=make_batch,
        layers=lambda model: model.model.layers,
        tokens_per_sample=SEQ_LEN,
        name="hf-llama-tiny",
    )
