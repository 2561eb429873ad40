"""The search end to end on a tiny model: real DeepSpeed probes on the CPU, fp32, no mocks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
from tiny import ENTRY, tiny_workload

from autofit.core.config import Config
from autofit.core.errors import AutofitError, NothingFits
from autofit.core.space import space_from_dict
from autofit.cost_model.calibrate import Calibration
from autofit.ds.emit import write_json_atomic
from autofit.machine.device import get_hardware
from autofit.planning.plan import Plan
from autofit.probe.result import ProbeResult
from autofit.report.folder import write_report
from autofit.report.outputs import write_deepspeed
from autofit.tuner import Prober, SearchSettings, run_search
from autofit.tuner.records import mean_samples
from autofit.tuner.study import MEASURED_ATTR

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
MIB = 2**20


def test_write_json_atomic_replaces_whole_files(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ds.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"b": 2})
    assert json.loads(path.read_text()) == {"b": 2}
    assert [p.name for p in path.parent.iterdir()] == ["ds.json"]


def _no_probe(config: Config, steps: int, timeout_s: float) -> ProbeResult:
    """The prober of a search where nothing fits: none may run (and the default one would first load the DeepSpeed
    ops the candidates need, in a subprocess, ~5 s)."""
    raise AssertionError(f"nothing fits, yet {config.label()} was probed")


def test_nothing_fits_raises_and_names_the_smallest_need(tmp_path: Path, storage: str, tiny_plan) -> None:  # noqa: ANN001
    with pytest.raises(NothingFits) as info:  # its own type: a scheduled search ends nothing-fits on it, not failed
        run_search(tiny_plan(2, [1, 2]), SearchSettings(trials=3), storage=storage, prober=_no_probe)
    message = str(info.value)
    assert "nothing fits" in message and "smallest candidate" in message and "needs" in message
    assert "10% safety margin" in message


@pytest.mark.slow
def test_nothing_fits_on_a_gpu_says_how_many_gpus_would_do(tmp_path: Path, storage: str, big_plan) -> None:  # noqa: ANN001
    space = space_from_dict(
        {
            "global_batch_size": 16,
            "micro_batch_size": [1],
            "precision": ["bf16"],
            "optimizer": ["adamw"],
            "zero_stage": [0, 3],
            "attention": ["sdpa"],
        },
        name="gpu",
    )
    plan = big_plan(get_hardware("h100-80gb", 2400 * MIB), space)
    with pytest.raises(AutofitError) as info:
        run_search(plan, SearchSettings(trials=3), storage=storage, prober=_no_probe)
    message = str(info.value)
    # how many depends on what the cost model adds per rank (NCCL's buffers, ZeRO's buckets): a count above one
    found = re.search(r"(\d+) GPUs with ZeRO-3 sharding", message)
    assert found is not None and int(found.group(1)) > 1, message


@pytest.mark.slow
def test_nothing_fits_in_host_memory_says_host_memory(tmp_path: Path, storage: str, big_plan) -> None:  # noqa: ANN001
    """Every candidate fits the device but not the node's host RAM: the advice names host memory."""
    space = space_from_dict(
        {"global_batch_size": 16, "micro_batch_size": [1], "precision": ["bf16"], "optimizer": ["adamw"],
         "zero_stage": [0], "attention": ["sdpa"]},
        name="gpu",
    )
    hardware = replace(get_hardware("h100-80gb"), host_memory_bytes=64 * MIB)
    plan = big_plan(hardware, space)
    (_, prediction), = plan.price()
    assert prediction.peak_bytes < hardware.memory_bytes and not prediction.fits
    with pytest.raises(AutofitError) as info:
        run_search(plan, SearchSettings(trials=3), storage=storage, prober=_no_probe)
    message = str(info.value)
    assert "host memory" in message and prediction.reason in message, message
    assert "more host RAM" in message and "1024 GPUs" not in message


