"""The allocator reserves a GPU plan priced, kept on disk beside the trace: a model planned again (a new process, its
facts read back from the cache) prices the same and replays nothing; an entry of another layout is a miss."""

from __future__ import annotations

import json

import pytest

from autofit.core.hardware import PRESETS
from autofit.core.space import space_from_dict
from autofit.cost_model import ModelFacts
from autofit.cost_model.allocation_sequence import reserve_memo
from autofit.planning.plan import Plan
from autofit.planning.reserve_cache import entry_name, kept_reserves
from autofit.workload.types import Workload
from tests.cost_model.test_allocation_sequence import DECODER

H100 = PRESETS["h100-80gb"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOFIT_NO_CACHE", raising=False)
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    return tmp_path / "traces"


def _plan(facts: ModelFacts) -> Plan:
    space = space_from_dict({"micro_batch_size": [1, 4], "zero_stage": [0, 2, 3], "checkpoint_ratio": [0.0, 1.0],
                             "precision": ["bf16"], "attention": ["sdpa"]}, name="reserves")
    workload = Workload(name="decoder", model=lambda **_: None, batch=lambda n: None)
    return Plan.make("decoder", workload, H100, space, world_size=8, global_batch=64, facts=facts)


def _read_back(facts: ModelFacts) -> ModelFacts:
    """The facts as a new process reads them from the trace cache: equal, with no memo of its own."""
    return ModelFacts.from_dict(json.loads(json.dumps(facts.to_dict())))


def test_a_plan_priced_again_reads_its_reserves_back(cache) -> None:
    first = _plan(_read_back(DECODER))
    priced = first.price()
    replays = dict(reserve_memo(first.facts))
    assert replays and (cache / f"{entry_name(first.facts)}.json").exists()

    again = _plan(_read_back(DECODER))
    with kept_reserves(again.facts):
        assert reserve_memo(again.facts) == replays  # every reserve read back before a candidate is priced
    assert [(c, p.peak_bytes) for c, p in again.price()] == [(c, p.peak_bytes) for c, p in priced]


def test_an_entry_of_another_layout_is_a_miss(cache) -> None:
    facts = _read_back(DECODER)
    reference = [p.peak_bytes for _, p in _plan(_read_back(DECODER)).price()]
    path = cache / f"{entry_name(facts)}.json"
    document = json.loads(path.read_text())
    document["reserves"] = [row[:-1] + [-1] for row in document["reserves"]] + [["not", "a", "row"]]
    path.write_text(json.dumps(document))
    plan = _plan(facts)
    with kept_reserves(plan.facts):
        assert reserve_memo(plan.facts) == {}
    assert [p.peak_bytes for _, p in plan.price()] == reference


def test_other_facts_are_another_entry_and_the_cache_off_keeps_none(cache, monkeypatch) -> None:
    other = ModelFacts.from_dict({**DECODER.to_dict(), "seq_len": 2 * DECODER.seq_len})
    assert entry_name(other) != entry_name(DECODER)
    assert entry_name(_read_back(DECODER)) == entry_name(DECODER)
    monkeypatch.setenv("AUTOFIT_NO_CACHE", "1")
    _plan(_read_back(DECODER)).price()
    assert not cache.exists() or not list(cache.glob("reserves-*.json"))
