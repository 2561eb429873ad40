"""CUDA's runtime memory (context, NCCL's buffers, cuBLAS's workspace) as an additive term, priced then learned."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autofit.core.config import Config
from autofit.core.hardware import PRESETS
from autofit.cost_model import Coefficients, predict
from autofit.cost_model.allocation_sequence import reserve_bytes
from autofit.cost_model.calibrate import Observation, calibrate
from autofit.cost_model.cuda_runtime import (
    cublas_workspace_bytes,
    measured_outside_allocator_bytes,
    nccl_buffer_bytes,
    priced_outside_allocator_bytes,
    runtime_bytes,
)
from tests.toy_facts import CPU, FACTS, PRIOR

H100 = replace(PRESETS["h100-80gb"], devices_per_node=8)
MIB = 2**20
GIB = 2**30
SMALL = Config(precision="bf16", micro_batch_size=1, grad_accum_steps=8, zero_stage=1)
LARGE = replace(SMALL, micro_batch_size=4, grad_accum_steps=2)


@pytest.mark.slow
def test_the_prior_prices_nccl_by_world_size_and_cublas_by_architecture() -> None:
    one, eight = predict(SMALL, FACTS, H100, 1), predict(SMALL, FACTS, H100, 8)
    assert nccl_buffer_bytes(1) == 0 < nccl_buffer_bytes(8)
    # ZeRO-1's states shrink with the world; the runtime term grows by NCCL's buffers (beside the allocator's reserve,
    # which the world changes too: the replay of each one's requests)
    runtime_one = one.breakdown.other - reserve_bytes(SMALL, FACTS, 1)
    runtime_eight = eight.breakdown.other - reserve_bytes(SMALL, FACTS, 8)
    assert runtime_eight - runtime_one == nccl_buffer_bytes(8)
    assert one.breakdown.other >= H100.context_bytes + cublas_workspace_bytes(H100)
    assert cublas_workspace_bytes(H100) == 32 * MIB > cublas_workspace_bytes(PRESETS["a100-80gb"])


def test_cublas_workspace_follows_the_compute_capability_not_the_name() -> None:
    """A device torch detected and no preset matched keeps its raw name (an H100 NVL's 94 GB is no preset's
    memory): it is Hopper by its capability, as torch's parseChosenWorkspaceSize decides."""
    import json
    from dataclasses import asdict

    from autofit.core.hardware import Hardware, unmatched_cuda_device

    nvl = unmatched_cuda_device("NVIDIA H100 NVL", 94 * GIB, (9, 0))
    assert nvl.name == "NVIDIA H100 NVL" and cublas_workspace_bytes(nvl) == 32 * MIB
    ada = unmatched_cuda_device("NVIDIA RTX 6000 Ada Generation", 48 * GIB, (8, 9))
    assert cublas_workspace_bytes(ada) == cublas_workspace_bytes(PRESETS["a100-80gb"]) < 32 * MIB
    # a probe's spec carries the hardware as JSON, where the capability becomes a list
    assert cublas_workspace_bytes(Hardware(**json.loads(json.dumps(asdict(nvl))))) == 32 * MIB
    assert {PRESETS[k].compute_capability for k in ("h100-80gb", "h100-pcie-80gb", "h200")} == {(9, 0)}


def _observed(config: Config, peak: int, outside: int | None, hardware=H100, world_size: int = 8) -> Observation:
    step = predict(config, FACTS, hardware, world_size).step_time_s
    return Observation(config, "ok", peak, step, hardware.memory_bytes, outside_allocator_bytes=outside)


@pytest.mark.slow
def test_the_first_probe_teaches_the_offset_and_later_predictions_add_it() -> None:
    prior = Coefficients.for_hardware(H100)
    learned = 3 * GIB  # NCCL with NVLS, lazy kernels: more than the prior priced
    taught = prior.with_(outside_allocator_bytes=learned)
    probe_peak = predict(SMALL, FACTS, H100, 8, taught).peak_bytes  # tensors as priced, the rest outside
    calibration = calibrate([_observed(SMALL, probe_peak, learned)], FACTS, H100, 8, prior)
    assert calibration.coefficients.outside_allocator_bytes == learned
    # the probe's peak is the tensors plus the learned offset: nothing is left for a ratio to correct
    assert abs(calibration.memory.global_scale - 1.0) < 1e-6
    raised = learned - priced_outside_allocator_bytes(H100, 8)
    for config in (SMALL, LARGE):  # the same bytes added to a small config and a large one: an offset
        before = predict(config, FACTS, H100, 8, prior).peak_bytes
        after = calibration.predict(config, FACTS, H100, 8).peak_bytes
        assert after - before == raised


