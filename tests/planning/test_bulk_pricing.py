"""A plan's candidates priced in bulk: a kernel traced as SDPA's own (``flash`` as SDPA's flash backend) once with its
``sdpa`` twin, a kernel whose profiles differ itself; a large plan in forked processes, each pricing whole reserve
keys. Either way every candidate has the price it gets alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from toy_facts import FACTS

from autofit.core.config import Config
from autofit.core.software import Software
from autofit.core.space import space_from_dict
from autofit.cost_model import ActivationProfile, ModelFacts
from autofit.cost_model.allocation_sequence import reserve_memo
from autofit.machine.device import get_hardware
from autofit.planning import parallel_pricing
from autofit.planning import plan as plan_module
from autofit.planning.parallel_pricing import dealt
from autofit.planning.plan import Plan
from autofit.trace.attention import flash_attn_installed
from autofit.workload.hf import hf_workload

SPACE = {"global_batch_size": 8, "micro_batch_size": [1, 2, 4], "precision": ["bf16"], "optimizer": ["adamw"],
         "zero_stage": [0, 3], "checkpoint_ratio": [0.0, 1.0], "compile": ["off"], "overlap_comm": [False],
         "bucket_scale": [1], "offload_optimizer": ["none"], "offload_params": ["none"],
         "attention": ["sdpa", "flash"]}


def _with_kernel(facts: ModelFacts, kernel: str, change_flops: int = 0) -> ModelFacts:
    """``facts`` with each ``sdpa`` profile also under ``kernel``, its FLOPs changed by ``change_flops``."""
    copies = {ActivationProfile.key_with_attention(key, kernel): dataclasses.replace(
        profile, attention=kernel,
        points=tuple(dataclasses.replace(p, flops=p.flops + change_flops) for p in profile.points))
        for key, profile in facts.profiles.items()}
    return dataclasses.replace(facts, profiles={**facts.profiles, **copies})


def test_a_kernel_is_priced_as_sdpa_only_where_every_profile_of_it_is_sdpas() -> None:
    assert _with_kernel(FACTS, "flash").kernels_priced_as_sdpa() == {"flash"}
    assert _with_kernel(FACTS, "eager", change_flops=1).kernels_priced_as_sdpa() == frozenset()
    one_layout_less = _with_kernel(FACTS, "flash")
    dropped = next(key for key in one_layout_less.profiles if key.startswith("bf16/flash/"))
    fewer = {key: p for key, p in one_layout_less.profiles.items() if key != dropped}
    assert dataclasses.replace(FACTS, profiles=fewer).kernels_priced_as_sdpa() == frozenset()
    assert FACTS.kernels_priced_as_sdpa() == frozenset()  # sdpa alone: nothing to share


def _tiny_llama_plan(folder: Path) -> Plan:
    """A grouped-query Llama on an H100 (a GPU machine's software, flash-attn included), whose ``flash`` is traced as
    SDPA's flash backend."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, architectures=["LlamaForCausalLM"]
                ).save_pretrained(folder)
    return Plan.make(f"hf:{folder}", hf_workload(str(folder), seq_len=32), get_hardware("h100-80gb"),
                     space_from_dict(SPACE, name="bulk"), software=Software())


@pytest.mark.skipif(flash_attn_installed(), reason="flash-attn is installed: flash traces through it")
def test_a_cuda_plans_flash_candidates_cost_what_each_costs_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """Every candidate of the plan, flash or sdpa, has the prediction :meth:`Plan.predict` makes of it alone."""
    monkeypatch.setenv("AUTOFIT_NO_CACHE", "1")
    plan = _tiny_llama_plan(tmp_path / "llama")
    assert plan.facts.kernels_priced_as_sdpa() == {"flash"}
    priced = plan.price()
    assert {c.attention for c, _ in priced} == {"sdpa", "flash"}
    for config, prediction in priced:
        assert not prediction.peak_is_lower_bound
        assert prediction == plan.predict(config), config.label()


def test_the_hands_hold_each_group_whole_and_every_candidate_once() -> None:
    configs = [Config(micro_batch_size=n, zero_stage=z) for n in (1, 2, 4) for z in (0, 1, 2, 3)]
    hands = dealt(configs, lambda c: c.zero_stage, 3)
    assert sorted(i for hand in hands for i in hand) == list(range(len(configs)))
    assert all({configs[i].zero_stage for i in hand} for hand in hands)
    stages = [{configs[i].zero_stage for i in hand} for hand in hands]
    assert all(not (a & b) for i, a in enumerate(stages) for b in stages[i + 1:])  # a group in one hand only
    assert all(hand == sorted(hand) for hand in hands)
    assert dealt(configs, lambda c: 0, 4) == [list(range(len(configs)))]  # one group: one hand


def test_a_plan_priced_in_forked_processes_is_the_plan_priced_in_one(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes against one: the same predictions in the same order, and the reserves the processes replayed
    kept on the facts (what the reserve cache writes)."""
    monkeypatch.setenv("AUTOFIT_NO_CACHE", "1")
    monkeypatch.setattr(parallel_pricing, "MIN_PARALLEL_CANDIDATES", 0)
    plan = _tiny_llama_plan(tmp_path / "llama")
    monkeypatch.setenv("AUTOFIT_TRACE_WORKERS", "1")
    alone = plan.price()
    replayed_alone = dict(reserve_memo(plan.facts))
    facts = dataclasses.replace(plan.facts)  # the same facts, with no reserve replayed yet
    assert not reserve_memo(facts)
    forked_plan = dataclasses.replace(plan, facts=facts)
    monkeypatch.setenv("AUTOFIT_TRACE_WORKERS", "2")
    handed: list[bool] = []

    def spied(*args: Any) -> Any:
        predictions = parallel_pricing.priced_in_parallel(*args)
        handed.append(predictions is not None)
        return predictions

    monkeypatch.setattr(plan_module, "priced_in_parallel", spied)
    assert forked_plan.price() == alone
    assert handed == [True]  # priced by the forked processes, not in this one after all
    assert reserve_memo(facts) == replayed_alone
