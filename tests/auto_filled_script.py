"""The docs' ``deepspeed.initialize`` example (docs/guides/using-the-json.md, "With DeepSpeed") with an emitted JSON
whose hyperparameters are ``"auto"``: ``python tests/auto_filled_script.py DS.json OUT.json`` (one gloo rank:
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the caller). The JSON as written fails in plain DeepSpeed; filled
by ``autofit.ds.apply.fill_auto`` with the script's own values, it trains three steps. Writes what happened."""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
from compiled_script import Net, end_process_group  # this script's folder is on sys.path

from autofit.ds.apply import apply_to_model, build_context, client_optimizer, compile_engine, fill_auto


def train(ds: dict, steps: int) -> list[float]:
    """The documented calls, then ``steps`` steps of the tiny model."""
    with build_context(ds):
        model = Net()
    apply_to_model(model, ds, list(model.blocks))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      optimizer=client_optimizer(model, ds), config=ds)
    compile_engine(engine, ds)
    x, y = torch.randn(4, 8, 32), torch.randn(4, 8)
    losses = []
    for _ in range(steps):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def main(ds_path: str, out: str) -> None:
    torch.manual_seed(0)
    try:
        train(json.load(open(ds_path)), 1)
        refused = None
    except (ValueError, TypeError) as error:  # "auto" reaches the optimizer
        refused = f"{type(error).__name__}: {error}"
    # the documented call: the script's own hyperparameters where the JSON says "auto"
    ds = fill_auto(json.load(open(ds_path)), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    json.dump({"refused": refused, "losses": train(ds, 3), "params": ds["optimizer"]["params"]}, open(out, "w"))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