@pytest.mark.slow
def test_a_ratio_no_longer_absorbs_the_offset() -> None:
    """With the runtime as an offset the ratio is fitted to the rest: a probe 10 % over on its tensors scales a
    larger config's tensors by 10 %, not the whole peak by the small probe's offset-inflated ratio."""
    prior = Coefficients.for_hardware(H100)
    fixed_free = predict(SMALL, FACTS, H100, 8, prior)
    runtime = runtime_bytes(H100, 8, None)  # the offset (the allocator's reserve within ``other`` is no offset)
    over = int(runtime + 1.10 * (fixed_free.peak_bytes - runtime))
    calibration = calibrate([_observed(SMALL, over, None)], FACTS, H100, 8, prior)
    assert abs(calibration.memory.global_scale - 1.10) < 1e-3
    large = predict(LARGE, FACTS, H100, 8, prior)
    corrected = calibration.predict(LARGE, FACTS, H100, 8)
    expected = runtime + 1.10 * (large.peak_bytes - runtime)
    assert abs(corrected.peak_bytes - expected) / expected < 1e-3


def test_the_cpu_path_learns_no_offset() -> None:
    config = Config(precision="fp32", micro_batch_size=2, grad_accum_steps=8)
    peak = predict(config, FACTS, CPU, 1, PRIOR).peak_bytes
    observed = _observed(config, int(1.2 * peak), 5 * GIB, hardware=CPU, world_size=1)
    calibration = calibrate([observed], FACTS, CPU, 1, PRIOR)
    assert calibration.coefficients.outside_allocator_bytes is None
    assert abs(calibration.memory.global_scale - 1.2) < 1e-3  # the whole peak's ratio, as before
    assert predict(config, FACTS, CPU, 1, PRIOR) == predict(config, FACTS, CPU, 1, PRIOR.with_(outside_allocator_bytes=GIB))


def test_a_probes_outside_bytes_are_nvmls_peak_less_the_allocators() -> None:
    device_memory = {"nvml_peak_bytes": 9 * GIB, "max_memory_reserved_bytes": 7 * GIB, "context_bytes": 500 * MIB}
    assert measured_outside_allocator_bytes(device_memory) == 2 * GIB
    assert measured_outside_allocator_bytes({"nvml_peak_bytes": None, "max_memory_reserved_bytes": GIB}) is None
    assert measured_outside_allocator_bytes({}) is None  # the CPU


def test_a_search_record_hands_calibration_the_offset() -> None:
    from autofit.probe.result import ProbeResult
    from autofit.tuner.records import TrialRecord

    measured = ProbeResult(config=SMALL, status="ok", peak_bytes=9 * GIB, step_time_s=1.0, samples_per_s=8.0,
                           tokens_per_s=None, message=None, overhead_s=1.0,
                           device_memory={"nvml_peak_bytes": 9 * GIB, "max_memory_reserved_bytes": 8 * GIB})
    record = TrialRecord(number=0, config=SMALL, phase="search", status="ok", measured=measured, predicted=None)
    assert record.observation(80 * GIB).outside_allocator_bytes == GIB


def test_the_probes_allocator_cap_leaves_room_for_nccl() -> None:
    """--memory caps the allocator at the budget less the context measured before NCCL starts and less what
    NCCL will add (the spec carries it to the worker's Meter)."""
    from autofit.probe.spec import probe_spec

    spec = probe_spec("examples/mlp.py:workload", SMALL, H100, 8, steps=1, warmup_steps=0)
    assert spec.nccl_bytes == nccl_buffer_bytes(8)
    assert probe_spec("examples/mlp.py:workload", SMALL, CPU, 2, steps=1, warmup_steps=0).nccl_bytes == 0
