"""Step time with overlap: communication hidden behind compute where DeepSpeed overlaps it, exposed where it
cannot (the first gather, the last reduce bucket, the all-gather after the step, a link slower than compute).

A toy topology: the toy model (1 M parameters, 4 layers) on 2 nodes of 4 GPUs; the network's speed sets
whether communication or compute is the longer."""

from __future__ import annotations

from dataclasses import replace

import pytest
from toy_facts import CPU, FACTS

from autofit.core.config import Config
from autofit.cost_model import Coefficients, predict
from autofit.cost_model.comm import communication_phases
from autofit.cost_model.states import buckets_of
from autofit.cost_model.time import first_gather_share, micro_batch_compute_s
from autofit.machine.device import get_hardware

WORLD = 8
FACTS_H = replace(FACTS, hidden_size=256)  # reduce buckets of 256^2 = 65,536 elements: 16 of them


def toy_cluster(network_bytes_per_s: float):
    """2 nodes x 4 GPUs of 1 TFLOP/s (a toy step of tens of milliseconds) whose network runs at
    ``network_bytes_per_s`` per GPU, their NVLink 8 times faster."""
    return replace(get_hardware("h100-80gb"), devices_per_node=4, inter_node_bytes_per_s=network_bytes_per_s,
                   intra_node_bytes_per_s=network_bytes_per_s * 8, peak_flops={"fp32": 1e12, "bf16": 1e12})


def comm(config: Config, hardware, coefficients: Coefficients | None = None) -> float:
    return predict(config, FACTS_H, hardware, WORLD, coefficients).time_breakdown["communication"]


def phases(config: Config, hardware, coefficients: Coefficients):
    return communication_phases(config, FACTS_H, hardware, WORLD, coefficients.comm_efficiency,
                                buckets_of(config, FACTS_H).reduce_bucket_size, coefficients.collective_latency_s)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlap_comm_on_is_faster_than_off(stage):
    hardware = toy_cluster(100e6)  # communication about as long as backward
    off = predict(Config(precision="bf16", zero_stage=stage, micro_batch_size=4), FACTS_H, hardware, WORLD)
    on = predict(Config(precision="bf16", zero_stage=stage, micro_batch_size=4, overlap_comm=True), FACTS_H, hardware,
                 WORLD)
    assert on.step_time_s < off.step_time_s
    assert on.time_breakdown["compute"] == off.time_breakdown["compute"]


@pytest.mark.parametrize("stage", [2, 3])
def test_compute_much_longer_than_comm_hides_all_but_the_pieces_nothing_runs_beside(stage):
    hardware = toy_cluster(400e9)  # a fast network: communication is a sliver of the 4-sample step's compute
    coefficients = Coefficients.for_hardware(hardware)
    config = Config(precision="bf16", zero_stage=stage, micro_batch_size=4, overlap_comm=True)
    p = phases(config, hardware, coefficients)
    assert micro_batch_compute_s(config, FACTS_H, hardware, coefficients) > 10 * p.total(1)
    unavoidable = p.tail + p.after_step + first_gather_share(FACTS_H) * (p.forward_gather + p.backward_gather)
    assert comm(config, hardware) == pytest.approx(unavoidable)
    assert comm(config, hardware) < 0.3 * p.total(1)


def test_zero3_prefetch_hides_gathers_even_without_overlap_comm():
    hardware = toy_cluster(400e9)
    coefficients = Coefficients.for_hardware(hardware)
    config = Config(precision="bf16", zero_stage=3, micro_batch_size=4)
    p = phases(config, hardware, coefficients)
    # the reduce runs on the compute stream (no overlap_comm); the gathers but the first layer's are prefetched
    assert comm(config, hardware) == pytest.approx(
        p.reduce + first_gather_share(FACTS_H) * (p.forward_gather + p.backward_gather))


@pytest.mark.parametrize("stage", [2, 3])
def test_comm_much_longer_than_compute_is_exposed(stage):
    hardware = toy_cluster(2e3)  # a slow link: seconds of communication beside milliseconds of compute
    coefficients = Coefficients.for_hardware(hardware)
    config = Config(precision="bf16", zero_stage=stage, micro_batch_size=1, overlap_comm=True)
    total = phases(config, hardware, coefficients).total(1)
    compute = micro_batch_compute_s(config, FACTS_H, hardware, coefficients)
    assert total > 100 * compute
    exposed = comm(config, hardware)
    assert exposed >= total - compute - 1e-12  # at most the compute beside it hides
    assert predict(config, FACTS_H, hardware, WORLD).step_time_s >= total


def test_no_overlap_efficiency_means_nothing_hides():
    hardware = toy_cluster(2e9)
    serial = Coefficients.for_hardware(hardware).with_(overlap_efficiency=0.0)
    config = Config(precision="bf16", zero_stage=2, micro_batch_size=4, overlap_comm=True)
    assert comm(config, hardware, serial) == pytest.approx(phases(config, hardware, serial).total(1))


def test_a_cpu_device_overlaps_nothing():
    """DeepSpeed's CPU accelerator has no streams: overlap_comm changes no step time there."""
    on = predict(Config(zero_stage=2, overlap_comm=True), FACTS_H, CPU, 2)
    off = predict(Config(zero_stage=2), FACTS_H, CPU, 2)
    assert on.step_time_s == off.step_time_s


def test_larger_buckets_pay_less_latency_but_expose_a_longer_tail():
    hardware = toy_cluster(2e9)
    coefficients = Coefficients.for_hardware(hardware)
    small = phases(Config(precision="bf16", zero_stage=2, overlap_comm=True), hardware, coefficients)
    large = phases(Config(precision="bf16", zero_stage=2, overlap_comm=True, bucket_scale=4), hardware, coefficients)
    assert large.reduce < small.reduce  # 4 bucket calls instead of 16
    assert large.tail > small.tail


def test_calibration_learns_the_overlap_efficiency_from_probes():
    """Probes made by a device whose streams hide half as much as the prior assumes: the fit finds 0.5, and no
    probe that overlapping could change (one rank) leaves the prior as it was."""
    from autofit.cost_model.calibrate import Observation, fit_overlap

    hardware = toy_cluster(100e6)
    prior = Coefficients.for_hardware(hardware)
    truth = prior.with_(overlap_efficiency=0.5)
    configs = [Config(precision="bf16", zero_stage=s, micro_batch_size=m, overlap_comm=o)
               for s in (2, 3) for m in (1, 4) for o in (False, True)]
    observed = []
    for config in configs:
        p = predict(config, FACTS_H, hardware, WORLD, truth)
        observed.append(Observation(config, "ok", p.peak_bytes, p.step_time_s, hardware.memory_bytes))
    assert fit_overlap(observed, FACTS_H, hardware, WORLD, prior).overlap_efficiency == pytest.approx(0.5)
    one_rank = [Observation(c, "ok", 1, predict(c, FACTS_H, hardware, 1, truth).step_time_s, hardware.memory_bytes)
                for c in configs]
    assert fit_overlap(one_rank, FACTS_H, hardware, 1, prior) == prior
