"""Real probes of tiny models: subprocess ranks, real DeepSpeed on the CPU (gloo), no mocks.

Each real probe pays the imports and ``deepspeed.initialize`` (~8 s on 2 cores), so
they are marked slow. The first DeepSpeed start on a machine JIT-builds a C++ op
(~2 minutes, cached after): the timeouts allow for it.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.cost_model.memory import MemoryBreakdown
from autofit.cost_model.prediction import PredictionRecord
from autofit.machine.device import get_hardware
from autofit.probe.result import ProbeResult
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec
from tests.toy_facts import FACTS

HERE = Path(__file__).resolve().parent
ENTRY = f"{HERE / 'probe_workloads.py'}"
CPU = get_hardware("cpu")
START_S = 300.0  # generous: the first DeepSpeed start on a fresh machine builds an op


#: a prediction as a probe's result carries it
PREDICTED = PredictionRecord(peak_bytes=9, host_peak_bytes=20, breakdown=MemoryBreakdown(5, 1, 1, 1, 1), step_time_s=0.5,
                             samples_per_s=2.0, tokens_per_s=None, time_breakdown={"compute": 0.5})


def entry(name: str) -> str:
    return f"{ENTRY}:{name}"


def test_probe_result_json_has_the_design_keys() -> None:
    result = ProbeResult(
        config=Config(),
        status="ok",
        peak_bytes=10,
        step_time_s=0.5,
        samples_per_s=2.0,
        tokens_per_s=None,
        message=None,
        overhead_s=1.0,
        per_rank_peak_bytes=[10],
    )
    out = result.with_predicted(PREDICTED).to_json()
    for key in (
        "config",
        "status",
        "peak_bytes",
        "step_time_s",
        "samples_per_s",
        "tokens_per_s",
        "predicted",
        "message",
    ):
        assert key in out
    assert out["config"]["micro_batch_size"] == 1
    assert out["predicted"] == PREDICTED.to_json()
    assert list(out["predicted"]) == ["peak_bytes", "host_peak_bytes", "breakdown", "step_time_s", "samples_per_s",
                                      "tokens_per_s", "time_breakdown"]  # docs/design.md, "JSON output"
    assert result.to_json()["predicted"] == {}


def _full_result() -> ProbeResult:
    return ProbeResult(
        config=Config(micro_batch_size=2, zero_stage=2), status="oom", peak_bytes=10, step_time_s=0.0, samples_per_s=0.0,
        tokens_per_s=None, message="past the budget", overhead_s=1.5, per_rank_peak_bytes=[10, 9],
        phases_s={"imports_s": 1.0}, world_size=2, wall_s=3.0, predicted=PREDICTED, oom_on="host",
        device_memory={"nvml_peak_bytes": None, "context_bytes": 5}, per_rank_build_bytes=[1, 2],
    )


def test_probe_result_round_trips_through_its_json() -> None:
    result = _full_result()
    assert ProbeResult.from_json(json.loads(json.dumps(result.to_json()))) == result
    bare = replace(result, predicted=None)
    assert ProbeResult.from_json(bare.to_json()) == bare


def test_probe_result_json_with_a_missing_or_unknown_key_is_refused_naming_it() -> None:
    data = _full_result().to_json()
    del data["peak_bytes"]
    with pytest.raises(AutofitError, match="missing key 'peak_bytes'"):
        ProbeResult.from_json(data)
    with pytest.raises(AutofitError, match="unknown key 'peak_byte'"):
        ProbeResult.from_json(data | {"peak_byte": 10})
    with pytest.raises(AutofitError, match="status"):
        ProbeResult.from_json(_full_result().to_json() | {"status": "fine"})


@pytest.mark.slow
def test_real_probe_of_a_tiny_model_is_ok() -> None:
    config = Config(micro_batch_size=4, grad_accum_steps=2, checkpoint_ratio=0.5)
    result = run_probe(probe_spec(entry("tiny"), config, CPU, steps=2, warmup_steps=1), timeout_s=START_S)
    assert result.status == "ok", result.message
    assert result.peak_bytes > 0
    assert result.per_rank_peak_bytes == [result.peak_bytes]
    assert result.step_time_s > 0
    assert result.samples_per_s == pytest.approx(8 / result.step_time_s)
    assert result.tokens_per_s == pytest.approx(16 * result.samples_per_s)
    assert result.overhead_s > 0
    assert {"process_start_s", "imports_s", "model_build_s", "initialize_s"} <= set(result.phases_s)
    # every timed step is kept (more than asked only while they disagree), the warm-up steps apart, and the
    # optimizer's update is timed apart, inside the step
    assert len(result.step_times_s) == 2 or (len(result.step_times_s) > 2 and _spread(result.step_times_s[:-1]) > 0.1)
    assert len(result.warmup_times_s) >= 1
    assert min(result.step_times_s) <= result.step_time_s <= max(result.step_times_s)
    assert 0 < result.optimizer_time_s < result.step_time_s


@pytest.mark.slow
def _spread(times: list[float]) -> float:
    ordered = sorted(times)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return (ordered[-1] - ordered[0]) / median


@pytest.mark.slow
def test_probe_past_the_memory_budget_is_oom_quickly() -> None:
    hardware = get_hardware("cpu", memory_bytes=256 * 2**20)
    t0 = time.monotonic()
    result = run_probe(probe_spec(entry("hog"), Config(), hardware), timeout_s=START_S)
    elapsed = time.monotonic() - t0
    assert result.status == "oom", result.message
    assert 256 * 2**20 < result.peak_bytes < 2 * 2**30  # stopped on the way to 2 GiB
    assert "budget" in (result.message or "")
    assert elapsed < 60


@pytest.mark.slow
@pytest.mark.parametrize(("name", "text"), [("broken", "broken on purpose"), ("broken_loss", "loss exploded")])
def test_an_entry_that_raises_is_error_with_its_message(name: str, text: str) -> None:
    result = run_probe(probe_spec(entry(name), Config(), CPU), timeout_s=START_S)
    assert result.status == "error"
    assert text in (result.message or "")
    assert "\n" not in (result.message or "")
    assert result.step_time_s == 0.0


@pytest.mark.slow
def test_a_probe_whose_loss_is_nan_is_an_error_not_a_measurement() -> None:
    result = run_probe(probe_spec(entry("nan_loss"), Config(), CPU, steps=1), timeout_s=START_S)
    assert result.status == "error"
    assert "does not train" in result.message and "nan" in result.message


@pytest.mark.slow
def test_a_transformers_model_built_under_zero3_is_initialised_and_trains() -> None:
    """Mixtral's experts and router are ``torch.empty`` parameters: built under zero.Init alone they keep
    whatever the memory held (bf16: nan loss, every step skipped as an overflow). build_context holds
    transformers' HfDeepSpeedConfig too, so ``from_config`` initialises them gathered."""
    pytest.importorskip("transformers")
    config = Config(precision="bf16", zero_stage=3, optimizer="adamw", micro_batch_size=2, checkpoint_ratio=0.0)
    result = run_probe(probe_spec(entry("mixtral"), config, CPU, steps=2), timeout_s=START_S)
    assert result.status == "ok", result.message


