"""How sure an unprobed GPU plan is (autofit/cost_model/uncertainty.py): the bands are the committed GPU rows' own,
and the margin they name keeps the worst row's measured peak within the device."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from autofit.cost_model.budget import usable_bytes
from autofit.cost_model.uncertainty import CUDA_PEAK, CUDA_THROUGHPUT, margin_holding
from autofit.planning.estimate import estimate
from autofit.planning.target import Target, prepare

ROOT = Path(__file__).resolve().parents[2]


def test_the_bands_hold_every_committed_gpu_row() -> None:
    """benchmarks/gpu/gpu_truth.py's committed summary: each band covers its range (rounded outwards), over as many rows."""
    summary = json.loads((ROOT / CUDA_PEAK.source).read_text())["summary"]
    low, high = summary["memory_error_range"]
    assert CUDA_PEAK.rows == summary["rows"]
    assert CUDA_PEAK.low <= low and math.isclose(CUDA_PEAK.low, low, abs_tol=0.001)
    assert CUDA_PEAK.high >= high and math.isclose(CUDA_PEAK.high, high, abs_tol=0.001)
    low, high = summary["throughput_error_range"]
    assert CUDA_THROUGHPUT.rows == summary["steady_rows"]
    assert CUDA_THROUGHPUT.low <= low and math.isclose(CUDA_THROUGHPUT.low, low, abs_tol=0.001)
    assert CUDA_THROUGHPUT.high >= high and math.isclose(CUDA_THROUGHPUT.high, high, abs_tol=0.001)


def test_the_margin_it_names_keeps_the_worst_rows_peak_within_the_device() -> None:
    memory = 80 * 2**30
    predicted = usable_bytes(memory, margin_holding(CUDA_PEAK))  # a config that just fits under that margin
    measured_at_worst = predicted / (1 + CUDA_PEAK.low)  # error = (predicted - measured) / measured = low
    assert measured_at_worst <= memory
    assert predicted / (1 + CUDA_PEAK.low) > usable_bytes(memory, 0.10)  # the default 10% would not have held it


@pytest.mark.slow
def test_an_unprobed_gpu_plan_states_its_band_and_a_cpu_plan_none() -> None:
    def planned(hardware: str) -> dict:
        target = Target(entry=f"{ROOT}/examples/mlp.py:workload", hardware=hardware, gpus=1, global_batch=8,
                        set_values=("zero_stage=0", "micro_batch_size=8"))
        return estimate(prepare(target).plan()).to_dict()

    gpu = planned("h100-80gb")["expected_error"]
    assert gpu["peak_bytes"]["low"] == CUDA_PEAK.low and gpu["margin_holding_worst_peak"] == margin_holding(CUDA_PEAK)
    assert planned("cpu")["expected_error"] is None
