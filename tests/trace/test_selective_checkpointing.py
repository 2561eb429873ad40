"""checkpoint_granularity=attention: only each checkpointed layer's attention is recomputed, found in the model."""

from __future__ import annotations

import pytest
import torch

import autofit
from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.rules import Context, granularity_needs_checkpointing
from autofit.core.space import enumerate_candidates, space_from_dict
from autofit.cost_model import Coefficients, predict
from autofit.ds.apply import apply_checkpointing, apply_to_model
from autofit.ds.emit import deepspeed_config
from autofit.machine.device import get_hardware
from autofit.machine.software import detect_software
from autofit.trace import trace_workload
from autofit.workload.types import find_attention_modules

tiny_attention = pytest.importorskip("tiny_attention")


def _count_calls(model: torch.nn.Module) -> dict[str, list[int]]:
    """Forward calls of each layer's query projection (inside attention) and first MLP Linear (outside)."""
    calls: dict[str, list[int]] = {"attention": [0] * len(model.layers), "mlp": [0] * len(model.layers)}
    for i, layer in enumerate(model.layers):
        for part, module in (("attention", layer.self_attn.q_proj), ("mlp", layer.mlp[0])):
            module.register_forward_hook(lambda *_, part=part, i=i: calls[part].__setitem__(i, calls[part][i] + 1))
    return calls


def _step(ratio: float, granularity: str, **kwargs: object) -> tuple[dict[str, list[int]], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = tiny_attention.TinyLM()
    apply_checkpointing(model, model.layers, ratio, granularity, **kwargs)
    calls = _count_calls(model)
    loss = model(**tiny_attention.make_batch(2))
    loss.backward()
    return calls, loss.detach(), model.layers[0].self_attn.q_proj.weight.grad


def test_attention_granularity_recomputes_the_attention_and_nothing_else() -> None:
    calls_none, loss_none, grad_none = _step(0.0, "block")
    calls_attn, loss_attn, grad_attn = _step(1.0, "attention")
    calls_block, _, _ = _step(1.0, "block")
    assert calls_none == {"attention": [1, 1, 1], "mlp": [1, 1, 1]}
    assert calls_attn == {"attention": [2, 2, 2], "mlp": [1, 1, 1]}  # attention run again in backward, the MLP not
    assert calls_block == {"attention": [2, 2, 2], "mlp": [2, 2, 2]}
    torch.testing.assert_close(loss_attn, loss_none)
    torch.testing.assert_close(grad_attn, grad_none)


def test_only_the_first_round_r_l_layers_and_a_workload_hook() -> None:
    calls, _, _ = _step(1 / 3, "attention")
    assert calls == {"attention": [2, 1, 1], "mlp": [1, 1, 1]}
    # a Workload hook names the module instead: here the MLP, so the MLP is what runs twice
    calls, _, _ = _step(1.0, "attention", attention_of=lambda layer: [layer.mlp])
    assert calls == {"attention": [1, 1, 1], "mlp": [2, 2, 2]}


def test_attention_is_found_in_the_model_and_its_absence_is_an_error() -> None:
    layer = tiny_attention.Block()
    assert find_attention_modules(layer) == [layer.self_attn]
    mlp_block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert find_attention_modules(mlp_block) == []
    with pytest.raises(AutofitError, match="no attention sub-module"):
        apply_checkpointing(torch.nn.Module(), [mlp_block], 1.0, "attention")
    assert tiny_attention.workload().checkpoints_attention()
    no_attention = autofit.Workload(model=lambda: torch.nn.Sequential(torch.nn.ModuleList([mlp_block])), batch=lambda n: n)
    assert not no_attention.checkpoints_attention()


def test_traced_and_priced_between_none_and_full_checkpointing() -> None:
    """Activations: none > attention-only > whole blocks; compute: the recompute of attention-only is the smaller."""
    facts = trace_workload(tiny_attention.workload(), checkpoint_ratios=(0.0, 1.0), checkpoint_granularities=("block", "attention"))
    hardware, coefficients = get_hardware("cpu"), Coefficients.for_hardware(get_hardware("cpu"))
    base = Config(micro_batch_size=4, zero_stage=2)  # ZeRO-2: activations alone, gradients moved out
    priced = {name: predict(config, facts, hardware, 1, coefficients) for name, config in {
        "none": base, "attention": base.with_(checkpoint_ratio=1.0, checkpoint_granularity="attention"),
        "block": base.with_(checkpoint_ratio=1.0)}.items()}
    activations = {name: p.breakdown.activations for name, p in priced.items()}
    assert activations["none"] > activations["attention"] > activations["block"]
    flops = {"none": facts.at_checkpointed("fp32", "sdpa", 0, 4, "flops"),
             "attention": facts.at_checkpointed("fp32", "sdpa", 3, 4, "flops", "attention"),
             "block": facts.at_checkpointed("fp32", "sdpa", 3, 4, "flops", "block")}
    assert flops["none"] < flops["attention"] < flops["block"]


def test_rules_space_and_the_emitted_json() -> None:
    ctx = Context(hardware=get_hardware("cpu"), world_size=1, global_batch=None)
    assert "checkpoints nothing" in granularity_needs_checkpointing(ctx, "attention", 0.0)
    assert granularity_needs_checkpointing(ctx, "attention", 0.5) is None
    space = space_from_dict({"checkpoint_ratio": [0.0, 1.0], "checkpoint_granularity": ["block", "attention"]}, name="t")
    kinds = {(c.checkpoint_ratio, c.checkpoint_granularity) for c in enumerate_candidates(
        space, software=detect_software(),
            hardware=get_hardware("cpu"), world_size=1, global_batch=None, fixed={}, searches_attention=False).candidates}
    assert kinds == {(0.0, "block"), (1.0, "block"), (1.0, "attention")}
    without = enumerate_candidates(space, software=detect_software(),
                                   hardware=get_hardware("cpu"), world_size=1, global_batch=None, fixed={},
                                   searches_attention=False, checkpoints_attention=False).candidates
    assert {c.checkpoint_granularity for c in without} == {"block"}
    with pytest.raises(AutofitError, match="no attention sub-module"):
        enumerate_candidates(space, software=detect_software(), hardware=get_hardware("cpu"), world_size=1, global_batch=None,
                             fixed={"checkpoint_granularity": "attention"}, searches_attention=False, checkpoints_attention=False)

    ds = deepspeed_config(Config(checkpoint_ratio=1.0, checkpoint_granularity="attention"), 1, "cpu")
    assert ds["autofit"]["checkpoint_granularity"] == "attention"
    model = tiny_attention.TinyLM()
    assert apply_to_model(model, ds, model.layers) == 3
    calls = _count_calls(model)
    model(**tiny_attention.make_batch(1)).backward()
    assert calls == {"attention": [2, 2, 2], "mlp": [1, 1, 1]}
