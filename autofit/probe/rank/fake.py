"""Fake-mode probe: the real model code at full size on fake tensors, memory only.

No weight, activation or state is allocated. The model runs one forward and
backward at exactly the config's micro-batch, precision, attention and
checkpoint ratio under ``FakeTensorMode`` (:func:`autofit.trace.trace_config`,
which counts every storage from creation to death); DeepSpeed cannot run on fake
tensors, so what it holds -- working weights, the fp32 master copy, optimizer
states, gradient partitions and buckets, sharded over ``world_size`` ranks -- is
added by the same state model the cost model uses
(:func:`autofit.cost_model.memory.predict_memory`). One source of truth: a fake
probe is the cost model without interpolation, on the exact config.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from autofit.cost_model import Coefficients
from autofit.cost_model.memory import predict_memory
from autofit.probe.records import ProbeSpec, RankResult
from autofit.trace import trace_config
from autofit.workload.entry import load_workload


def run_fake(spec: ProbeSpec, rank: int, phases: dict[str, float]) -> RankResult:
    """Simulate one rank of ``spec``'s config on ``world_size`` ranks; returns the worker's result."""
    t0 = time.time()

    config, hardware, n_ranks = spec.config, spec.hardware, spec.world_size
    workload = load_workload(spec.entry)
    phases["imports_s"] = time.time() - t0

    t0 = time.time()
    facts = trace_config(workload, config)
    phases["steps_s"] = time.time() - t0
    breakdown = predict_memory(config, facts, hardware, n_ranks, Coefficients.for_hardware(hardware))
    return RankResult(
        rank=rank,
        status="ok",
        peak_bytes=breakdown.total,
        per_rank_peak_bytes=[breakdown.total] * n_ranks,  # data-parallel ranks are symmetric
        breakdown=asdict(breakdown),
        n_params=facts.n_params,
        tokens_per_sample=workload.tokens_per_sample,
        phases_s=phases,
        message=f"fake mode: memory only, traced on {facts.trace_mode} tensors in {phases['steps_s']:.1f} s",
    )
