"""A training script as the README tells a user to write one, with ``"compile": "on"`` in the JSON: three steps of
a tiny model under DeepSpeed's ``engine.compile()`` on the CPU. ``python tests/compiled_script.py OUT.json``
(one gloo rank: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the caller) writes the losses and whether the
engine compiled."""

from __future__ import annotations

import json
import sys
import time

import deepspeed
import torch

from autofit.core.config import Config
from autofit.ds.apply import apply_to_model, build_context, client_optimizer, compile_engine
from autofit.ds.emit import deepspeed_config


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, width: int = 32, n_layers: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(n_layers))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()


def main(out: str) -> None:
    ds = deepspeed_config(Config(micro_batch_size=4, checkpoint_ratio=0.5, compile="on"), device_kind="cpu")
    torch.manual_seed(0)
    with build_context(ds):
        model = Net()
    apply_to_model(model, ds, list(model.blocks))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      optimizer=client_optimizer(model, ds), config=ds)
    compiled = compile_engine(engine, ds)
    x, y = torch.randn(4, 8, 32), torch.randn(4, 8)
    losses, seconds = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss))
    json.dump({"compiled": compiled, "is_compiled": bool(engine.is_compiled), "losses": losses, "seconds": seconds},
              open(out, "w"))
    end_process_group()


def end_process_group() -> None:
    """The documented end of a script (examples/long_context/train.py): the process group's threads end before the
    interpreter's teardown; left to exit, gloo can abort there ("terminate called without an active exception",
    SIGABRT, after the results are written)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
