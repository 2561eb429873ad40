"""LLaMA-2-shaped models (7B, 13B, 70B; sequence 4096) for PLANNING ONLY: ``autofit estimate``.

``autofit estimate examples/llama2.py:llama2_70b --hardware h100-80gb --gpus 8 --nodes 8 --global-batch 1024``

Random weights from a ``LlamaConfig`` with LLaMA-2's published shapes (Touvron et al. 2023, table 1 and
the released configs: 70B has grouped-query attention with 8 KV heads). autofit traces them on
meta/fake tensors and never allocates them; do not probe them for real on a small machine.
"""

from __future__ import annotations

import functools

import torch

from autofit import Workload

VOCAB_SIZE = 32000
SEQ_LEN = 4096
#: name -> (hidden, intermediate, layers, heads, kv heads)
SHAPES = {
    "llama2-7b": (4096, 11008, 32, 32, 32),
    "llama2-13b": (5120, 13824, 40, 40, 40),
    "llama2-70b": (8192, 28672, 80, 64, 8),
}


def build_model(name: str, attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if attention not in ("eager", "sdpa", "flash"):
        raise ValueError(f"attention must be 'eager', 'sdpa' or 'flash', but got {attention=}")
    hidden, intermediate, layers, heads, kv_heads = SHAPES[name]
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=SEQ_LEN,
        attn_implementation="flash_attention_2" if attention == "flash" else attention,
    )
    return AutoModelForCausalLM.from_config(config)


def make_batch(n: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB_SIZE, (n, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids}


def _workload(name: str) -> Workload:
    return Workload(model=functools.partial(build_model, name), batch=make_batch, tokens_per_sample=SEQ_LEN, name=name)


def llama2_7b() -> Workload:
    return _workload("llama2-7b")


def llama2_13b() -> Workload:
    return _workload("llama2-13b")


def llama2_70b() -> Workload:
    return _workload("llama2-70b")
