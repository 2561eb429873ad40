"""Tiny workloads the probe tests load by path (``tests/probe/probe_workloads.py:tiny``)."""

from __future__ import annotations

import os
import subprocess
import time

import torch
from torch import nn

import autofit

WIDTH = 128


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """A residual MLP: ``n_layers`` blocks in a ModuleList and a regression head."""

    def __init__(self, width: int = WIDTH, n_layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n_layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()


def _batch(width: int, seq: int):
    return lambda n: (torch.randn(n, seq, width), torch.randn(n, seq))


def tiny() -> autofit.Workload:
    return autofit.Workload(model=lambda: Net(), batch=_batch(WIDTH, 16), tokens_per_sample=16)


def medium() -> autofit.Workload:
    """~34 M parameters: large enough that fixed runtime overhead is a few percent of the peak."""
    return autofit.Workload(model=lambda: Net(width=1024, n_layers=4), batch=_batch(1024, 64))


def hog() -> autofit.Workload:
    """A model whose construction allocates ~2 GiB (touched), for the memory budget test."""

    def model() -> nn.Module:
        net = Net()
        net.ballast = nn.Parameter(torch.ones(512 * 2**20 // 1))  # 2 GiB of fp32
        return net

    return autofit.Workload(model=model, batch=_batch(WIDTH, 16))


def broken() -> autofit.Workload:
    raise RuntimeError("the entry point is broken on purpose")


def broken_loss() -> autofit.Workload:
    def loss(model: nn.Module, batch: object) -> torch.Tensor:
        raise ValueError("loss exploded on purpose")

    return autofit.Workload(model=lambda: Net(), batch=_batch(WIDTH, 16), loss=loss)


def sleeper() -> autofit.Workload:
    """Records its pid and a child's pid in $AUTOFIT_TEST_PIDFILE, then hangs."""
    child = subprocess.Popen(["sleep", "300"])
    with open(os.environ["AUTOFIT_TEST_PIDFILE"], "w") as handle:
        handle.write(f"{os.getpid()} {child.pid}\n")
    time.sleep(300)
    raise AssertionError("unreachable")


def nan_loss() -> autofit.Workload:
    """Trains without error, but its loss is nan: the probe must not call that a measured candidate."""

    def loss(model: nn.Module, batch: tuple) -> torch.Tensor:
        return model(*batch) * float("nan")

    return autofit.Workload(model=lambda: Net(), batch=_batch(WIDTH, 16), loss=loss)


def mixtral() -> autofit.Workload:
    """A tiny transformers Mixtral built with ``from_config``: its experts and router are ``torch.empty``
    parameters that only transformers' own weight initialisation fills."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    vocab, seq = 512, 32
    config = MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=seq, output_router_logits=True)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, seq))
        return {"input_ids": ids, "labels": ids}

    return autofit.Workload(model=lambda: AutoModelForCausalLM.from_config(config), batch=batch,
                            layers=lambda model: list(model.model.layers), tokens_per_sample=seq)


class ConvNet(nn.Module):
    """Six 3x3 convolutions at one resolution and a linear head: activations are feature maps."""

    def __init__(self, channels: int = 64, n_layers: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(n_layers))
        self.head = nn.Linear(channels, 10)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(images))
        for layer in self.layers:
            x = torch.relu(layer(x))
        return nn.functional.cross_entropy(self.head(x.mean(dim=(2, 3))), labels)


def convnet() -> autofit.Workload:
    return autofit.Workload(model=ConvNet, batch=lambda n: (torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,))))


def host_hog() -> autofit.Workload:
    """``tiny``, except that rank ``AUTOFIT_TEST_OOM_RANK`` moves itself into the memory cgroup at
    ``AUTOFIT_TEST_CGROUP`` and allocates past its limit: the kernel's OOM killer ends it."""
    if os.environ.get("RANK") == os.environ.get("AUTOFIT_TEST_OOM_RANK"):
        with open(os.path.join(os.environ["AUTOFIT_TEST_CGROUP"], "cgroup.procs"), "w") as handle:
            handle.write(str(os.getpid()))
        hold = bytearray(400 * 2**20)
        time.sleep(5 + len(hold) * 0)
    return tiny()


class Uncompilable(Net):
    """Trains eagerly; under ``torch.compile`` its forward multiplies mismatched shapes, which dynamo's fake-tensor
    trace raises (``suppress_errors`` is off by default): a model torch.compile cannot take."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            x = x @ torch.ones(3, 3)
        return super().forward(x, y)


def uncompilable() -> autofit.Workload:
    return autofit.Workload(model=lambda: Uncompilable(), batch=_batch(WIDTH, 16), tokens_per_sample=16)


def _misbehaving(act) -> autofit.Workload:
    """``tiny`` whose loss calls ``act()`` first: a rank that ends, hangs or leaks mid-step."""

    def loss(model: nn.Module, batch: tuple) -> torch.Tensor:
        act()
        return model(*batch)

    return autofit.Workload(model=lambda: Net(), batch=_batch(WIDTH, 16), loss=loss)


def killed() -> autofit.Workload:
    """Its rank SIGKILLs itself in the first step."""
    import signal

    return _misbehaving(lambda: os.kill(os.getpid(), signal.SIGKILL))


def exits() -> autofit.Workload:
    """Its rank leaves with ``os._exit(3)`` in the first step: no result, no teardown."""
    return _misbehaving(lambda: os._exit(3))


def hangs() -> autofit.Workload:
    """Its rank writes its pid to $AUTOFIT_TEST_PIDFILE, then sleeps in the first step."""

    def hang() -> None:
        with open(os.environ["AUTOFIT_TEST_PIDFILE"], "w") as handle:
            handle.write(f"{os.getpid()}\n")
        time.sleep(300)

    return _misbehaving(hang)


_LEAKED: list[torch.Tensor] = []


def leaks() -> autofit.Workload:
    """Its rank keeps 64 MiB more, touched, at every micro-batch, in a module global."""
    return _misbehaving(lambda: _LEAKED.append(torch.ones(16 * 2**20)))