@pytest.mark.slow
def test_search_emits_a_verified_winner_whose_json_trains(tmp_path: Path, storage: str, tiny_plan) -> None:  # noqa: ANN001
    out = tmp_path / "ds_config.json"
    report = tmp_path / "report"
    result = run_search(tiny_plan(1024, [2, 4, 16]), SearchSettings(trials=3), storage=storage, study_name="tiny")
    write_deepspeed(out, result.deepspeed)
    write_report(result, report)
    ds = json.loads(out.read_text())
    assert ds == result.deepspeed
    assert ds["train_batch_size"] == 16
    assert result.measured.status == "ok"
    assert result.measured.peak_bytes <= 0.9 * 1024 * MIB
    phases = [t.phase for t in result.trials]
    assert phases.count("verify") >= 1 and 1 <= phases.count("search") <= 3
    searched = [json.dumps(t.config.to_dict(), sort_keys=True) for t in result.trials if t.phase == "search"]
    assert len(searched) == len(set(searched))
    data = result.to_dict()
    assert set(data) >= {"best", "trials", "pruned"}
    assert set(data["best"]) == {"config", "measured", "predicted", "differs_from_recipe"}
    assert data["best"]["differs_from_recipe"] == []  # the tiny plan's recipe is what it searches
    json.dumps(data)  # JSON-serialisable as --json prints it
    for name in ("index.html", "report.md", "memory_breakdown.png", "memory_vs_throughput.png", "timeline.png"):
        assert (report / name).stat().st_size > 0, name
    assert "10%" in (report / "index.html").read_text()

    # the emitted JSON runs three steps through deepspeed.initialize, in a fresh process
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(HERE.parent)!r})
        import deepspeed, torch
        from tiny import Tiny
        from autofit.ds.launchers import fill_auto
        # the user's script fills the hyperparameters it gave autofit none of ("auto"), then trains
        ds = fill_auto(json.load(open({str(out)!r})), lr=0.01, weight_decay=0.0)
        ds.pop("autofit")
        deepspeed.init_distributed(dist_backend="gloo")
        model = Tiny()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        for _ in range(3 * ds["gradient_accumulation_steps"]):
            n = ds["train_micro_batch_size_per_gpu"]
            loss = engine(torch.randn(n, 128, 64), torch.randn(n, 1))
            engine.backward(loss)
            engine.step()
        assert engine.global_steps == 3, engine.global_steps
        print("TRAINED", engine.global_steps)
        """
    )
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29517",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        PYTHONPATH=str(REPO),
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "TRAINED 3" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


_RUNNER = """
import sys
sys.path.insert(0, {tests!r})
from tiny import ENTRY, sgd_space, tiny_workload
from autofit.machine.device import get_hardware
from autofit.planning.plan import Plan
from autofit.probe.result import ProbeResult
from autofit.core.recipe import Recipe
from autofit.tuner import Prober, SearchSettings, run_search
plan = Plan.make(ENTRY, tiny_workload(), get_hardware("cpu", 1024 * 2**20), sgd_space([1, 16]),
                 recipe=Recipe(optimizer="sgd", precision="fp32"))
