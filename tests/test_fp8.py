"""fp8 for real: torchao's float8 conversion of a tiny model's Linear layers, run on the CPU."""

from __future__ import annotations

import pytest

from autofit.apply import apply_to_model
from autofit.config import Config
from autofit.emit import deepspeed_config
from autofit.fp8 import convertible_linear
from autofit.software import Software

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
