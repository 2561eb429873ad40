"""Tiny workloads for the search's end-to-end tests (entry points for real probes)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from autofit import Workload
from autofit.core.space import SearchSpace, space_from_dict

HERE = Path(__file__).resolve()
ENTRY = f"{HERE}:tiny_workload"
BIG_ENTRY = f"{HERE}:big_workload"


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Tiny(nn.Module):
    def __init__(self, d: int = 64, n_layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x).mean(dim=1), y)


def tiny_workload() -> Workload:
    return Workload(model=Tiny, batch=lambda n: (torch.randn(n, 128, 64), torch.randn(n, 1)), name="tiny")


def big_workload() -> Workload:
    """~67 M parameters: a GiB of AdamW states, sharding matters."""
    return Workload(
        model=lambda: Tiny(d=1024, n_layers=8), batch=lambda n: (torch.randn(n, 8, 1024), torch.randn(n, 1)), name="big"
    )


def sgd_space(micro_batches: list[int]) -> SearchSpace:
    """fp32 SGD, ZeRO 0, no checkpointing, global batch 16, at the given micro-batches."""
    return space_from_dict(
        {
            "global_batch_size": 16,
            "micro_batch_size": micro_batches,
            "checkpoint_ratio": [0.0],
            "precision": ["fp32"],
            "optimizer": ["sgd"],
            "zero_stage": [0],
            "attention": ["sdpa"],
        },
        name="tiny",
    )
