"""One rule of what fits (docs/design.md, "What fits"): every command judges a prediction against the same usable budget,
``(1 - margin) x`` the device memory (autofit/cost_model/budget.py), so ``autofit estimate`` lists as fitting what
``autofit run`` may keep. Each budget is chosen from the estimate's own predicted peaks, so that a prediction falls
inside the margin band: within the device memory, past the usable budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from autofit.cli import main
from autofit.commands.estimate import estimate_target
from autofit.commands.options import quiet
from autofit.commands.run import events_to, run_target
from autofit.core.errors import AutofitError
from autofit.core.units import format_bytes
from autofit.cost_model.budget import usable_bytes
from autofit.planning.estimate import estimate
from autofit.planning.plan import Plan
from autofit.planning.target import Target, prepare
from autofit.schedule.submit import planned
from autofit.tuner import SearchEvent, SearchSettings

ROOT = Path(__file__).resolve().parents[2]
TINY = f"{ROOT}/tests/tuner/tiny.py:tiny_workload"
#: the tiny model at five micro-batches (fp32 SGD, ZeRO-0, no checkpointing): five predicted peaks a few MiB apart
REQUEST: dict[str, Any] = {"entry": TINY, "hardware": "cpu", "global_batch": 16, "space": "cpu", "optimizer": "sgd",
                           "set_values": ("zero_stage=0", "checkpoint_ratio=0.0", "attention=sdpa")}


def in_the_band(peak: int, margin: float, into: float) -> int:
    """The device memory that puts ``peak`` ``into`` of the way across its margin band, from the usable budget (0)
    to the whole device (1): ``peak = (1 - margin x (1 - into)) x memory``."""
    return int(peak / (1.0 - margin * (1.0 - into)))


@pytest.fixture(scope="module")
def plan() -> Plan:
    """The tiny model planned as every command plans it (a generous budget: the peaks do not depend on it)."""
    return prepare(Target(memory="1GiB", **REQUEST)).plan()


@pytest.mark.slow
def test_a_prediction_inside_the_margin_fits_in_no_command(plan: Plan) -> None:
    priced = plan.price()
    fastest, prediction = priced[0]
    memory = in_the_band(prediction.peak_bytes, plan.margin, into=0.5)
    tight = plan.with_memory(memory)
    assert prediction.peak_bytes <= memory  # the device would hold it; its margin would not be left free

    estimated = estimate(tight)
    fitting = [c.config for c in estimated.fitting]
    assert fitting and fastest not in fitting, [c.config.label() for c in estimated.candidates]
    assert estimated.to_dict()["budget"] == {"memory_bytes": memory, "margin": plan.margin,
                                             "usable_bytes": usable_bytes(memory, plan.margin)}
    for candidate in estimated.candidates:  # fits means within the usable budget, whichever way it falls
        assert candidate.prediction.fits == (candidate.prediction.peak_bytes <= estimated.usable_bytes)
    # the search prices its usable plan, schedule add previews the estimate's best: the same verdicts
    assert [c for c, p in tight.usable().price() if p.fits] == [c for c, p in tight.price() if p.fits]
    assert {c for c, p in tight.usable().price() if p.fits} == set(fitting)
    preview = planned(tight)
    assert preview is not None and preview["config"] == fitting[0].to_dict()
    assert (preview["margin"], preview["usable_bytes"]) == (plan.margin, estimated.usable_bytes)


@pytest.mark.slow
def test_a_larger_margin_fits_less_and_says_so(plan: Plan) -> None:
    smallest = min(p.peak_bytes for _, p in plan.price())
    memory = in_the_band(smallest, 0.3, into=0.5)  # the smallest past a 30 % margin, within a 10 % one
    assert estimate(plan.with_memory(memory)).fitting
    wide = estimate(plan.with_memory(memory).with_margin(0.3))
    assert wide.fitting == [] and wide.to_dict()["budget"]["margin"] == 0.3


@pytest.mark.parametrize("margin", ["0.95", "-0.1", "nan"])
def test_a_margin_out_of_range_is_one_error_line(margin: str) -> None:
    result = CliRunner().invoke(main, ["estimate", TINY, "--hardware", "cpu", "--margin", margin])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"autofit: error: margin must be a finite number >= 0 and <= 0.9, "
                                                  f"but got {float(margin)!r}"]


def _run(target: Target, tmp_path: Path, events: list[SearchEvent], trials: int) -> Any:
    """``autofit run`` as the CLI calls it (:func:`autofit.commands.run.run_target`), its events kept."""
    return run_target(target, trials=trials, timeout_s=None, out=tmp_path / "ds.json", report=None,
                      storage=f"sqlite:///{tmp_path / 'study.db'}", study_name=None, script=None,
                      progress=lambda total: events_to(events.append), say=quiet)


@pytest.mark.slow  # plans the tiny model twice (the CPU kernel footprint: subprocesses), loads DeepSpeed's ops
def test_where_estimate_lists_nothing_run_says_nothing_fits_without_a_probe(tmp_path: Path) -> None:
    smallest = min(c.prediction.peak_bytes for c in estimate_target(Target(memory="1GiB", **REQUEST)).candidates)
    # past even the widest memory band the search may probe into (SearchSettings.memory_band_cap), so no probe decides:
    # half-way from where that band ends, (1 - margin) x (1 + cap) of the device, to the device memory
    margin, cap = 0.1, SearchSettings().memory_band_cap
    edge = 1.0 - (1.0 - (1.0 - margin) * (1.0 + cap)) / margin
    target = Target(memory=in_the_band(smallest, margin, into=(edge + 1.0) / 2), margin=margin, **REQUEST)
    estimated = estimate_target(target)
    assert estimated.fitting == [] and smallest <= estimated.hardware.memory_bytes
    events: list[SearchEvent] = []
    with pytest.raises(AutofitError, match="^nothing fits") as info:
        _run(target, tmp_path, events, trials=2)
    assert f"within {format_bytes(estimated.usable_bytes)} usable" in str(info.value)
    assert not any(e.text.startswith("probing") for e in events) and not (tmp_path / "ds.json").exists()


@pytest.mark.slow  # real probes: DeepSpeed steps in subprocesses on the CPU (one search probe and its verification)
def test_run_probes_first_and_keeps_what_estimate_lists_first(tmp_path: Path) -> None:
    candidates = estimate_target(Target(memory="1GiB", **REQUEST)).candidates
    fastest = candidates[0].prediction.peak_bytes
    target = Target(memory=in_the_band(fastest, 0.1, into=0.5), **REQUEST)  # the fastest inside the margin band
    estimated = estimate_target(target)
    assert estimated.fitting and estimated.fitting[0].config != candidates[0].config
    events: list[SearchEvent] = []
    result = _run(target, tmp_path, events, trials=1)
    probed = [e.text.removeprefix("probing ") for e in events if e.text.startswith("probing")]
    assert probed[0] == estimated.fitting[0].config.label(), probed
    assert (result.margin, result.usable_bytes) == (estimated.margin, estimated.usable_bytes)
    assert result.config in {c.config for c in estimated.fitting}
    assert json.loads((tmp_path / "ds.json").read_text()) == result.deepspeed
