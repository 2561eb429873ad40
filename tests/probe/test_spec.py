"""The probe's spec: one typed record from the parent to its ranks, built once from the plan."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.software import Software
from autofit.machine.device import get_hardware
from autofit.probe.records import ProbeSpec
from autofit.probe.spec import probe_spec
from tests.toy_facts import FACTS

CPU = get_hardware("cpu")
H100 = get_hardware("h100-80gb")


def test_a_spec_round_trips_through_its_json() -> None:
    spec = probe_spec("m.py:w", Config(micro_batch_size=2, zero_stage=3), H100, 2, steps=2, warmup_steps=0,
                      software=Software(), facts=FACTS, memory_snapshot="snap.pickle").launched("/tmp/x")
    back = ProbeSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert back == spec
    assert back.hardware.compute_capability == H100.compute_capability  # a list in JSON, a tuple again
    assert back.memory_snapshot is not None and back.memory_snapshot.endswith("/snap.pickle")
    assert back.result_dir == "/tmp/x" and back.spawn_time > 0


def test_a_spec_with_a_renamed_or_mistyped_key_is_refused_naming_it() -> None:
    data = probe_spec("m.py:w", Config(), CPU).to_json()
    renamed = dict(data, warmup=data.pop("warmup_steps"))
    with pytest.raises(AutofitError, match="unknown key 'warmup'"):
        ProbeSpec.from_json(renamed)
    with pytest.raises(AutofitError, match="steps must be int"):
        ProbeSpec.from_json(probe_spec("m.py:w", Config(), CPU).to_json() | {"steps": "3"})


@pytest.mark.parametrize(("changes", "match"), [
    ({"mode": "dry"}, "probe mode must be real or fake"),
    ({"world_size": 0}, "world_size must be >= 1"),
    ({"steps": 0}, "steps >= 1"),
    ({"warmup_steps": -1}, "warmup_steps >= 0"),
])
def test_a_spec_a_probe_cannot_run_is_refused_naming_the_field(changes: dict, match: str) -> None:
    with pytest.raises(AutofitError, match=match):
        probe_spec("m.py:w", Config(), CPU, **changes)


def test_the_budget_is_a_cpu_devices_memory_in_real_mode_only() -> None:
    assert probe_spec("m.py:w", Config(), CPU).budget_bytes() == CPU.memory_bytes
    assert probe_spec("m.py:w", Config(), CPU, mode="fake").budget_bytes() is None
    assert probe_spec("m.py:w", Config(), H100).budget_bytes() is None


def test_the_facts_size_the_specs_deepspeed_json_as_the_plan_prices_it() -> None:
    """The hidden size is read from the facts once: the ZeRO buckets follow it; without facts, autofit's defaults."""
    config = Config(zero_stage=2)
    wide = probe_spec("m.py:w", config, CPU, facts=replace(FACTS, hidden_size=512)).deepspeed["zero_optimization"]
    unknown = probe_spec("m.py:w", config, CPU).deepspeed["zero_optimization"]
    assert wide["reduce_bucket_size"] == 512 * 512
    assert unknown["reduce_bucket_size"] != wide["reduce_bucket_size"]


def test_a_plans_spec_is_the_spec_of_its_parts() -> None:
    from autofit.planning.plan import Plan

    plan = Plan(entry="m.py:w", name="w", hardware=CPU, space=None, world_size=1, global_batch=None,  # type: ignore[arg-type]
                fixed={}, candidates=(Config(),), rejected=(), facts=FACTS, coefficients=None,  # type: ignore[arg-type]
                software=Software())
    assert plan.probe_spec(Config(), steps=2) == probe_spec("m.py:w", Config(), CPU, steps=2, software=Software(),
                                                                  facts=FACTS)
