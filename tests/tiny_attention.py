"""A tiny LLaMA-shaped decoder in plain torch, for selective checkpointing and Adam-mini.

Each block has a ``self_attn`` child (grouped-query attention with ``q_proj``/``k_proj``/``v_proj``/
``o_proj``, the names Adam-mini partitions by) and an ``mlp`` child. ``python tests/tiny_attention.py
OUT.json`` trains it three steps through ``deepspeed.initialize`` with the JSON autofit emits for
``optimizer=adam_mini`` (CPU, one gloo rank) and writes the losses and the optimizer's state bytes.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

import autofit

VOCAB, SEQ, D_MODEL, N_HEADS, N_KV_HEADS, N_LAYERS = 64, 16, 32, 4, 2, 3


class Attention(nn.Module):
    """``broadcast``: the key/value heads passed to SDPA as they are, for it to broadcast (one head only: multi-query
    attention as Falcon's called it up to transformers 5.24), instead of repeated to the query's."""

    def __init__(self, d_model: int = D_MODEL, n_heads: int = N_HEADS, n_kv_heads: int = N_KV_HEADS,
                 broadcast: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.repeat = 1 if broadcast else n_heads // n_kv_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (p(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        k, v = k.repeat_interleave(self.repeat, 1), v.repeat_interleave(self.repeat, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, n_kv_heads: int = N_KV_HEADS, broadcast: bool = False) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.self_attn = Attention(n_kv_heads=n_kv_heads, broadcast=broadcast)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, n_kv_heads: int = N_KV_HEADS, broadcast: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList(Block(n_kv_heads, broadcast) for _ in range(N_LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def make_batch(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(n))
    return {"input_ids": ids, "labels": ids.clone()}


def workload() -> autofit.Workload:
    return autofit.Workload(model=TinyLM, batch=make_batch, tokens_per_sample=SEQ, name="tiny-attention")


def broadcast_mqa(attention: str = "sdpa") -> TinyLM:
    """One key/value head SDPA broadcasts over the query's four, without ``enable_gqa``: SDPA's math path on CUDA too.
    Only ``sdpa`` is built: the workload takes ``attention`` so that the trace labels how SDPA runs it."""
    if attention != "sdpa":
        raise ValueError(f"this model calls SDPA only, not {attention}")
    return TinyLM(n_kv_heads=1, broadcast=True)


def broadcast_mqa_workload() -> autofit.Workload:
    return autofit.Workload(model=broadcast_mqa, batch=make_batch, tokens_per_sample=SEQ, name="tiny-broadcast-mqa")


def train_adam_mini(out: str, steps: int = 3) -> None:
    """``steps`` optimizer steps through ``deepspeed.initialize`` with autofit's JSON and client optimizer."""
    import deepspeed

    from autofit.core.config import Config
    from autofit.ds.apply import apply_to_model, client_optimizer
    from autofit.ds.emit import deepspeed_config
    from autofit.probe.rank.worker import optimizer_state_bytes

    torch.manual_seed(0)
    ds = deepspeed_config(Config(micro_batch_size=2, optimizer="adam_mini"), 1, "cpu")
    ds["autofit"]["client_optimizer"]["params"]["lr"] = 1e-2  # a visible step on one repeated batch
    model = TinyLM()
    apply_to_model(model, ds, model.layers)
    optimizer = client_optimizer(model, ds)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    batch = make_batch(2)
    losses = []
    for _ in range(steps):
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    result = {"losses": losses, "optimizer": type(optimizer).__name__, "state_bytes": optimizer_state_bytes(engine.optimizer)}
    with open(out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    from compiled_script import end_process_group  # this script's folder is on sys.path

    train_adam_mini(sys.argv[1])
    end_process_group()
