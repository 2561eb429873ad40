"""The build-along model of seed 004 ("8.1 Memory Optimization", section 5), as written there.

``autofit ladder examples/seed_build_along.py:workload --hardware rtx4090 --global-batch 16``

``LargeTransformer`` and its ``TransformerBlock`` are the seed's code: a token embedding of
50,257 x 2,048, learned positions, 24 post-residual blocks of ``nn.MultiheadAttention``
(32 heads, called with its default ``need_weights=True``, as the seed calls it) and a GELU MLP of
d_ff 8,192, a final LayerNorm and an untied 2,048 x 50,257 head; sequence 1,024, batch 16, and
the seed's loss (cross-entropy over the flattened logits).

The seed calls it "~350M params, ~1.4 GB params, ~5.6 GB total". Counted (``autofit ladder``
prints it; ``sum(p.numel())`` agrees), it has 1,416,552,448 parameters, about 4x that: 5.3 GiB of
fp32 weights and ~21 GiB of weights, gradients and AdamW states before any activation, so on a
24 GB card the seed's baseline cannot fit whatever the batch. The seed's "~1.4 GB" is ~350 M x
4 bytes: its figures are of a model about a quarter of this size.

For planning only at full size (autofit traces it on fake tensors); ``workload_tiny`` is the same
code at toy size, for the tests and for a ladder a laptop CPU can ``--measure``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autofit import Workload

VOCAB_SIZE = 50257
SEQ_LEN = 1024
#: the tiny variant: the same classes, a model a CPU trains in well under a second a step
TINY = {"vocab_size": 256, "d_model": 64, "n_heads": 4, "d_ff": 256, "n_layers": 4, "max_seq_len": 128}


class TransformerBlock(torch.nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.ff = torch.nn.Sequential(
            torch.nn.Linear(d_model, d_ff),
            torch.nn.GELU(),
            torch.nn.Linear(d_ff, d_model),
        )
        self.norm1 = torch.nn.LayerNorm(d_model)
        self.norm2 = torch.nn.LayerNorm(d_model)

    def forward(self, x):
        # Standard forward -- activations stored for backward
        normed = self.norm1(x)
        attn_out, _ = self.attn(normed, normed, normed)
        x = x + attn_out
        x = x + self.ff(self.norm2(x))
        return x


class LargeTransformer(nn.Module):
    """A transformer large enough to OOM on consumer GPUs."""
    def __init__(self, vocab_size=50257, d_model=2048, n_heads=32,
                 d_ff=8192, n_layers=24, max_seq_len=1024):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.pos_embedding = nn.Embedding(max_seq_len, d_model)

        self.layers = nn.ModuleList([
            TransformerBlock(d_model, n_heads, d_ff)
            for _ in range(n_layers)
        ])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids):
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).unsqueeze(0)

        x = self.embedding(input_ids) + self.pos_embedding(positions)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.head(x)


def seed_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The seed's loss: cross-entropy of the flattened logits against the flattened labels."""
    logits = model(batch["input_ids"])
    return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), batch["labels"].view(-1))


def _batch(vocab_size: int, seq_len: int):
    def make(n: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, vocab_size, (n, seq_len)),
                "labels": torch.randint(0, vocab_size, (n, seq_len))}

    return make


def workload() -> Workload:
    """The seed's model at its size: vocabulary 50,257, d_model 2,048, 24 blocks, sequence 1,024."""
    return Workload(model=LargeTransformer, batch=_batch(VOCAB_SIZE, SEQ_LEN), loss=seed_loss,
                    tokens_per_sample=SEQ_LEN, name="seed-004-build-along")


def workload_tiny() -> Workload:
    """The same classes at toy size (:data:`TINY`)."""
    return Workload(model=lambda: LargeTransformer(**TINY), batch=_batch(TINY["vocab_size"], TINY["max_seq_len"]),
                    loss=seed_loss, tokens_per_sample=TINY["max_seq_len"], name="seed-004-tiny")
