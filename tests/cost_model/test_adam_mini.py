"""Adam-mini (the ``adam-mini`` package) as a client optimizer: trained for real, priced from its own partition."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.rules import Context, adam_mini_installed, adam_mini_needs_zero0
from autofit.core.software import Software
from autofit.core.space import enumerate_candidates, space_from_dict
from autofit.cost_model import predict
from autofit.cost_model.states import model_states
from autofit.ds.emit import deepspeed_config
from autofit.ds.optim import adam_mini_dims, make_adam_mini
from autofit.machine.device import get_hardware
from autofit.trace import trace_workload

pytest.importorskip("adam_mini")

TESTS = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_adam_mini_trains_three_steps_and_its_states_are_priced(tmp_path: Path) -> None:
    """Three steps through ``deepspeed.initialize`` (a subprocess, one gloo rank): the loss falls, and the
    bytes of its state tensors are what the cost model predicts from the fake-tensor count."""
    import tiny_attention

    out = tmp_path / "result.json"
    env = os.environ | {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(TESTS / "tiny_attention.py"), str(out)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["optimizer"] == "Adam_mini"
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0]

    facts = trace_workload(tiny_attention.workload(), optimizers=("adam_mini",))
    config = Config(micro_batch_size=2, optimizer="adam_mini")
    predicted = model_states(config, facts, 1, "cpu").optimizer
    assert predicted == result["state_bytes"]
    # one second moment per head / neuron / block: about half of AdamW's two full moments
    adamw = model_states(config.with_(optimizer="adamw"), facts, 1, "cpu").optimizer
    assert 0.5 * adamw < predicted < 0.6 * adamw


def test_head_layout_is_read_from_the_model() -> None:
    import tiny_attention

    assert adam_mini_dims(tiny_attention.TinyLM()) == {"dim": 32, "n_heads": 4, "n_kv_heads": 2}

    class Config:  # a Hugging Face config's names
        hidden_size, num_attention_heads, num_key_value_heads = 64, 8, 2

    hf = torch.nn.Linear(2, 2)
    hf.config = Config()
    assert adam_mini_dims(hf) == {"dim": 64, "n_heads": 8, "n_kv_heads": 2}


def test_queries_without_a_head_layout_are_refused() -> None:
    class Bare(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 8)

    with pytest.raises(AutofitError, match="per attention head"):
        make_adam_mini(Bare())


def test_emitted_as_a_client_optimizer_built_from_the_model() -> None:
    ds = deepspeed_config(Config(optimizer="adam_mini"), 1, "cpu")
    assert "optimizer" not in ds
    assert ds["autofit"]["client_optimizer"]["class"] == "autofit.ds.optim.make_adam_mini"
    assert ds["autofit"]["client_optimizer"]["takes"] == "model"


def test_rules_prune_zero_stages_and_a_missing_package() -> None:
    ctx = Context(hardware=get_hardware("cpu"), world_size=1, global_batch=None)
    assert adam_mini_needs_zero0(ctx, "adam_mini", 0) is None
    for stage in (1, 2, 3):
        assert "flat 1-D partitions" in adam_mini_needs_zero0(ctx, "adam_mini", stage)
    assert adam_mini_needs_zero0(ctx, "adamw", 3) is None
    missing = Context(hardware=get_hardware("cpu"), world_size=1, global_batch=None, software=Software(adam_mini=False))
    assert "adam-mini package" in adam_mini_installed(missing, "adam_mini")

    space = space_from_dict({"optimizer": ["adamw", "adam_mini"], "zero_stage": [0, 1, 2, 3]}, name="t")
    found = enumerate_candidates(space, hardware=get_hardware("cpu"), world_size=1, global_batch=None, fixed={},
                                 searches_attention=False, software=Software()).candidates
    assert {(c.optimizer, c.zero_stage) for c in found if c.optimizer == "adam_mini"} == {("adam_mini", 0)}


def test_a_model_adam_mini_cannot_step_on_is_priced_as_not_fitting_with_why() -> None:
    """adam-mini 1.1.1 views a 1-D tensor named like an output layer (``final_layer...``) as a matrix and raises:
    the trace records its own error and the candidate does not fit, the search goes on."""
    import tiny_attention

    class Refused(tiny_attention.TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.final_layer_norm = torch.nn.LayerNorm(tiny_attention.D_MODEL)

    workload = tiny_attention.workload()
    refused = type(workload)(model=Refused, batch=workload.batch, name="refused")
    facts = trace_workload(refused, optimizers=("adam_mini",))
    assert "IndexError" in facts.adam_mini_error
    prediction = predict(Config(optimizer="adam_mini"), facts, get_hardware("cpu"), 1)
    assert not prediction.fits and "adam-mini cannot step on this model" in prediction.reason


_STEP_SCRATCH = """
import gc, json, torch
from adam_mini import Adam_mini
from autofit.probe.rank.memory import hwm_bytes, reset_peak, rss_bytes
embedding = torch.nn.Embedding({rows}, {dim})
opt = Adam_mini(named_parameters=[("embed_tokens.weight", embedding.weight)], lr=1e-3, dim={dim}, n_heads=8)
peaks = []
for _ in range(3):
    embedding.weight.grad = torch.randn_like(embedding.weight)
    gc.collect()
    before = rss_bytes()
    reset_peak()
    opt.step()
    peaks.append(hwm_bytes() - before)
print(json.dumps(peaks))
"""


@pytest.mark.slow
def test_an_adam_mini_step_holds_the_scratch_the_cost_model_prices() -> None:
    """A real Adam-mini step on an embedding (one second-moment value per row), in a fresh process with the
    probe's allocator setting (RSS tracks live tensors; without it glibc may serve the update from a block the
    last step freed): from the second step on (the states exist) it holds what ``optimizer_scratch_bytes``
    prices beyond its states, the update and its negation."""
    from autofit.cost_model.states import optimizer_scratch_bytes
    from autofit.probe.launch import free_port, rank_env

    rows, dim = 8192, 512
    code = _STEP_SCRATCH.format(rows=rows, dim=dim)
    env = rank_env(dict(os.environ), 0, 1, free_port(), "cpu")  # a probe's environment, its allocator setting included
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    steady = json.loads(run.stdout.strip().splitlines()[-1])[1:]
    priced = optimizer_scratch_bytes("adam_mini", "cpu", rows * dim, flat=False)
    assert all(abs(peak - priced) <= 0.05 * priced for peak in steady), (steady, priced)
