"""Four architectures of 0.6-0.8 B parameters for the GPU benchmark (transformers configs, random weights).

    llama   - a LLaMA/Qwen2-shaped decoder: grouped-query attention 12/4 heads, SwiGLU, RMSNorm, rotary,
              untied head; hidden 1536, 24 layers, vocabulary 32,000, sequence 1024 (~0.70 B)
    gpt2    - a GPT-2 large-shaped decoder: multi-head attention, GELU MLP, LayerNorm, learned positions,
              tied head; hidden 1280, 36 layers, sequence 1024 (~0.77 B)
    t5      - a T5-large-shaped encoder-decoder: 24 + 24 layers, d_model 1024, relative position bias,
              encoder 512 / decoder 128 tokens (~0.74 B)
    vit     - a ViT-Huge/14-shaped image classifier: 224 px, 32 layers, hidden 1280 (~0.63 B)

Each ``build_model(attention)`` takes ``eager``, ``sdpa`` or ``flash`` (transformers'
``flash_attention_2``, which needs flash-attn); the default layers are the longest ``nn.ModuleList``.
"""

from __future__ import annotations

import torch

from autofit import Workload

VOCAB_SIZE = 32_000
SEQ_LEN = 1024
T5_ENCODER_LEN, T5_DECODER_LEN = 512, 128
IMAGE_SIZE, PATCH_SIZE, N_CLASSES = 224, 14, 1000


def _implementation(attention: str) -> str:
    if attention not in ("eager", "sdpa", "flash"):
        raise ValueError(f"attention must be eager, sdpa or flash, but got {attention=}")
    return "flash_attention_2" if attention == "flash" else attention


def _tokens(n: int, length: int = SEQ_LEN) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB_SIZE, (n, length))
    return {"input_ids": input_ids, "labels": input_ids}


def llama_model(attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=1536, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False, attn_implementation=_implementation(attention),
    ))


def gpt2_model(attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config

    return AutoModelForCausalLM.from_config(GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=SEQ_LEN, n_embd=1280, n_layer=36, n_head=20, bos_token_id=0, eos_token_id=0,
        attn_implementation=_implementation(attention),
    ))


def t5_model(attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForSeq2SeqLM, T5Config

    return AutoModelForSeq2SeqLM.from_config(T5Config(
        vocab_size=VOCAB_SIZE, d_model=1024, d_kv=64, d_ff=4096, num_layers=24, num_decoder_layers=24,
        num_heads=16, attn_implementation=_implementation(attention) if attention != "flash" else "sdpa",
    ))


def t5_batch(n: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, VOCAB_SIZE, (n, T5_ENCODER_LEN)),
        "labels": torch.randint(0, VOCAB_SIZE, (n, T5_DECODER_LEN)),
    }


def vit_model(attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForImageClassification, ViTConfig

    return AutoModelForImageClassification.from_config(ViTConfig(
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_size=1280, num_hidden_layers=32,
        num_attention_heads=16, intermediate_size=5120, num_labels=N_CLASSES,
        attn_implementation=_implementation(attention) if attention != "flash" else "sdpa",
    ))


def vit_batch(n: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE), "labels": torch.randint(0, N_CLASSES, (n,))}


def llama() -> Workload:
    return Workload(model=llama_model, batch=_tokens, tokens_per_sample=SEQ_LEN, name="llama-0.7b")


def gpt2() -> Workload:
    return Workload(model=gpt2_model, batch=_tokens, tokens_per_sample=SEQ_LEN, name="gpt2-0.8b")


def t5() -> Workload:
    return Workload(model=t5_model, batch=t5_batch, tokens_per_sample=T5_ENCODER_LEN + T5_DECODER_LEN, name="t5-0.7b")


def vit() -> Workload:
    return Workload(model=vit_model, batch=vit_batch, name="vit-0.6b")
