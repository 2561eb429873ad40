"""Small models of different architectures for the probe benchmarks (entry points: ``probe_models.py:NAME``).

Self-contained on purpose: the benchmarks must not depend on examples/.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import autofit

SEQ = 128


class MLP(nn.Module):
    def __init__(self, width: int = 1024, n_layers: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(n_layers)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return F.cross_entropy(self.head(x), y)


class Block(nn.Module):
    def __init__(self, width: int, n_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, n_heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 8192, width: int = 512, n_layers: int = 6, n_heads: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(SEQ, width))
        self.blocks = nn.ModuleList(Block(width, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids[:, :-1]) + self.pos[: ids.shape[1] - 1]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


class CNN(nn.Module):
    def __init__(self, channels: int = 128, n_layers: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
            for _ in range(n_layers)
        )
        self.head = nn.Linear(channels, 100)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = x + layer(x)
        return F.cross_entropy(self.head(x.mean((2, 3))), y)


class LSTMTagger(nn.Module):
    def __init__(self, vocab: int = 16384, width: int = 512, n_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.LSTM(width, width, batch_first=True) for _ in range(n_layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids[:, :-1])
        for layer in self.layers:
            x = x + layer(x)[0]
        return F.cross_entropy(self.head(x).flatten(0, 1), ids[:, 1:].flatten())


def mlp() -> autofit.Workload:
    return autofit.Workload(model=MLP, batch=lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,))), name="mlp")


def gpt() -> autofit.Workload:
    return autofit.Workload(
        model=GPT, batch=lambda n: torch.randint(0, 8192, (n, SEQ)), tokens_per_sample=SEQ - 1, name="gpt"
    )


def cnn() -> autofit.Workload:
    return autofit.Workload(
        model=CNN, batch=lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 100, (n,))), name="cnn"
    )


def lstm() -> autofit.Workload:
    return autofit.Workload(
        model=LSTMTagger, batch=lambda n: torch.randint(0, 16384, (n, SEQ)), tokens_per_sample=SEQ - 1, name="lstm"
    )


def llama() -> autofit.Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, vocab_size=8192
    )

    def model(attention: str = "sdpa") -> nn.Module:
        config._attn_implementation = attention
        return LlamaForCausalLM(config)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 8192, (n, SEQ))
        return {"input_ids": ids, "labels": ids}

    return autofit.Workload(
        model=model, batch=batch, layers=lambda m: m.model.layers, tokens_per_sample=SEQ, name="llama"
    )


#: name -> micro-batch size the benchmarks use
MODELS = {"mlp": 64, "gpt": 8, "cnn": 16, "lstm": 8, "llama": 4}
