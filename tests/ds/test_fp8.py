"""fp8 for real: torchao's float8 conversion of a tiny model's Linear layers, run on the CPU."""

from __future__ import annotations

import pytest

from autofit.core.config import Config
from autofit.core.software import Software
from autofit.cost_model.fp8 import fp8_cast_seconds, fp8_cast_traffic_bytes, fp8_rows
from autofit.ds.apply import apply_to_model
from autofit.ds.emit import deepspeed_config
from autofit.ds.fp8 import convertible_linear

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.float8")


class Tiny(torch.nn.Module):
    """Two fp8-able Linear layers (dimensions multiples of 16) and a head torchao cannot take (10 outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)])
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def test_fp8_json_converts_the_linear_layers_through_torchao():
    model = Tiny()
    ds = deepspeed_config(Config(precision="fp8"), device_kind="cuda", software=Software())
    apply_to_model(model, ds, list(model.blocks))
    from torchao.float8.float8_linear import Float8Linear

    assert [type(m) is Float8Linear for m in (*model.blocks, model.head)] == [True, True, False]
    assert [convertible_linear(m.in_features, m.out_features) for m in (*model.blocks, model.head)] == [True, True, False]
    # DeepSpeed's bf16 section casts the model; the converted layers train through fp8 matmuls
    model = model.to(torch.bfloat16)
    loss = model(torch.randn(16, 32, dtype=torch.bfloat16)).float().pow(2).mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in model.parameters())


def test_bf16_json_leaves_the_model_alone():
    model = Tiny()
    apply_to_model(model, deepspeed_config(Config(precision="bf16"), software=Software()), list(model.blocks))
    assert all(type(m) is torch.nn.Linear for m in (*model.blocks, model.head))


@pytest.fixture(scope="module")
def gpt_facts():
    """examples/gpt.py traced once for the module's two tests (frozen facts: shared safely)."""
    from pathlib import Path

    from autofit.trace import trace_workload
    from autofit.workload.entry import load_workload

    entry = f"{Path(__file__).resolve().parents[2] / 'examples' / 'gpt.py'}:workload"
    # eager attention: its matmuls are counted (FlopCounterMode counts none for the CPU's SDPA kernel)
    return trace_workload(load_workload(entry), precisions=("bf16", "fp8"), attentions=("eager",))


def _without_fp8(facts):
    from dataclasses import replace

    profiles = {
        key: replace(p, points=tuple(replace(point, fp8_flops=0) for point in p.points)) for key, p in facts.profiles.items()
    }
    return replace(facts, profiles=profiles, fp8_largest_linear=(0, 0), fp8_weight_elements=0, fp8_feature_elements=0)


def test_the_trace_counts_the_flops_of_the_converted_linears(gpt_facts):
    facts = gpt_facts
    point = facts.profile("bf16", "eager", False).points[-1]
    # the blocks' projections and MLPs are converted; attention's own matmuls and softmax are not
    assert 0 < point.fp8_flops < point.flops
    n_in, n_out = facts.fp8_largest_linear
    assert n_in * n_out >= 256 * 1024  # at least an MLP projection (d_model 256, 4x wider)


def test_fp8_speeds_up_only_the_converted_linears_and_adds_its_casts(gpt_facts):
    from autofit.core.hardware import PRESETS
    from autofit.cost_model import Coefficients, predict

    facts, h100, coefficients = gpt_facts, PRESETS["h100-80gb"], Coefficients()
    bf16 = predict(Config(micro_batch_size=4, precision="bf16", attention="eager"), facts, h100, 1, coefficients)
    fp8 = predict(Config(micro_batch_size=4, precision="fp8", attention="eager"), facts, h100, 1, coefficients)
    casts = fp8_cast_seconds(Config(micro_batch_size=4, precision="fp8", attention="eager"), facts, h100)
    # the matmuls run faster; the casts (unfused without compile) are what fp8 adds
    assert 0 < casts < fp8.time_breakdown["compute"]
    assert fp8.time_breakdown["compute"] - casts < bf16.time_breakdown["compute"]
    assert fp8.peak_bytes > bf16.peak_bytes  # the fp8 casts of the running layer
    # a model torchao converts nothing of runs fp8 exactly as bf16
    none = _without_fp8(facts)
    fp8_none = predict(Config(micro_batch_size=4, precision="fp8", attention="eager"), none, h100, 1, coefficients)
    assert fp8_none.time_breakdown["compute"] == pytest.approx(bf16.time_breakdown["compute"])
    assert fp8_none.peak_bytes == bf16.peak_bytes


def test_fp8_casts_are_fused_only_under_compile(gpt_facts):
    from autofit.core.hardware import PRESETS
    from autofit.cost_model import Coefficients, predict

    facts, h100 = gpt_facts, PRESETS["h100-80gb"]
    eager = Config(micro_batch_size=4, precision="fp8", attention="eager")
    compiled = eager.with_(compile="on")
    # the rows each converted Linear sees come from the traced FLOPs: a micro-batch of 4 x 128 tokens
    assert fp8_rows(eager, facts) == pytest.approx(4 * facts.tokens_per_sample)
    unfused, fused = fp8_cast_traffic_bytes(eager, facts), fp8_cast_traffic_bytes(compiled, facts)
    assert 0 < fused < unfused / 5  # torchao's roofline: 6-8 bytes an element fused, 66 unfused
    assert fp8_cast_traffic_bytes(eager.with_(precision="bf16"), facts) == 0
    slow = predict(eager, facts, h100, 1, Coefficients()).time_breakdown["compute"]
    fast = predict(compiled, facts, h100, 1, Coefficients()).time_breakdown["compute"]
    assert fast < slow
    assert slow - fast == pytest.approx(fp8_cast_seconds(eager, facts, h100) - fp8_cast_seconds(compiled, facts, h100))
