"""ZeRO++'s quantized communication (``quantized_weights``: qwZ, ``quantized_gradients``: qgZ): searched only where the
recipe allows it, kept to what DeepSpeed runs (ZeRO-3, CUDA, qgZ across nodes without TP or SP), priced as the bytes
its collectives move and the kernels that quantize them, and written as the JSON keys DeepSpeed's own parser takes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from toy_facts import FACTS

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS
from autofit.core.recipe import Recipe, differences, narrow_space
from autofit.core.rules import RULES, Context
from autofit.core.software import Software
from autofit.core.space import enumerate_candidates, load_space
from autofit.cost_model import predict
from autofit.cost_model.comm import communication_phases
from autofit.ds.emit import check_with_deepspeed, deepspeed_config

H100 = replace(PRESETS["h100-80gb"], devices_per_node=8)
CPU = replace(H100, name="cpu", kind="cpu")
BF16 = Recipe(optimizer="adamw", precision="bf16")


def check(name, *, world=16, hardware=H100, **values):
    rule = next(r for r in RULES if r.name == name)
    return rule.check(Context(hardware, world, 64, Software()), *(values[k] for k in rule.keys))


def test_the_rules_keep_it_to_what_deepspeed_runs_with_its_reason():
    assert check("qwz_needs_zero3", quantized_weights=True, zero_stage=3) is None
    assert "ZeRO-2 has none" in check("qgz_needs_zero3", quantized_gradients=True, zero_stage=2)
    assert "ZeRO-1 has none" in check("qwz_needs_zero3", quantized_weights=True, zero_stage=1)
    assert "cpu_accelerator.py" in check("qwz_runs_here", hardware=CPU, quantized_weights=True)
    assert "cpu_accelerator.py" in check("qgz_runs_here", hardware=CPU, quantized_gradients=True)
    assert check("qwz_runs_here", quantized_weights=True) is None
    assert check("qgz_runs_here", quantized_gradients=True) is None
    assert "gathers nothing" in check("qwz_runs_here", world=1, quantized_weights=True)
    assert "on one node" in check("qgz_runs_here", world=8, quantized_gradients=True)
    assert "_get_local_all_to_all_group" in check("qgz_without_model_parallel", quantized_gradients=True,
                                                  tensor_parallel=2, sequence_parallel=1)
    assert "_get_local_all_to_all_group" in check("qgz_without_model_parallel", quantized_gradients=True,
                                                  tensor_parallel=1, sequence_parallel=2)
    off = {"quantized_weights": False, "quantized_gradients": False, "zero_stage": 0, "tensor_parallel": 2,
           "sequence_parallel": 2}
    assert all(check(rule.name, world=1, hardware=CPU, **off) is None for rule in RULES
               if set(rule.keys) <= set(off) and rule.name.startswith(("qwz", "qgz")))


def candidates(recipe: Recipe, world: int = 16, **fixed):
    space = narrow_space(load_space("default"), recipe)
    return enumerate_candidates(space, fixed={"micro_batch_size": 4, **fixed}, hardware=H100, world_size=world,
                                global_batch=world * 4, searches_attention=False, software=Software()).candidates


def test_only_the_allowed_quantization_is_searched_and_only_where_it_runs():
    assert not any(c.quantized_weights or c.quantized_gradients for c in candidates(BF16))
    allowed = candidates(replace(BF16, allow=("qwz", "qgz")))
    pairs = {(c.quantized_weights, c.quantized_gradients) for c in allowed}
    assert pairs == {(False, False), (True, False), (False, True), (True, True)}
    assert all(c.zero_stage == 3 and c.tensor_parallel == 1 and c.sequence_parallel == 1 for c in allowed
               if c.quantized_gradients)
    assert all(c.zero_stage == 3 for c in allowed if c.quantized_weights)
    one_node = candidates(replace(BF16, allow=("qwz", "qgz")), world=8)
    assert {(c.quantized_weights, c.quantized_gradients) for c in one_node} == {(False, False), (True, False)}
    only_qwz = candidates(replace(BF16, allow=("qwz",)))
    assert not any(c.quantized_gradients for c in only_qwz) and any(c.quantized_weights for c in only_qwz)


def test_a_quantized_config_says_how_it_differs_from_the_recipe():
    recipe = replace(BF16, allow=("qwz",))
    config = Config(zero_stage=3, precision="bf16", quantized_weights=True, quantized_gradients=True)
    found = {d.key: d for d in differences(recipe, config)}
    assert found["quantized_weights"].value == "qwz" and found["quantized_weights"].allowed
    assert found["quantized_gradients"].value == "qgz" and not found["quantized_gradients"].allowed
    assert "int4" in found["quantized_gradients"].meaning
    assert differences(recipe, config.with_(quantized_weights=False, quantized_gradients=False)) == ()
    with pytest.raises(AutofitError, match="allow: 'qwx' is not a substitute"):
        Recipe(optimizer="sgd", precision="fp32", allow=("qwx",))
    assert Recipe(optimizer="sgd", precision="fp32", allow=("qwz",)).values("quantized_weights") == (False, True)


def test_quantized_collectives_move_fewer_bytes_where_they_run():
    two_nodes = 16
    plain = Config(zero_stage=3, precision="bf16", grad_accum_steps=2)
    base, qwz, qgz = (communication_phases(c, FACTS, H100, two_nodes, 1.0, 10**6) for c in (
        plain, plain.with_(quantized_weights=True), plain.with_(quantized_gradients=True)))
    assert qwz.forward_gather < base.forward_gather and qwz.backward_gather < base.backward_gather
    assert qwz.reduce == base.reduce
    assert qgz.reduce < base.reduce and qgz.forward_gather == base.forward_gather
    fp32 = Config(zero_stage=3, precision="fp32", quantized_weights=True)
    assert (communication_phases(fp32, FACTS, H100, two_nodes, 1.0, 10**6).forward_gather
            / communication_phases(fp32.with_(quantized_weights=False), FACTS, H100, two_nodes, 1.0, 10**6).forward_gather
            < qwz.forward_gather / base.forward_gather)  # an fp32 gather saves more than a bf16 one


def test_the_prior_prices_the_int8_buffers_and_the_quantizing_kernels():
    config = Config(zero_stage=3, precision="bf16", micro_batch_size=4, grad_accum_steps=2)
    plain, qwz = (predict(config.with_(quantized_weights=q), FACTS, H100, world_size=16) for q in (False, True))
    assert qwz.breakdown.params > plain.breakdown.params
    assert qwz.time_breakdown["compute"] > plain.time_breakdown["compute"]
    assert qwz.time_breakdown["communication"] <= plain.time_breakdown["communication"]
    across, flat = (predict(config.with_(quantized_gradients=q), FACTS, H100, world_size=16) for q in (True, False))
    assert across.time_breakdown["compute"] > flat.time_breakdown["compute"]
    one_node = predict(config.with_(quantized_gradients=True), FACTS, H100, world_size=8)  # DeepSpeed reduces as without
    assert one_node.time_breakdown == predict(config, FACTS, H100, world_size=8).time_breakdown


def test_the_json_carries_deepspeeds_keys_and_deepspeed_parses_them():
    pytest.importorskip("deepspeed")
    config = Config(zero_stage=3, precision="bf16", micro_batch_size=2, quantized_weights=True,
                    quantized_gradients=True)
    ds = deepspeed_config(config, world_size=16)
    assert ds["zero_optimization"]["zero_quantized_weights"] is True
    assert ds["zero_optimization"]["zero_quantized_gradients"] is True
    check_with_deepspeed(ds)
    plain = deepspeed_config(config.with_(quantized_weights=False, quantized_gradients=False), world_size=16)
    assert not {"zero_quantized_weights", "zero_quantized_gradients"} & set(plain["zero_optimization"])
    assert config.label().endswith("qwz qgz")
