"""Communication time by topology (autofit.cost_model.comm): NCCL's bus bandwidth, the ZeRO paper's
volumes per stage, hierarchical collectives across nodes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from toy_facts import FACTS

from autofit.core.config import Config
from autofit.cost_model import predict
from autofit.cost_model.comm import collective_seconds, collective_volumes
from autofit.machine.device import get_hardware

H100 = get_hardware("h100-80gb")
GB = 1e9


@pytest.mark.parametrize("n_ranks", [2, 4, 8])
def test_one_node_runs_at_nccls_bus_bandwidth(n_ranks: int) -> None:
    """nccl-tests: algBw = S / t and busBw = algBw x (n - 1) / n for reduce-scatter and all-gather;
    on one node busBw is the intra-node link speed."""
    hardware = replace(H100, devices_per_node=8)
    t = collective_seconds(GB, hardware, n_ranks)
    assert GB / t * (n_ranks - 1) / n_ranks == pytest.approx(H100.intra_node_bytes_per_s)


def test_zero3_moves_one_and_a_half_times_data_parallels_volume() -> None:
    """ZeRO paper sec. 7.2: 2 Psi for DP and ZeRO-1/2 at one micro-batch, 3 Psi for ZeRO-3."""
    assert [collective_volumes(Config(zero_stage=s)) for s in (0, 1, 2, 3)] == [2.0, 2.0, 2.0, 3.0]
    assert collective_volumes(Config(zero_stage=3, grad_accum_steps=4)) == 12.0
    assert collective_volumes(Config(zero_stage=2, grad_accum_steps=4)) == 5.0


def test_crossing_nodes_is_slower_and_the_network_sets_the_pace() -> None:
    one_node = replace(H100, devices_per_node=8)
    two_nodes = replace(H100, devices_per_node=4)
    assert collective_seconds(GB, two_nodes, 8) > collective_seconds(GB, one_node, 8)
    # 64 ranks on 8 nodes: each rank's eighth of the data crosses the network at 50 GB/s, the rest NVLink
    eight_nodes = replace(H100, devices_per_node=8)
    network_only = replace(eight_nodes, intra_node_bytes_per_s=0.0)
    nvlink_only = replace(eight_nodes, inter_node_bytes_per_s=0.0)
    total = collective_seconds(GB, eight_nodes, 64)
    assert total == pytest.approx(collective_seconds(GB, network_only, 64) + collective_seconds(GB, nvlink_only, 64))
    assert collective_seconds(GB, network_only, 64) > collective_seconds(GB, nvlink_only, 64)


@pytest.mark.slow
def test_a_prediction_prices_the_network_when_the_job_spans_nodes() -> None:
    config = Config(precision="bf16", zero_stage=3)
    within = predict(config, FACTS, replace(H100, devices_per_node=16), world_size=16)
    across = predict(config, FACTS, replace(H100, devices_per_node=8), world_size=16)
    assert across.time_breakdown["communication"] > within.time_breakdown["communication"]
    assert across.time_breakdown["compute"] == within.time_breakdown["compute"]
