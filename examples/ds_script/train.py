"""An ordinary DeepSpeed training script: its own model and data, ``deepspeed.initialize``, ``--deepspeed_config``.

Nothing in it knows about autofit. ``autofit run --script`` runs it as it is, once per candidate:

    autofit run --script "python examples/ds_script/train.py --deepspeed_config {config}" \\
        --hardware cpu --memory 1GiB --global-batch 8 --space cpu --trials 4 --out ds_config.json

and trains with the winner the way it always did:

    deepspeed examples/ds_script/train.py --deepspeed_config ds_config.json     # or torchrun, or python
"""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch
from torch import nn

VOCAB, SEQ, WIDTH, LAYERS = 1024, 64, 128, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a tiny LM with DeepSpeed.")
    parser.add_argument("--steps", type=int, default=100, help="Optimizer steps.")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyLM()
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    micro_batch = engine.train_micro_batch_size_per_gpu()
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens = torch.randint(0, VOCAB, (micro_batch, SEQ + 1), device=engine.device)
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
        if engine.global_rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if torch.distributed.is_initialized():  # every rank done, then the group's threads end before the interpreter's
        torch.distributed.barrier()         # teardown (left to exit, gloo can abort: "terminate called without an
        torch.distributed.destroy_process_group()  # active exception")


if __name__ == "__main__":
    main()
