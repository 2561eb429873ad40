"""Fixtures the search's tests share: a fresh study storage and the tiny model's plans."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tiny import BIG_ENTRY, ENTRY, big_workload, sgd_space, tiny_workload

from autofit.core.hardware import Hardware
from autofit.core.recipe import Recipe
from autofit.core.space import SearchSpace
from autofit.cost_model import ModelFacts
from autofit.machine.device import get_hardware
from autofit.planning.plan import Plan

MIB = 2**20


@pytest.fixture
def storage(tmp_path: Path) -> str:
    """An SQLite Optuna storage of the test's own."""
    return f"sqlite:///{tmp_path / 'study.db'}"


@pytest.fixture(scope="session")
def tiny_plan() -> Callable[[int, list[int]], Plan]:
    """``(memory MiB, micro-batches) -> Plan`` of the tiny model on the CPU, SGD, global batch 16."""
    workload = tiny_workload()
    facts = {}

    def make(memory_mib: int, micro_batches: list[int]) -> Plan:
        hardware = get_hardware("cpu", memory_mib * MIB)
        key = tuple(micro_batches)
        plan = Plan.make(ENTRY, workload, hardware, sgd_space(micro_batches), facts=facts.get(key),
                         recipe=Recipe(optimizer="sgd", precision="fp32"))
        facts[key] = plan.facts
        return plan

    return make


@pytest.fixture(scope="session")
def big_plan() -> Callable[[Hardware, SearchSpace], Plan]:
    """``(hardware, space) -> Plan`` of the ~67 M-parameter model (on a GPU preset: no kernel footprint to measure),
    traced once (~2 s) per set of the values a trace depends on (:func:`autofit.planning.plan.trace_for`: micro-batches,
    precisions, optimizers, attention, checkpointing) and reused by spaces that differ only elsewhere (ZeRO, offload)."""
    workload = big_workload()
    traced: dict[tuple, ModelFacts] = {}

    def make(hardware: Hardware, space: SearchSpace) -> Plan:
        key = tuple(space.values[k] for k in ("micro_batch_size", "precision", "optimizer", "attention", "checkpoint_ratio",
                                             "checkpoint_granularity"))
        plan = Plan.make(BIG_ENTRY, workload, hardware, space, facts=traced.get(key))
        traced[key] = plan.facts
        return plan

    return make
