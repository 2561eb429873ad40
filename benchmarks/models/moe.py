"""Held-out benchmark: a tiny Mixtral mixture-of-experts decoder (transformers, random weights).

4 experts per layer, top-2 routing: the parameters are ~4x a dense model's MLP
but each token's FLOPs and activations see only 2 experts, which a cost model
that counts FLOPs as 6 x params gets wrong. The router's auxiliary loss is on
(``output_router_logits``), as in real MoE training.

``layers`` is explicit: the repeated blocks are ``model.model.layers``. Whether
the longest ``nn.ModuleList`` finds them depends on the transformers version
(older ones keep the experts in a per-layer ``nn.ModuleList``, which with more
experts than layers would be picked instead; 5.x fuses them into 3-D parameters).
"""

from __future__ import annotations

import torch

from autofit import Workload

VOCAB_SIZE = 4096
SEQ_LEN = 128


def build_model(attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, MixtralConfig

    if attention not in ("eager", "sdpa"):
        raise ValueError(f"attention must be 'eager' or 'sdpa' on this benchmark, but got {attention=}")
    config = MixtralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ_LEN,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
        attn_implementation=attention,
    )
    return AutoModelForCausalLM.from_config(config)


def make_batch(n: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB_SIZE, (n, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def workload() -> Workload:
    return Workload(
        model=build_model,
        batch=make_batch,
        layers=decoder_layers,
        tokens_per_sample=SEQ_LEN,
        name="mixtral-moe-tiny",
    )
