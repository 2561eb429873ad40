"""A LLaMA-7B-shaped model for PLANNING ONLY: ``autofit estimate`` on a GPU preset.

``autofit estimate examples/llama_7b.py:workload --hardware a100-80gb --gpus 8``

Random weights, built from a ``LlamaConfig`` with LLaMA-1 7B's shape (6.74 B
parameters, sequence 2048). autofit traces it on meta/fake tensors and never
allocates it for planning. Do NOT run ``autofit probe --mode real`` (or
``autofit run``) on it on a small machine: in fp32 with AdamW the real model
needs ~108 GB for weights, gradients and optimizer states before any activation.

Constructing it under ``with torch.device("meta"):`` takes a few seconds and no memory.
"""

from __future__ import annotations

import torch

from autofit import Workload

VOCAB_SIZE = 32000
SEQ_LEN = 2048


def config(attention: str = "sdpa"):
    from transformers import LlamaConfig

    if attention not in ("eager", "sdpa", "flash"):
        raise ValueError(f"attention must be 'eager', 'sdpa' or 'flash', but got {attention=}")
    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=4096,
        attn_implementation="flash_attention_2" if attention == "flash" else attention,
    )


def build_model(attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config(attention))


def make_batch(n: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB_SIZE, (n, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids}


def workload() -> Workload:
    return Workload(model=build_model, batch=make_batch, tokens_per_sample=SEQ_LEN, name="llama-7b")
