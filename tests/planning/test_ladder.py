"""``autofit ladder``: the build-along table of memory techniques, priced through the plan and probed with --measure."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from autofit.cli import main
from autofit.core.boundary import STATUSES
from autofit.core.config import Config
from autofit.cost_model.budget import memory_for
from autofit.machine.device import get_hardware
from autofit.planning.ladder import (
    BASELINE,
    ladder_plan,
    measure_ladder,
    parallel_rungs,
    price_ladder,
    rung_configs,
    rungs,
)
from autofit.planning.plan import Plan
from autofit.workload.entry import load_workload

ROOT = Path(__file__).resolve().parents[2]
TINY = f"{ROOT}/examples/seed_build_along.py:workload_tiny"


def ladder_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["ladder", TINY, "--hardware", "cpu", "--global-batch", "16", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_each_rung_adds_its_technique_to_the_one_before() -> None:
    ladder = rungs("bf16", world_size=2)
    configs = rung_configs(Config(micro_batch_size=8), ladder)
    assert {key: getattr(configs[0], key) for key in BASELINE} == BASELINE
    for before, after, rung in zip(configs, configs[1:], ladder[1:], strict=False):
        changed = {key for key, value in after.to_dict().items() if before.to_dict()[key] != value}
        assert changed == {key for key, value in rung.changes.items() if before.to_dict()[key] != value}
    last = configs[-1]
    assert (last.zero_stage, last.offload_optimizer, last.offload_params, last.precision, last.checkpoint_ratio) == (
        3, "cpu", "cpu", "bf16", 1.0)


@pytest.mark.slow  # the CLI plans and traces again what the plan fixture has (its footprints cached), ~3 s on 2 cores
def test_ladder_json_gives_predicted_peaks_that_fall_with_every_rung_but_mixed_precision() -> None:
    document = ladder_json("--gpus", "2")
    rows = document["rungs"]
    assert [row["name"] for row in rows] == [rung.name for rung in rungs("bf16", 2)]
    assert document["hardware"]["world_size"] == 2 and document["global_batch"] == 16
    assert all(row["config"]["micro_batch_size"] == 8 and row["config"]["grad_accum_steps"] == 1 for row in rows)
    # ZeRO-3 + CPU offload cannot run when the device is the CPU: refused with the rule's reason, never "fits"
    assert rows[-1]["fits"] is False and "the device is the CPU" in rows[-1]["reason"]
    runnable = [row["predicted"]["peak_bytes"] for row in rows[:-1]]
    # mixed precision adds the fp32 master and, on a CPU, oneDNN's 16-bit runtime: on a model this small and
    # fully checkpointed it saves less than that (the README's ladder shows the same at micro-batch 1)
    falls = [later <= earlier for earlier, later, row in zip(runnable, runnable[1:], rows[1:], strict=False)
             if row["name"] != "+ mixed precision"]
    assert all(falls) and len(falls) == len(runnable) - 2, runnable
    # strictly where it saves: checkpointing on the baseline, the rungs after mixed precision on it (whether mixed
    # precision ends above the baseline depends on the 16-bit runtime this machine measures: a CI venv's did)
    assert runnable[1] < runnable[0] and runnable[-1] < runnable[2], runnable
    assert all(row["fits"] and row["measured"] is None for row in rows[:-1])


@pytest.fixture(scope="module")
def plan() -> Plan:
    return ladder_plan(TINY, load_workload(TINY), get_hardware("cpu"), world_size=2, global_batch=16)


@pytest.mark.slow
def test_rungs_are_priced_by_the_plan(plan: Plan) -> None:
    ladder = price_ladder(plan)
    assert ladder.n_params == plan.facts.n_params and ladder.world_size == 2
    for row in ladder.rows:
        assert row.prediction == plan.predict(row.config)


@pytest.mark.slow
def test_a_budget_below_a_rung_says_it_does_not_fit(plan: Plan) -> None:
    full = price_ladder(plan).rows
    # the checkpointing rung is below the baseline (asserted above); the mixed-precision rung need not be
    budget = (full[0].prediction.peak_bytes + full[1].prediction.peak_bytes) // 2
    ladder = price_ladder(plan.with_memory(memory_for(budget, plan.margin)))  # a usable budget between the two
    assert ladder.usable_bytes == budget and ladder.to_dict()["budget"]["usable_bytes"] == budget
    rows = ladder.rows
    assert not rows[0].fits and rows[0].why_not is not None and rows[0].why_not.startswith("needs")
    assert rows[1].fits and rows[1].why_not is None


@pytest.mark.slow
def test_measure_ladder_probes_nothing_when_no_rung_fits(plan: Plan) -> None:
    ladder = price_ladder(plan.with_memory(2**20))
    said: list[str] = []
    assert measure_ladder(ladder, TINY, steps=1, say=said.append) == ladder
    assert said == ["autofit: no rung is predicted to fit: nothing to probe"]


@pytest.mark.slow
def test_measure_ladder_probes_each_fitting_rung_it_is_given(plan: Plan) -> None:
    ladder = price_ladder(plan)
    one = replace(ladder, rows=ladder.rows[1:2])  # checkpointing alone: one probe
    said: list[str] = []
    measured = measure_ladder(one, TINY, steps=1, say=said.append)
    (row,) = measured.rows
    assert row.measured is not None and row.measured["config"] == row.config.to_dict()
    assert row.measured["status"] in STATUSES and row.measured["peak_bytes"] > 0
    assert row.measured["world_size"] == 2
    assert any(line.startswith("autofit: probing rung 1 (+ activation checkpointing)") for line in said)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hardware", "cpu"], "needs --global-batch"),
        (["--hardware", "cpu", "--global-batch", "16", "--set", "precision=bf16"], "--set precision cannot be fixed"),
        (["--hardware", "cpu", "--global-batch", "16", "--space", "cpu"], "takes no --space"),
        (["--hardware", "cpu", "--global-batch", "3", "--gpus", "2"], "does not divide the global batch 3"),
        (["--hardware", "rtx4090", "--global-batch", "16", "--measure"], "needs a CUDA device"),
        (["--hardware", "tpu", "--global-batch", "16"], "tpu"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["ladder", TINY, *args])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("autofit: error:") and message in lines[-1], result.stderr
    assert not result.stdout


@pytest.mark.slow
def test_measure_probes_exactly_the_rungs_that_fit() -> None:
    full = ladder_json()["rungs"]
    # a budget between the baseline and checkpointing (~89 and ~50 MiB here): only the baseline does not fit. Not
    # between checkpointing and mixed precision: on this tiny model they differ by less than the measured kernel
    # footprint varies from one process to the next (0.2 MiB against ~0.4), and CI's run priced them the other way
    budget = (full[0]["predicted"]["peak_bytes"] + full[1]["predicted"]["peak_bytes"]) // 2
    rows = ladder_json("--memory", str(budget), "--measure", "--steps", "1")["rungs"]
    assert [row["fits"] for row in rows] == [False, True, True, True, True, False]
    for row in rows:
        measured = row["measured"]
        if not row["fits"]:
            assert measured is None
            continue
        assert measured["status"] in STATUSES and measured["config"] == row["config"]
        assert measured["peak_bytes"] > 0
        if measured["status"] == "ok":
            assert measured["samples_per_s"] > 0


def test_a_ladder_after_a_search_traces_only_what_the_searchs_trace_lacks() -> None:
    """The search's trace holds its recipe's precision alone; the ladder traces the mixed one and joins it: every rung
    priced as from one trace of both (the same profiles), the search's own profiles kept as they were."""
    from autofit.planning.plan import trace_for

    workload, h100 = load_workload(TINY), get_hardware("h100-80gb")
    whole = ladder_plan(TINY, workload, h100, world_size=2, global_batch=16)
    searched = trace_for(workload, [c for c in whole.candidates if c.precision == "fp32"], "cuda")
    assert {p.dtype for p in searched.profiles.values()} == {"fp32"}
    joined = ladder_plan(TINY, workload, h100, world_size=2, global_batch=16, facts=searched)
    assert all(joined.facts.profiles[key] is profile for key, profile in searched.profiles.items())
    assert joined.facts.profiles == whole.facts.profiles
    assert [row.prediction for row in price_ladder(joined).rows] == [row.prediction for row in price_ladder(whole).rows]


def test_the_rungs_past_zero_come_where_they_apply_each_in_place_of_what_it_cannot_run_beside() -> None:
    assert [r.name for r in parallel_rungs(8, 8, tensor_parallel_plan=False)] == []
    assert [r.name for r in parallel_rungs(16, 8, tensor_parallel_plan=True)] == ["+ hpZ", "+ tensor parallelism"]
    ladder = rungs("bf16", 16, long_context=True, per_node=8, tensor_parallel_plan=True)
    hpz, tp = rung_configs(Config(micro_batch_size=1), ladder)[-2:]
    assert (hpz.zero_stage, hpz.hpz_partition_size, hpz.offload_params, hpz.sequence_parallel) == (3, 8, "none", 1)
    assert (tp.tensor_parallel, tp.hpz_partition_size, tp.tiled_loss, tp.offload_activations) == (8, 1, False, "none")
    assert [r.name for r in rungs("bf16", 2)] == [r.name for r in rungs("bf16", 2, per_node=2)]  # one node: none
