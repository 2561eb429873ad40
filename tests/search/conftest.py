"""Fixtures the search's tests share: a fresh study storage and the tiny model's plans."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tiny import ENTRY, sgd_space, tiny_workload

from autofit.hardware import get_hardware
from autofit.plan import Plan
from autofit.recipe import Recipe

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