def test_cpu_ranks_cap_onednn_primitive_caches_unless_the_user_set_them() -> None:
    from autofit.probe.launch import ONEDNN_CACHE_CAPACITY, rank_env

    env = rank_env({}, 0, 1, 29500, "cpu")
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == env["LRU_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
    assert rank_env({"LRU_CACHE_CAPACITY": "1024"}, 0, 1, 29500, "cpu")["LRU_CACHE_CAPACITY"] == "1024"
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in rank_env({}, 0, 1, 29500, "cuda")


@pytest.mark.slow
def test_timeout_kills_the_whole_process_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("AUTOFIT_TEST_PIDFILE", str(pidfile))
    t0 = time.monotonic()
    # fake mode reaches the entry point fastest (no DeepSpeed import first)
    result = run_probe(probe_spec(entry("sleeper"), Config(), CPU, mode="fake"), timeout_s=8.0)
    assert result.status == "timeout"
    assert time.monotonic() - t0 < 20
    assert "8 s" in (result.message or "")
    pids = [int(p) for p in pidfile.read_text().split()]  # the rank and the child it started
    assert len(pids) == 2
    for pid in pids:
        assert not _alive(pid), f"process {pid} outlived the probe"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_world_size_two_zero(stage: int) -> None:
    config = Config(micro_batch_size=2, zero_stage=stage)
    result = run_probe(probe_spec(entry("tiny"), config, CPU, world_size=2, steps=2), timeout_s=START_S)
    assert result.status == "ok", result.message
    assert len(result.per_rank_peak_bytes) == 2
    assert all(b > 0 for b in result.per_rank_peak_bytes)
    assert result.peak_bytes == max(result.per_rank_peak_bytes)
    assert result.samples_per_s == pytest.approx(2 * 2 / result.step_time_s)


@pytest.mark.slow
def test_fake_mode_peak_is_close_to_a_real_probe() -> None:
    config = Config(micro_batch_size=4)
    real = run_probe(probe_spec(entry("medium"), config, CPU, steps=2), timeout_s=START_S)
    fake = run_probe(probe_spec(entry("medium"), config, CPU, mode="fake"), timeout_s=START_S)
    assert real.status == fake.status == "ok", (real.message, fake.message)
    assert fake.peak_bytes == pytest.approx(real.peak_bytes, rel=0.05)
    assert set(fake.breakdown) == {"params", "grads", "optimizer", "activations", "other"}


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_zero3_builds_under_zero_init_with_half_the_parameters_per_rank() -> None:
    """World size 2: under ZeRO-3 each rank holds about half the parameters from the start (zero.Init);
    under ZeRO-2 each rank builds a whole copy."""
    whole = run_probe(probe_spec(entry("medium"), Config(zero_stage=2), CPU, 2, steps=1, warmup_steps=0), timeout_s=START_S)
    split = run_probe(probe_spec(entry("medium"), Config(zero_stage=3), CPU, 2, steps=1, warmup_steps=0), timeout_s=START_S)
    assert whole.status == split.status == "ok", (whole.message, split.message)
    n_params = whole.per_rank_param_elements[0]
    assert whole.per_rank_param_elements == [n_params, n_params]
    assert sum(split.per_rank_param_elements) == pytest.approx(n_params, rel=0.01)
    for held, built in zip(split.per_rank_param_elements, split.per_rank_build_bytes, strict=True):
        assert held == pytest.approx(n_params / 2, rel=0.02)
        # the fp32 partition (half the copy) plus at most one of the four blocks made whole for a moment
        # (zero.Init partitions each module as its __init__ returns), against the whole fp32 copy
        assert built < (0.5 + 1 / 4) * min(whole.per_rank_build_bytes)
    assert min(whole.per_rank_build_bytes) > 0.9 * 4 * n_params
    # the initialize checkpoint lies between the build and the whole probe's peak, on every rank
    for probe in (whole, split):
        for built, initialized, peak in zip(probe.per_rank_build_bytes, probe.per_rank_initialize_bytes,
                                            probe.per_rank_peak_bytes, strict=True):
            assert built <= initialized <= peak


@pytest.mark.slow
def test_two_nodes_run_through_the_elastic_launcher() -> None:
    """``autofit probe --gpus 1 --nodes 2`` on one machine: two torch.distributed.run agents over loopback (c10d)."""
    import json

    from click.testing import CliRunner

    from autofit.cli import main
    from autofit.probe.elastic import check_devices

    argv = ["probe", entry("tiny"), "--hardware", "cpu", "--gpus", "1", "--nodes", "2", "--steps", "1", "--json"]
    for fixed in ("micro_batch_size=2", "zero_stage=2", "offload_optimizer=none", "optimizer=adamw", "precision=fp32"):
        argv += ["--set", fixed]
    done = CliRunner().invoke(main, argv)
    assert done.exit_code == 0, done.output[-2000:]
    result = json.loads(done.stdout)
    assert result["status"] == "ok", result["message"]
    assert result["launcher"] == "torch.distributed.run"
    assert result["world_size"] == 2 and all(b > 0 for b in result["per_rank_peak_bytes"])
    with pytest.raises(AutofitError, match="ranks per node, but this node has 4"):
        check_devices("cuda", 8, 4)


@pytest.mark.slow
def test_sixteen_bit_zero0_initialize_is_priced_with_its_first_optimizer_step() -> None:
    """DeepSpeed's 16-bit ZeRO-0 wrapper ends ``initialize`` with an optimizer step on zero gradients
    (``initialize_optimizer_states``): the parameters, the fp32 master, zero gradients in both precisions and
    the states it creates are all held at once. The cost model's init phase against the probe's own reading
    of the peak through ``initialize``, on a 34 M-parameter model (priced without them it was 28% short on a
    Qwen2 model)."""
    from autofit.cost_model.coefficients import Coefficients
    from autofit.cost_model.memory import memory_phases
    from autofit.planning.plan import trace_for
    from autofit.workload.entry import load_workload

    config = Config(precision="bf16", zero_stage=0, optimizer="sgd", micro_batch_size=1, checkpoint_ratio=0.0)
    result = run_probe(probe_spec(entry("medium"), config, CPU, 1, steps=1, warmup_steps=0), timeout_s=START_S)
    assert result.status == "ok", result.message
    facts = trace_for(load_workload(entry("medium")), [config])
    phases = memory_phases(config, facts, CPU, 1, Coefficients.for_hardware(CPU))
    assert result.per_rank_initialize_bytes[0] == pytest.approx(phases["init"].total, rel=0.05)


@pytest.mark.slow
def test_zero3_reduces_its_last_gradient_bucket_through_a_flat_copy_after_backward() -> None:
    """ZeRO-3's reduce-scatter of the last bucket (every gradient of a model under ``reduce_bucket_size``)
    ``torch.cat``s it into a flat buffer after the activations are gone, and the CPU backend copies that
    again: the run's peak is that moment, the cost model's ``reduce`` phase (a ViT at mb2 was 12% under
    without it), not its backward or its step."""
    from autofit.cost_model.coefficients import Coefficients
    from autofit.cost_model.memory import memory_phases
    from autofit.planning.plan import trace_for
    from autofit.workload.entry import load_workload

    config = Config(precision="fp32", zero_stage=3, optimizer="adamw", micro_batch_size=1, checkpoint_ratio=0.0)
    # buckets larger than the model (autofit's when the hidden size is unknown, hidden_size=0), so the last holds
    # every gradient; the model's own (1024^2 elements) would reduce it in many small ones
    result = run_probe(probe_spec(entry("medium"), config, CPU, 1, steps=1, warmup_steps=1), timeout_s=START_S)
    assert result.status == "ok", result.message
    facts = replace(trace_for(load_workload(entry("medium")), [config]), hidden_size=0)
    phases = memory_phases(config, facts, CPU, 1, Coefficients.for_hardware(CPU))
    others = max(phase.total for name, phase in phases.items() if name != "reduce")
    assert phases["reduce"].total > others
    assert result.peak_bytes == pytest.approx(phases["reduce"].total, rel=0.05)
    assert result.peak_bytes > 1.1 * others


@pytest.mark.slow
def test_a_compiled_probe_times_its_compile_apart_from_its_steps() -> None:
    """compile=on runs engine.compile() (inductor, the C++ compiler on the CPU): the step that compiles is timed
    apart as compile_s (start-up, in the wall time), never among the timed steps samples/s is made of."""
    config = Config(micro_batch_size=4, checkpoint_ratio=0.5, compile="on")
    result = run_probe(probe_spec(entry("tiny"), config, CPU, steps=3, warmup_steps=1), timeout_s=START_S)
    assert result.status == "ok", result.message
    compile_s = result.phases_s["compile_s"]
    assert len(result.step_times_s) >= 3
    # compiling is slower than any compiled step, and part of the start-up, not of the step time
    assert compile_s > max(result.step_times_s)
    assert result.overhead_s >= compile_s
    assert result.samples_per_s == pytest.approx(4 / result.step_time_s)
    assert result.wall_s > compile_s


@pytest.mark.slow
def test_a_compile_that_fails_is_an_error_naming_compile() -> None:
    """A model whose forward torch.compile cannot trace (it trains eagerly): the first step raises, and the
    candidate is an error that says compile failed and why, not a measurement; the same model eager trains."""
    result = run_probe(probe_spec(entry("uncompilable"), Config(compile="on"), CPU, steps=1, warmup_steps=0), timeout_s=START_S)
    assert result.status == "error"
    message = result.message or ""
    assert message.startswith("CompileError: torch.compile failed in the first step"), message
    assert "TorchRuntimeError" in message and "\n" not in message, message  # dynamo's own error, one line
    assert result.step_time_s == 0.0
    eager = run_probe(probe_spec(entry("uncompilable"), Config(), CPU, steps=1, warmup_steps=0), timeout_s=START_S)
    assert eager.status == "ok", eager.message


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_comm_and_model_derived_buckets_train_through_real_deepspeed(stage: int) -> None:
    """overlap_comm on, buckets 4x the tiny model's width (128) squared, so its gradients fill several buckets, on two
    gloo ranks: DeepSpeed takes the JSON and the steps run with a finite loss."""
    config = Config(micro_batch_size=2, grad_accum_steps=2, zero_stage=stage, overlap_comm=True, bucket_scale=4)
    facts = replace(FACTS, hidden_size=128)  # the bucket sizes come from the hidden size alone
    result = run_probe(probe_spec(entry("tiny"), config, CPU, world_size=2, steps=2, facts=facts), timeout_s=START_S)
    assert result.status == "ok", result.message
    assert result.step_time_s > 0