run_search(plan, SearchSettings(trials=4), storage={storage!r}, study_name="resume")
"""


def _finished_probes(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db, timeout=1) as conn:
            rows = conn.execute("SELECT COUNT(*) FROM trial_user_attributes WHERE key = ?", (MEASURED_ATTR,)).fetchone()
        return int(rows[0])
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_a_killed_search_resumes_without_repeating_or_losing_probes(tmp_path: Path, tiny_plan) -> None:  # noqa: ANN001
    db = tmp_path / "study.db"
    storage = f"sqlite:///{db}"
    code = _RUNNER.format(tests=str(HERE.parent), storage=storage)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while _finished_probes(db) < 1:
            assert proc.poll() is None, "the search ended before its first probe finished"
            assert time.monotonic() < deadline, "no probe finished in time"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):  # already gone: its own failure is the one to report
            os.killpg(proc.pid, signal.SIGKILL)  # the search and the probe it may have started
        proc.wait()
    first = _finished_probes(db)

    result = run_search(tiny_plan(1024, [1, 16]), SearchSettings(trials=4), storage=storage, study_name="resume")
    resumed = [t for t in result.trials if t.resumed]
    assert len(resumed) == first >= 1
    searched = [
        json.dumps(t.config.to_dict(), sort_keys=True)
        for t in result.trials
        if t.phase == "search"
    ]
    assert len(searched) == len(set(searched)) == 2  # each config probed once, over both runs
    # the winner is what an uninterrupted search that measured the same picks, over both runs' probes: of the
    # configs verified within the margin, the highest mean over all their probes (step times on a shared CPU
    # are too noisy to name it in advance, and a runner-up close to the leader is verified too)
    verified = {t.config.key(): t.config for t in result.trials if t.phase == "verify" and t.within_margin}
    assert verified
    best = max(verified.values(), key=lambda config: mean_samples(result.trials, config))
    assert result.config == best
    assert result.deepspeed["train_micro_batch_size_per_gpu"] == best.micro_batch_size


def _device_prober(plan: Plan, truth: Calibration, calls: list[Config]) -> Prober:
    """A prober for a device the plan's prior does not know: the cost model at ``truth``'s coefficients
    answers (an oom past the device's memory), as a replay or a remote executor would plug in."""

    def probe(config: Config, steps: int, timeout_s: float) -> ProbeResult:
        calls.append(config)
        p = truth.predict(config, plan.facts, plan.hardware, plan.world_size)
        if p.peak_bytes > plan.hardware.memory_bytes:
            return ProbeResult(config, "oom", plan.hardware.memory_bytes, 0.0, 0.0, None, "past the budget", 1.0)
        return ProbeResult(config, "ok", p.peak_bytes, p.step_time_s, p.samples_per_s, None, None, 1.0)

    return probe


@pytest.mark.slow
def test_a_prober_plugs_in_and_the_search_finds_that_devices_best(tmp_path: Path, storage: str) -> None:
    space = space_from_dict(
        {"global_batch_size": 16, "micro_batch_size": [1, 2, 4, 8, 16], "checkpoint_ratio": [0.0, 0.5, 1.0],
         "precision": ["fp32"], "optimizer": ["sgd", "adamw"], "zero_stage": [0], "attention": ["sdpa"]},
        name="plug",
    )
    workload = tiny_workload()
    # the space as written (two optimizer families to search), not narrowed to one recipe
    unbounded = Plan.make(ENTRY, workload, get_hardware("cpu", 2**40), space, narrow=False)
    # the device is the cost model itself, so this host's measured kernel footprint is left out: it differs by host
    # (10 MiB on the development VM), and a large one (from ~70 MiB on) squeezes every peak into a few percent of the
    # budget, where eight trials cannot tell the configs apart
    unbounded = replace(unbounded, facts=replace(unbounded.facts, kernel_footprint_bytes={}))
    # the device: 3x slower compute, 2x the per-micro-batch overhead and 1.3x the memory the prior expects
    prior = unbounded.coefficients
    truth = Calibration(coefficients=prior.with_(
        compute_efficiency={k: v / 3 for k, v in prior.compute_efficiency.items()},
        micro_batch_overhead_s=2 * prior.micro_batch_overhead_s, memory_scale=1.3 * prior.memory_scale,
    ))
    peaks = sorted(truth.predict(c, unbounded.facts, unbounded.hardware, 1).peak_bytes for c in unbounded.candidates)
    budget = int(peaks[len(peaks) // 2] / 0.9) + 1  # about half the space fits the usable budget
    plan = replace(unbounded, hardware=unbounded.hardware.with_memory(budget))
    calls: list[Config] = []
    result = run_search(plan, SearchSettings(trials=8), storage=storage,
                        prober=_device_prober(plan, truth, calls))
    usable = plan.with_memory(int(0.9 * budget))
    fitting = [(c, truth.predict(c, plan.facts, usable.hardware, 1)) for c in plan.candidates]
    best = max((cp for cp in fitting if cp[1].fits), key=lambda cp: cp[1].samples_per_s)
    assert result.config == best[0]
    assert [t.config for t in result.trials] == calls  # every probe went through the prober, in order
    assert result.to_dict()["model"]["n_params"] == sum(p.numel() for p in workload.build_model().parameters())
    assert len({c.key() for c in calls}) < len(plan.candidates) // 2


@pytest.mark.slow
def test_ooms_in_one_family_leave_the_others_to_be_measured(tmp_path: Path, storage: str) -> None:
    """The first family the search probes runs three times over the model on this device (an offload
    buffer the model lacks, say): it is measured out of memory, and a config of another family wins."""
    space = space_from_dict(
        {"global_batch_size": 16, "micro_batch_size": [1, 2, 4, 8, 16], "checkpoint_ratio": [0.0, 1.0],
         "precision": ["fp32"], "optimizer": ["sgd", "adamw", "lion"], "zero_stage": [0], "attention": ["sdpa"]},
        name="families",
    )
    # the policy over optimizer families: the space as written, not narrowed to one recipe
    unbounded = Plan.make(ENTRY, tiny_workload(), get_hardware("cpu", 2**40), space, narrow=False)
    truth = unbounded.uncalibrated()
    peaks = sorted(truth.predict(c, unbounded.facts, unbounded.hardware, 1).peak_bytes for c in unbounded.candidates)
    plan = replace(unbounded, hardware=unbounded.hardware.with_memory(int(peaks[-1] / 0.9) + 1))  # all fit, as modelled
    bad: list[str] = []

    def prober(config: Config, steps: int, timeout_s: float) -> ProbeResult:
        p = truth.predict(config, plan.facts, plan.hardware, 1)
        bad.append(bad[0] if bad else config.optimizer)
        if config.optimizer == bad[0]:
            return ProbeResult(config, "oom", plan.hardware.memory_bytes, 0.0, 0.0, None, "past the budget", 1.0)
        return ProbeResult(config, "ok", p.peak_bytes, p.step_time_s, p.samples_per_s, None, None, 1.0)

    result = run_search(plan, SearchSettings(trials=6), storage=storage, prober=prober)
    ooms = [t for t in result.trials if t.status == "oom"]
    assert ooms and {t.config.optimizer for t in ooms} == {bad[0]}
    assert result.config.optimizer != bad[0] and result.measured.peak_bytes <= 0.9 * plan.hardware.memory_bytes


@pytest.mark.slow
def test_a_device_far_slower_than_the_prior_costs_at_most_one_timed_out_probe(tmp_path: Path, storage: str) -> None:
    """The prior thinks the device 8x faster than it is, and the first probe's timeout is too short for it:
    the limit doubles after a timeout, and once a probe has run the calibrated step time sets the next
    probes' timed steps (fewer for slow configs) and timeouts, so nothing else times out."""
    space = space_from_dict(
        {"global_batch_size": 16, "micro_batch_size": [1, 2, 4, 8, 16], "checkpoint_ratio": [0.0, 1.0],
         "precision": ["fp32"], "optimizer": ["sgd", "adamw"], "zero_stage": [0], "attention": ["sdpa"]},
        name="slow",
    )
    plan = Plan.make(ENTRY, tiny_workload(), get_hardware("cpu", 2**40), space)
    prior = plan.coefficients
    truth = Calibration(coefficients=prior.with_(
        compute_efficiency={k: v / 8 for k, v in prior.compute_efficiency.items()},
        micro_batch_overhead_s=8 * prior.micro_batch_overhead_s,
    ))
    settings = SearchSettings(trials=6, probe_timeout_s=0.5, probe_seconds=0.5)
    given: list[tuple[int, float, float]] = []

    def prober(config: Config, steps: int, timeout_s: float) -> ProbeResult:
        p = truth.predict(config, plan.facts, plan.hardware, 1)
        given.append((steps, timeout_s, p.step_time_s))
        if (steps + 1) * p.step_time_s > timeout_s:  # a warm-up and the timed steps did not finish in time
            return ProbeResult(config, "timeout", 0, 0.0, 0.0, None, "did not finish", timeout_s)
        return ProbeResult(config, "ok", p.peak_bytes, p.step_time_s, p.samples_per_s, None, None, 1.0)

    result = run_search(plan, settings, storage=storage, prober=prober)
    statuses = [t.status for t in result.trials]
    assert statuses.count("timeout") == 1 and statuses[0] == "timeout" and result.config is not None
    assert given[0][0] == settings.probe_steps  # the prior expects a fast step: every timed step
    slow = [steps for steps, _, step_s in given[2:] if step_s * settings.probe_steps > 2 * settings.probe_seconds]
    assert slow and max(slow) < settings.probe_steps  # the calibrated model knows better: fewer timed steps


@pytest.mark.slow
def test_a_time_budget_starts_no_probe_that_would_not_finish_and_keeps_time_to_verify(tmp_path: Path,
                                                                                       storage: str) -> None:
    """A stand-in device whose probes take their start-up and their steps in wall time: the search stops when the
    next probe and a verification would not fit the budget, and ends with a verified winner within it."""
    space = space_from_dict(
        {"global_batch_size": 16, "micro_batch_size": [1, 2, 4, 8, 16], "checkpoint_ratio": [0.0, 0.5, 1.0],
         "precision": ["fp32"], "optimizer": ["sgd", "adamw"], "zero_stage": [0], "attention": ["sdpa"]},
        name="budget",
    )
    plan = Plan.make(ENTRY, tiny_workload(), get_hardware("cpu", 2**40), space, narrow=False)
    prior = plan.coefficients  # the device: 1.5x slower compute, 4x the per-micro-batch overhead the prior expects
    truth = Calibration(coefficients=prior.with_(
        compute_efficiency={k: v / 1.5 for k, v in prior.compute_efficiency.items()},
        micro_batch_overhead_s=4 * prior.micro_batch_overhead_s,
    ))
    start_up_s = 0.3

    def prober(config: Config, steps: int, timeout_s: float) -> ProbeResult:
        p = truth.predict(config, plan.facts, plan.hardware, 1)
        steps_s = (steps + 4) * max(p.step_time_s, 0.02)
        time.sleep(start_up_s + steps_s)
        return ProbeResult(config, "ok", p.peak_bytes, p.step_time_s, p.samples_per_s, None, None, start_up_s,
                           phases_s={"steps_s": steps_s}, wall_s=start_up_s + steps_s)

    budget_s = 6.0
    started = time.monotonic()
    # a stop rule that never stops: only the budget ends the search
    settings = SearchSettings(trials=50, timeout_s=budget_s, stop_tolerance=10.0, max_stop_tolerance=10.0)
    result = run_search(plan, settings, storage=storage, prober=prober)
    elapsed = time.monotonic() - started
    assert "time-budget" in result.stop_reason
    assert 3 <= sum(1 for t in result.trials if t.phase == "search") < 50
    assert any(t.phase == "verify" and t.config == result.config for t in result.trials)
    assert elapsed <= 1.15 * budget_s
