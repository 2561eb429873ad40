"""Held-out benchmark: a small ResNet-style CNN in plain torch (no torchvision).

Convolutions and BatchNorm, no attention and no tokens: activations are
feature maps whose size halves per stage, not ``seq x hidden``. The residual
blocks sit in ``nn.Sequential`` stages, so ``layers`` is explicit (the default,
the longest ``nn.ModuleList``, would find none): all blocks, in execution order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit import Workload

IMAGE_SIZE = 64
N_CLASSES = 100
STAGES = ((32, 2), (64, 2), (128, 2), (256, 2))
"""(channels, blocks) per stage; each stage after the first halves the resolution."""


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, stages: tuple[tuple[int, int], ...] = STAGES, n_classes: int = N_CLASSES) -> None:
        super().__init__()
        c0 = stages[0][0]
        self.stem = nn.Sequential(nn.Conv2d(3, c0, 3, padding=1, bias=False), nn.BatchNorm2d(c0), nn.ReLU())
        self.stages = nn.Sequential()
        c_in = c0
        for i, (c_out, n_blocks) in enumerate(stages):
            first = BasicBlock(c_in, c_out, stride=2 if i > 0 else 1)
            self.stages.append(nn.Sequential(first, *(BasicBlock(c_out, c_out, 1) for _ in range(n_blocks - 1))))
            c_in = c_out
        self.head = nn.Linear(c_in, n_classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.stages(self.stem(pixel_values))
        logits = self.head(x.mean(dim=(2, 3)))
        return logits if labels is None else F.cross_entropy(logits, labels)


def build_model() -> ResNet:
    return ResNet()


def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE), torch.randint(0, N_CLASSES, (n,))


def residual_blocks(model: ResNet) -> list[nn.Module]:
    return [block for stage in model.stages for block in stage]


def workload() -> Workload:
    return Workload(model=build_model, batch=make_batch, layers=residual_blocks, name="resnet-small")
