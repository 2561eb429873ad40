"""Held-out benchmark: a tiny Vision Transformer classifier (transformers, random weights).

64x64 RGB images in 8x8 patches: 64 patch tokens + [CLS], bidirectional attention.
An image workload, so ``tokens_per_sample`` is None (throughput in images/s). The
default layers (the longest ``nn.ModuleList``) are the encoder's ``ViTLayer``s.
"""

from __future__ import annotations

import torch

from autofit import Workload

IMAGE_SIZE = 64
PATCH_SIZE = 8
N_CLASSES = 100


def build_model(attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForImageClassification, ViTConfig

    if attention not in ("eager", "sdpa"):
        raise ValueError(f"ViT here supports attention 'eager' or 'sdpa', but got {attention=}")
    config = ViTConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        num_channels=3,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=1024,
        num_labels=N_CLASSES,
        attn_implementation=attention,
    )
    return AutoModelForImageClassification.from_config(config)


def make_batch(n: int) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE),
        "labels": torch.randint(0, N_CLASSES, (n,)),
    }


def workload() -> Workload:
    return Workload(model=build_model, batch=make_batch, name="vit-tiny")
