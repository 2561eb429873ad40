"""apply_checkpointing and the client optimizer, in process (no DeepSpeed)."""

from __future__ import annotations

import math

import pytest
import torch
from compiled_script import Net  # the tiny residual MLP the compiled-engine script trains
from hostile_helpers import python

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.ds.apply import (
    apply_checkpointing,
    apply_to_model,
    client_optimizer,
    compile_engine,
    compiles,
    fill_hint,
    is_checkpointed,
    n_checkpointed,
)
from autofit.ds.emit import deepspeed_config


@pytest.mark.parametrize(
    ("n_layers", "ratio", "expected"),
    [(4, 0.0, 0), (4, 0.25, 1), (4, 0.5, 2), (4, 1.0, 4), (6, 0.5, 3), (5, 0.5, 2), (3, 0.5, 2), (32, 0.3, 10)],
)
def test_n_checkpointed_is_round_r_times_l(n_layers: int, ratio: float, expected: int) -> None:
    assert n_checkpointed(n_layers, ratio) == expected == round(ratio * n_layers)


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.75, 1.0])
def test_wraps_exactly_the_first_layers_and_keeps_outputs(ratio: float) -> None:
    torch.manual_seed(0)
    reference = Net(width=16, n_layers=4)
    model = Net(width=16, n_layers=4)
    model.load_state_dict(reference.state_dict())
    n = apply_checkpointing(model, list(model.blocks), ratio)
    assert n == round(ratio * 4)
    assert [is_checkpointed(b) for b in model.blocks] == [i < n for i in range(4)]
    assert list(model.state_dict()) == list(reference.state_dict())

    x, y = torch.randn(3, 5, 16), torch.randn(3, 5)
    loss_ref, loss = reference(x, y), model(x, y)
    loss_ref.backward()
    loss.backward()
    torch.testing.assert_close(loss, loss_ref)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_checkpointed_layers_recompute_in_backward() -> None:
    model = Net(width=16, n_layers=2)
    calls = []
    model.blocks[0].up.register_forward_hook(lambda *_: calls.append(1))
    apply_checkpointing(model, list(model.blocks), 0.5)
    model(torch.randn(2, 3, 16), torch.randn(2, 3)).backward()
    assert len(calls) == 2  # forward, then the recompute in backward


def test_wrapping_twice_is_a_no_op() -> None:
    model = Net(width=16, n_layers=2)
    apply_checkpointing(model, list(model.blocks), 1.0)
    forward = model.blocks[0].forward
    apply_checkpointing(model, list(model.blocks), 1.0)
    assert model.blocks[0].forward is forward


def test_bad_ratio_and_missing_layers() -> None:
    with pytest.raises(AutofitError, match="checkpoint_ratio"):
        apply_checkpointing(Net(), [], 1.5)
    with pytest.raises(AutofitError, match="no repeated layers"):
        apply_checkpointing(Net(), [], 0.5)
    assert apply_checkpointing(Net(), [], 0.0) == 0


def test_apply_to_model_reads_the_autofit_section() -> None:
    model = Net(width=16, n_layers=4)
    ds = deepspeed_config(Config(checkpoint_ratio=0.5))
    assert apply_to_model(model, ds, list(model.blocks)) == 2


def test_the_public_name_autofit_apply_imports_in_a_fresh_interpreter() -> None:
    """``from autofit.apply import apply_to_model`` (the guides' and older scripts' import) is autofit.ds.apply itself,
    as the first import of a fresh process, and stays light (no torch until the model needs it)."""
    code = """
import sys
from autofit.apply import apply_to_model
import autofit.apply, autofit.ds.apply
assert autofit.apply is autofit.ds.apply and apply_to_model is autofit.ds.apply.apply_to_model
assert "torch" not in sys.modules, "autofit.apply imported torch"
from torch import nn
from autofit.core.config import Config
from autofit.ds.emit import deepspeed_config
blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
print(apply_to_model(nn.Sequential(*blocks), deepspeed_config(Config(checkpoint_ratio=0.5)), list(blocks)))
"""
    res = python(code)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "2"


def test_client_optimizer_only_when_the_json_names_none() -> None:
    model = Net(width=16, n_layers=1)
    assert client_optimizer(model.parameters(), deepspeed_config(Config(optimizer="adamw"))) is None
    bnb = pytest.importorskip("bitsandbytes")
    optimizer = client_optimizer(model.parameters(), deepspeed_config(Config(optimizer="adamw8bit")))
    assert isinstance(optimizer, bnb.optim.AdamW8bit)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_json_that_says_compile_trains_a_tiny_model_compiled_on_the_cpu(tmp_path) -> None:
    """The emitted JSON's ``"compile": "on"`` through autofit.ds.apply: compile_engine calls DeepSpeed's engine.compile()
    (inductor, gcc on the CPU) and the tiny model trains three steps (a subprocess, one gloo rank), the first
    of which compiles."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    out = tmp_path / "result.json"
    env = os.environ | {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "PYTHONPATH": os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(tests / "compiled_script.py"), str(out)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["compiled"] and result["is_compiled"]
    assert len(result["losses"]) == 3 and all(map(math.isfinite, result["losses"]))
    assert result["losses"][-1] < result["losses"][0]
    assert result["seconds"][0] > max(result["seconds"][1:])  # the first step compiled


@pytest.mark.slow
def test_an_auto_json_filled_as_documented_trains_under_plain_deepspeed_initialize(tmp_path) -> None:
    """The emitted JSON of a recipe given no hyperparameters holds "auto", which plain deepspeed.initialize hands to
    the optimizer; filled with autofit.ds.apply.fill_auto (the docs' call) a real deepspeed.initialize takes it and the
    tiny model trains (a subprocess, one gloo rank, the CPU)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from autofit.core.recipe import recipe_for

    ds = deepspeed_config(Config(micro_batch_size=4, precision="fp32"), 1, "cpu", recipe=recipe_for({}, "cpu", False))
    assert ds["optimizer"]["params"] == {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    assert "fill_auto(json.load(open('ds.json')), lr=..., " in fill_hint("ds.json", ds)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    tests = Path(__file__).resolve().parents[1]
    out = tmp_path / "result.json"
    env = os.environ | {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "PYTHONPATH": os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(tests / "auto_filled_script.py"), str(tmp_path / "ds.json"), str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["refused"] is not None  # the JSON as written: "auto" reached the optimizer
    assert result["params"] == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert len(result["losses"]) == 3 and all(map(math.isfinite, result["losses"]))
    assert result["losses"][-1] < result["losses"][0]


def test_fill_hint_is_none_where_every_hyperparameter_was_given() -> None:
    from autofit.core.recipe import parse_hyperparameters, recipe_for

    given = parse_hyperparameters(("lr=1e-3", "weight_decay=0.0", "betas=0.9,0.99", "eps=1e-8"))
    ds = deepspeed_config(Config(), recipe=recipe_for({}, "cuda", True, hyperparameters=given))
    assert fill_hint("ds.json", ds) is None


def test_compile_engine_does_nothing_where_the_json_says_off() -> None:
    ds = deepspeed_config(Config())
    assert ds["autofit"]["compile"] == "off"
    assert compile_engine(None, ds) is False  # the engine is not touched


def test_one_compile_check_for_the_engine_the_probe_and_the_launchers() -> None:
    from autofit.ds import launchers
    from autofit.probe.rank import steps

    on = deepspeed_config(Config(compile="on"))
    assert compiles(on) and not compiles(deepspeed_config(Config()))
    assert not compiles({}) and not compiles({"autofit": None})  # no section, or a null one: eager
    assert launchers.compiles is compiles and steps.compiles is compiles
