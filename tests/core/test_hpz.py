"""ZeRO++'s hierarchical partitioning (``hpz_partition_size``): the rules that keep it to multi-node ZeRO-3 at a node's
ranks, the default space that searches it there, its memory and its gathers in the prior, and the emitted JSON
DeepSpeed's own parser takes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from toy_facts import FACTS

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS
from autofit.core.rules import RULES, Context
from autofit.core.software import Software
from autofit.core.space import enumerate_candidates, load_space
from autofit.cost_model import predict
from autofit.cost_model.comm import collective_seconds, communication_phases, secondary_gather_seconds
from autofit.ds.emit import check_with_deepspeed, deepspeed_config

H100 = replace(PRESETS["h100-80gb"], devices_per_node=8)
GB = 1e9


def check(name, *, world=16, hardware=H100, **values):
    rule = next(r for r in RULES if r.name == name)
    return rule.check(Context(hardware, world, 64, Software()), *(values[k] for k in rule.keys))


def test_hpz_is_zero3s_over_the_ranks_of_a_node_on_more_than_one_node():
    assert check("hpz_needs_zero3", hpz_partition_size=8, zero_stage=3) is None
    assert "ZeRO-2 has none" in check("hpz_needs_zero3", hpz_partition_size=8, zero_stage=2)
    assert check("hpz_is_a_node", hpz_partition_size=8) is None
    assert "on one node" in check("hpz_is_a_node", world=8, hpz_partition_size=8)
    assert "not the 8 ranks of a node" in check("hpz_is_a_node", hpz_partition_size=4)
    assert "not the 8 ranks of a node" in check("hpz_is_a_node", hpz_partition_size=16)
    assert all(check(name, hpz_partition_size=1, zero_stage=0, tensor_parallel=2, sequence_parallel=2,
                     offload_params="cpu") is None
               for name in ("hpz_needs_zero3", "hpz_is_a_node", "hpz_without_model_parallel",
                            "hpz_without_param_offload"))


def test_hpz_is_refused_beside_tp_sp_and_parameter_offload_with_deepspeeds_reason():
    assert "consecutive ranks" in check("hpz_without_model_parallel", hpz_partition_size=8, tensor_parallel=2,
                                        sequence_parallel=1)
    assert "sequence parallelism" in check("hpz_without_model_parallel", hpz_partition_size=8, tensor_parallel=1,
                                           sequence_parallel=2)
    assert "_partition_param_sec" in check("hpz_without_param_offload", hpz_partition_size=8, offload_params="cpu")


def candidates(world: int, **fixed):
    return enumerate_candidates(load_space("default"), fixed=fixed, hardware=H100, world_size=world,
                                global_batch=world * 4, searches_attention=False, software=Software()).candidates


def test_the_default_space_searches_hpz_at_a_nodes_ranks_only_across_nodes():
    across = {c.hpz_partition_size for c in candidates(16, precision="bf16", optimizer="adamw", micro_batch_size=4)}
    assert across == {1, 8}
    assert all(c.zero_stage == 3 and c.offload_params == "none" for c in candidates(16, precision="bf16",
               optimizer="adamw", micro_batch_size=4, hpz_partition_size=8))
    assert {c.hpz_partition_size for c in candidates(8, precision="bf16", optimizer="adamw")} == {1}
    with pytest.raises(AutofitError, match="--set hpz_partition_size=8 cannot run: hpZ keeps"):
        candidates(8, hpz_partition_size=8)


def test_a_gather_from_the_secondary_partition_stays_on_the_nodes_links():
    two_nodes = 16
    assert secondary_gather_seconds(GB, H100, 8) == pytest.approx(7 / 8 * GB / H100.intra_node_bytes_per_s)
    assert secondary_gather_seconds(GB, H100, 8) < collective_seconds(GB, H100, two_nodes)
    assert secondary_gather_seconds(GB, H100, 1) == 0.0
    flat, hier = (communication_phases(Config(zero_stage=3, precision="bf16", grad_accum_steps=4,
                                              hpz_partition_size=h), FACTS, H100, two_nodes, 1.0, 10**6)
                  for h in (1, 8))
    assert hier.backward_gather < flat.backward_gather and hier.forward_gather < flat.forward_gather
    assert hier.reduce == flat.reduce  # the gradients are still reduce-scattered over every rank


def test_the_prior_prices_the_secondary_partition_and_the_gathers_it_saves():
    config = Config(zero_stage=3, precision="bf16", micro_batch_size=4, grad_accum_steps=2)
    flat, hier = (predict(config.with_(hpz_partition_size=h), FACTS, H100, world_size=16) for h in (1, 8))
    assert hier.breakdown.params > flat.breakdown.params
    assert hier.peak_bytes > flat.peak_bytes
    assert hier.time_breakdown["communication"] <= flat.time_breakdown["communication"]
    assert hier.time_breakdown["compute"] == flat.time_breakdown["compute"]


def test_the_json_carries_zero_hpz_partition_size_and_deepspeed_parses_it():
    pytest.importorskip("deepspeed")
    ds = deepspeed_config(Config(zero_stage=3, precision="bf16", hpz_partition_size=8, micro_batch_size=2),
                          world_size=16)
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 8
    check_with_deepspeed(ds)
    plain = deepspeed_config(Config(zero_stage=3, precision="bf16", micro_batch_size=2), world_size=16)
    assert "zero_hpz_partition_size" not in plain["zero_optimization"]
    assert Config(zero_stage=3, hpz_partition_size=8).label().endswith("hpz8")
