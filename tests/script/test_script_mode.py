"""Script mode: an unmodified DeepSpeed script (examples/ds_script/train.py) searched through its JSON alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.recipe import Recipe
from autofit.core.space import space_from_dict
from autofit.core.units import parse_bytes
from autofit.machine.device import get_hardware
from autofit.report.outputs import write_deepspeed
from autofit.script import ScriptCommand, script_plan, script_prober
from autofit.script.prober import read_metric, result_of
from autofit.script.records import DeepSpeedMetric, ModelInfo
from autofit.script.runner import ScriptRun
from autofit.tuner import SearchSettings, run_search

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "ds_script" / "train.py"
COMMAND = f"{sys.executable} {SCRIPT} --deepspeed_config {{config}}"
CONFIG = Config(micro_batch_size=2, grad_accum_steps=2, checkpoint_ratio=0.0, precision="fp32", optimizer="adamw",
                zero_stage=0, offload_optimizer="none", offload_params="none", attention="sdpa")


def test_the_command_must_say_where_the_json_goes() -> None:
    with pytest.raises(AutofitError, match=r"\{config\}"):
        ScriptCommand("python train.py --deepspeed_config ds.json")
    command = ScriptCommand("python 'my train.py' --deepspeed_config={config}")
    assert command.argv(Path("/tmp/a b.json")) == ["python", "my train.py", "--deepspeed_config=/tmp/a b.json"]
    assert command.name == "script:my train.py"


def test_a_run_without_deepspeeds_metric_is_an_error_and_one_over_the_budget_is_oom() -> None:
    crashed = ScriptRun(returncodes=[1], log_tails=["Traceback ...\nValueError: bad shape\n"], peak_bytes=[10],
                        timed_out=False, over_budget=False, wall_s=1.0)
    result = result_of(CONFIG, 1, crashed, None, 60.0)
    assert (result.status, result.samples_per_s) == ("error", 0.0)
    assert "ValueError: bad shape" in (result.message or "")
    over = ScriptRun(returncodes=[-9], log_tails=[""], peak_bytes=[2**30], timed_out=False, over_budget=True, wall_s=1.0)
    assert (result_of(CONFIG, 1, over, None, 60.0).status, result_of(CONFIG, 1, over, None, 60.0).oom_on) == ("oom", "device")
    host = ScriptRun(returncodes=[1], log_tails=["RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried"],
                     peak_bytes=[5], timed_out=False, over_budget=False, wall_s=1.0)
    assert result_of(CONFIG, 1, host, None, 60.0).oom_on == "host"


METRIC = {"fwd": 1000.0, "bwd": 2000.0, "step": 500.0, "latency": 7000.0, "FLOPS_per_gpu": 1e9, "throughput": 571.4,
          "rank": 0}
RAN = ScriptRun(returncodes=[0], log_tails=[""], peak_bytes=[10], timed_out=False, over_budget=False, wall_s=3.0)


def test_deepspeeds_files_round_trip_as_records() -> None:
    metric = DeepSpeedMetric.from_json(METRIC)
    assert DeepSpeedMetric.from_json(json.loads(json.dumps(metric.to_json()))) == metric
    info = ModelInfo(num_params=100, trainable_num_params=90, activation_mem_per_gpu=4096, rank=0)
    assert ModelInfo.from_json(json.loads(json.dumps(info.to_json()))) == info


def test_a_metric_file_with_a_missing_or_unknown_key_is_refused_naming_it() -> None:
    with pytest.raises(AutofitError, match="missing key 'latency'"):
        DeepSpeedMetric.from_json({k: v for k, v in METRIC.items() if k != "latency"})
    with pytest.raises(AutofitError, match="unknown key 'latency_us'"):
        DeepSpeedMetric.from_json(METRIC | {"latency_us": 7000.0})
    with pytest.raises(AutofitError, match="missing key 'num_params'"):
        ModelInfo.from_json({"trainable_num_params": 1, "activation_mem_per_gpu": 1, "rank": 0})
    # a timer DeepSpeed never started is left out of its file (utils/timer.py get_mean)
    assert DeepSpeedMetric.from_json({k: v for k, v in METRIC.items() if k != "step"}).step == 0.0


def test_a_script_run_is_timed_from_its_metric_file_and_a_renamed_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "metric.json"
    path.write_text(json.dumps(METRIC))
    metric, unreadable = read_metric(path)
    assert unreadable is None
    result = result_of(CONFIG, 1, RAN, metric, 60.0)
    assert result.status == "ok" and result.step_time_s == pytest.approx(7000e-6)
    assert result.phases_s["forward_s"] == pytest.approx(2 * 1000e-6)
    path.write_text(json.dumps({("latency_us" if k == "latency" else k): v for k, v in METRIC.items()}))
    metric, unreadable = read_metric(path)
    renamed = result_of(CONFIG, 1, RAN, metric, 60.0, unreadable)
    assert renamed.status == "error" and renamed.message is not None and "latency" in renamed.message
    assert read_metric(tmp_path / "none.json") == (None, None)


def test_client_optimizers_are_left_out_unless_fixed(tmp_path: Path) -> None:
    from autofit.script.profile import script_cannot

    lion = CONFIG.with_(optimizer="lion")
    assert script_cannot(lion, "cpu", {}) is not None  # FusedLion is CUDA-only: a client optimizer on the CPU
    assert script_cannot(lion, "cuda", {}) is None
    assert script_cannot(CONFIG.with_(optimizer="adamw8bit"), "cuda", {"optimizer": "adamw8bit"}) is None


@pytest.mark.slow
def test_script_mode_finds_a_fitting_config_for_an_unmodified_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    hardware = get_hardware("cpu", parse_bytes("600MiB"))
    space = space_from_dict({"micro_batch_size": [2, 4], "optimizer": ["adamw", "sgd", "lion"], "precision": ["fp32"],
                             "zero_stage": [0], "checkpoint_ratio": [0.0, 1.0]}, name="script-test")
    command = ScriptCommand(COMMAND)
    recipe = Recipe("adamw", "fp32", hyperparameters={"lr": 3e-4})
    plan = script_plan(command, hardware, space, world_size=1, global_batch=4, workdir=tmp_path / "profile",
                       recipe=recipe)
    # DeepSpeed's profile of the script's own model: its parameter count (embedding, 4 blocks, head) and FLOPs
    assert plan.facts.n_params == 1_056_256 and plan.facts.trace_mode == "deepspeed-profile"
    assert {c.optimizer for c in plan.candidates} == {"adamw"}  # the recipe's: sgd and lion are not searched
    assert {c.checkpoint_ratio for c in plan.candidates} == {0.0}

    settings = SearchSettings(trials=2, min_probes=2, probe_steps=1, verify_steps=1, max_verifications=1, contenders=1)
    result = run_search(plan, settings, storage=f"sqlite:///{tmp_path / 'study.db'}",
                        prober=script_prober(command, hardware, 1, tmp_path / "probes"))
    assert result.measured.peak_bytes <= 0.9 * hardware.memory_bytes
    assert result.trials and all(t.status == "ok" for t in result.trials)
    for trial in result.trials:  # each probe's own measurements: memory from outside, time from DeepSpeed's metric
        assert 0 < trial.measured.peak_bytes < hardware.memory_bytes
        assert trial.measured.samples_per_s > 0 and "DeepSpeed's metric" in (trial.measured.message or "")
        assert trial.measured.phases_s["forward_s"] > 0
    out = tmp_path / "ds_config.json"
    write_deepspeed(out, result.deepspeed)
    ds = json.loads(out.read_text())
    assert ds["train_batch_size"] == 4 and "autotuning" not in ds
    # the script hands the JSON to deepspeed.initialize, which fills no "auto": the user's rate, the rest left out
    assert ds["optimizer"]["params"]["lr"] == 3e-4 and "auto" not in ds["optimizer"]["params"].values()

    # the winner trains the script as it is, for the steps it asks for
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="29537", RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--deepspeed_config", str(out), "--steps", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "step 0 loss" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_run_takes_an_entry_or_a_script_not_both() -> None:
    from click.testing import CliRunner

    from autofit.cli import main

    neither = CliRunner().invoke(main, ["run", "--hardware", "cpu"])
    both = CliRunner().invoke(main, ["run", "examples/mlp.py:workload", "--script", COMMAND, "--hardware", "cpu"])
    no_placeholder = CliRunner().invoke(main, ["run", "--script", "python train.py", "--hardware", "cpu"])
    for result in (neither, both, no_placeholder):
        assert result.exit_code == 1
        assert result.output.count("\n") == 1 and result.output.startswith("autofit: error:"), result.output


@pytest.mark.slow
def test_a_program_that_does_not_exist_is_one_clear_error(tmp_path: Path) -> None:
    from autofit.script.prober import probe_script

    with pytest.raises(AutofitError, match="cannot start 'no-such-program-here'"):
        probe_script(ScriptCommand("no-such-program-here --deepspeed_config {config}"), CONFIG,
                     get_hardware("cpu", parse_bytes("1GiB")), 1, tmp_path, timeout_s=10)
