"""A deep residual MLP regressor: a workload without tokens, a custom loss and explicit layers.

``autofit run examples/mlp.py:workload --hardware cpu --memory 1GiB``

A sample is a set of ``N_POINTS`` feature vectors (a point-cloud-like input, so
activations grow measurably with the micro-batch); every point goes through the
same residual MLP and the set is mean-pooled into one ``D_OUT`` prediction. The
batch is an ``(x, y)`` tuple and the workload's ``loss`` compares the prediction
with ``y`` (the model knows nothing of the target). No tokens: ``tokens_per_sample``
is None and throughput is in samples/s. The blocks live in an ``nn.Sequential``,
so ``layers`` is given explicitly (the default, the longest ``nn.ModuleList``,
would find none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit import Workload

N_POINTS = 128
D_IN = 128
D_HIDDEN = 256
D_OUT = 16
N_BLOCKS = 8


class ResidualBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, d_in: int = D_IN, d_hidden: int = D_HIDDEN, d_out: int = D_OUT, n_blocks: int = N_BLOCKS):
        super().__init__()
        self.stem = nn.Linear(d_in, d_hidden)
        self.body = nn.Sequential(*(ResidualBlock(d_hidden) for _ in range(n_blocks)))
        self.head = nn.Sequential(nn.LayerNorm(d_hidden), nn.Linear(d_hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (n, N_POINTS, D_IN) -> (n, D_OUT)
        return self.head(self.body(self.stem(x)).mean(dim=1))


def build_model() -> ResidualMLP:
    return ResidualMLP()


def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, N_POINTS, D_IN), torch.randn(n, D_OUT)


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def workload() -> Workload:
    return Workload(
        model=build_model,
        batch=make_batch,
        loss=mse_loss,
        layers=lambda model: list(model.body),
        tokens_per_sample=None,
        name="residual-mlp",
    )
