"""A small GPT decoder in plain torch: the README's CPU example.

``autofit run examples/gpt.py:workload --hardware cpu --memory 2GiB``

Token embedding + learned positions, ``n_layers`` pre-LN blocks (causal
self-attention + MLP) in one ``nn.ModuleList``, a final LayerNorm and an LM head
tied to the embedding. ``forward(input_ids, labels=None)`` returns the logits, or
the next-token cross-entropy when ``labels`` are given. At the default size
(~4.2 M parameters, vocabulary 4096, sequence 128) a micro-batch of 4 trains in fp32 on two CPU
cores in well under a second.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from autofit import Workload

VOCAB_SIZE = 4096
SEQ_LEN = 128
D_MODEL = 256
N_LAYERS = 4
N_HEADS = 4
ATTENTION_KERNELS = ("eager", "sdpa", "flash")


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError as exc:
        raise RuntimeError(
            "attention='flash' needs the flash-attn package (pip install 'autofit[flash]'), "
            "which is not installed; it also needs a CUDA device and fp16/bf16 activations"
        ) from exc
    return flash_attn_func


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: str) -> None:
        super().__init__()
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, but got {attention=}")
        if d_model % n_heads:
            raise ValueError(f"d_model must be divisible by n_heads, but got {d_model=} {n_heads=}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.attention = attention
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        # resolved at construction so a missing extra fails before any training starts
        self._flash = _flash_attn_func() if attention == "flash" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, self.head_dim).unbind(dim=2)  # each (b, s, h, hd)
        if self._flash is not None:
            # flash-attn takes (b, s, h, hd) directly
            y = self._flash(q, k, v, causal=True)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, h, s, hd)
            if self.attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
                scores = scores.masked_fill(mask, float("-inf"))
                y = scores.softmax(dim=-1) @ v
            y = y.transpose(1, 2)
        return self.proj(y.reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: str) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, attention)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        seq_len: int = SEQ_LEN,
        d_model: int = D_MODEL,
        n_layers: int = N_LAYERS,
        n_heads: int = N_HEADS,
        attention: str = "sdpa",
        tie_embeddings: bool = True,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, attention) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's init: N(0, 0.02) keeps the tied head's initial logits small (loss ~ ln(vocab))
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        s = input_ids.shape[1]
        if s > self.seq_len:
            raise ValueError(f"sequence length {s} exceeds the model's seq_len={self.seq_len}")
        positions = torch.arange(s, device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        # next-token prediction: position t predicts token t+1
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def build_model(attention: str = "sdpa") -> GPT:
    return GPT(attention=attention)


def make_batch(n: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB_SIZE, (n, SEQ_LEN))
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def workload() -> Workload:
    return Workload(
        model=build_model,
        batch=make_batch,
        layers=lambda model: model.blocks,
        tokens_per_sample=SEQ_LEN,
        name="gpt-small",
    )
