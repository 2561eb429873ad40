"""The analytic cost model: predicted peak memory and step time of a config. Pure, no torch.

``predict(config, facts, hardware, world_size, coefficients)`` composes the
traced facts of the model (:mod:`autofit.cost_model.facts`) with the memory
formulas (:mod:`autofit.cost_model.memory`) and the time formulas
(:mod:`autofit.cost_model.time`). Coefficients are what probes calibrate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.core.units import format_bytes
from autofit.cost_model.coefficients import Coefficients
from autofit.cost_model.facts import ActivationProfile, ModelFacts, PeakPoint
from autofit.cost_model.host import host_peak_bytes
from autofit.cost_model.memory import MemoryBreakdown, bounded_memory
from autofit.cost_model.prediction import PredictionRecord
from autofit.cost_model.tensor_parallel import as_rank, tensor_parallel_s
from autofit.cost_model.time import predict_step_time

__all__ = [
    "ActivationProfile",
    "Coefficients",
    "MemoryBreakdown",
    "ModelFacts",
    "PeakPoint",
    "Prediction",
    "PredictionRecord",
    "predict",
]


@dataclass(frozen=True)
class Prediction:
    """What the cost model says of one config on one device."""

    peak_bytes: int
    """Most memory the training process holds on one device, construction through steps."""
    breakdown: MemoryBreakdown
    """``peak_bytes`` split into params, grads, optimizer, activations and other."""
    step_time_s: float
    """One optimizer step (all micro-batches of the accumulation)."""
    samples_per_s: float
    """Global samples per second over all data-parallel ranks."""
    tokens_per_s: float | None
    """``samples_per_s x tokens_per_sample`` for token workloads."""
    fits: bool
    """Whether ``peak_bytes`` is within the ``hardware`` memory :func:`predict` was given (the usable budget,
    :mod:`autofit.cost_model.budget`) and ``host_peak_bytes`` within the node's host memory."""
    reason: str | None = None
    """Why it does not fit (None when it does)."""
    time_breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per step by cause: compute, recompute, communication, offload, overhead."""
    host_peak_bytes: int = 0
    """Most host (CPU RAM) bytes one node needs: its ranks' processes, builds and offloaded states
    (:mod:`autofit.cost_model.host`)."""
    peak_is_lower_bound: bool = False
    """``peak_bytes`` is only a lower bound: the caching allocator's reserve was not replayed, for a GPU config already
    past :func:`predict`'s ``exact_within_bytes`` before it (it does not fit, and says so in ``reason``), or for every
    GPU config with ``lower_bound_only`` (a screen: ``fits`` is then optimistic)."""

    def record(self) -> PredictionRecord:
        """What travels of it (JSON, a study, a probe's result): memory and time, not the verdict."""
        return PredictionRecord(
            peak_bytes=self.peak_bytes,
            host_peak_bytes=self.host_peak_bytes,
            breakdown=self.breakdown,
            step_time_s=self.step_time_s,
            samples_per_s=self.samples_per_s,
            tokens_per_s=self.tokens_per_s,
            time_breakdown=self.time_breakdown,
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``predicted`` JSON of docs/design.md ("JSON output"): :meth:`PredictionRecord.to_json`."""
        return self.record().to_json()


def predict(
    config: Config,
    facts: ModelFacts,
    hardware: Hardware,
    world_size: int = 1,
    coefficients: Coefficients | None = None,
    *,
    exact_within_bytes: int | None = None,
    reserve_representatives: Mapping[tuple[object, ...], Config] | None = None,
    lower_bound_only: bool = False,
) -> Prediction:
    """Price ``config`` for ``facts`` on ``world_size`` ranks of ``hardware``, judging whether it fits by
    ``hardware.memory_bytes``: a plan gives it the device with its usable budget
    (:func:`autofit.cost_model.budget.usable_hardware`, through :meth:`autofit.planning.plan.Plan.predict`).
    ``exact_within_bytes``: past it, a GPU peak may be a lower bound (:func:`autofit.cost_model.memory.bounded_memory`;
    None: every peak exact); it must be at least ``hardware.memory_bytes``, so that what fits is judged the same;
    ``reserve_representatives``: the configs whose replay stands for each reserve key
    (:func:`autofit.cost_model.allocation_sequence.reserve_bytes`). ``lower_bound_only``: no GPU config's allocator
    is replayed; each peak is the lower bound before the reserve and its ``fits`` optimistic, a screen whose survivors
    are priced again exactly (the time does not depend on it: :mod:`autofit.planning.longest`).

    A config with AutoTP (``tensor_parallel`` > 1) is priced as one of its ranks, from the rank's traced facts on the
    data-parallel ranks, plus the TP group's collectives (:mod:`autofit.cost_model.tensor_parallel`)."""
    coefficients = coefficients or Coefficients.for_hardware(hardware)
    rank_config, rank_facts, rank_hardware, data_parallel = as_rank(config, facts, hardware, world_size)
    exact_within = 0 if lower_bound_only else None if exact_within_bytes is None \
        else max(exact_within_bytes, hardware.memory_bytes)
    memory, lower_bound = bounded_memory(rank_config, rank_facts, rank_hardware, data_parallel, coefficients,
                                         exact_within, reserve_representatives)
    peak = memory.total
    time_parts = predict_step_time(rank_config, rank_facts, rank_hardware, data_parallel, coefficients)
    if config.tensor_parallel > 1:
        time_parts["tensor_parallel"] = tensor_parallel_s(config, rank_facts, hardware, coefficients.collective_latency_s,
                                                          coefficients.comm_efficiency)
    step_time_s = sum(time_parts.values())
    samples = config.samples_per_step(world_size)
    samples_per_s = samples / step_time_s if step_time_s > 0 else 0.0
    tokens_per_s = samples_per_s * facts.tokens_per_sample if facts.tokens_per_sample else None
    host_peak = host_peak_bytes(rank_config, facts, hardware, world_size, peak)
    reason = _not_fit_reason(peak, hardware, memory, lower_bound) if peak > hardware.memory_bytes else None
    if reason is None and hardware.host_memory_bytes and host_peak > hardware.host_memory_bytes:
        reason = _host_reason(host_peak, hardware, world_size)
    if config.optimizer == "adam_mini" and facts.adam_mini_error:
        reason = f"adam-mini cannot step on this model ({facts.adam_mini_error})"
    fits = reason is None
    return Prediction(
        peak_bytes=peak,
        breakdown=memory,
        step_time_s=step_time_s,
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
        fits=fits,
        reason=reason,
        time_breakdown=time_parts,
        host_peak_bytes=host_peak,
        peak_is_lower_bound=lower_bound,
    )


def _not_fit_reason(peak: int, hardware: Hardware, memory: MemoryBreakdown, lower_bound: bool) -> str:

    parts = memory.to_dict()
    biggest = max(parts, key=lambda k: parts[k])
    need = f"more than {format_bytes(peak)} (before the caching allocator's reserve)" if lower_bound \
        else format_bytes(peak)
    return (
        f"needs {need} but {format_bytes(hardware.memory_bytes)} is usable on {hardware.name} "
        f"(largest part: {biggest} {format_bytes(parts[biggest])})"
    )


def _host_reason(host_peak: int, hardware: Hardware, world_size: int) -> str:

    ranks = hardware.ranks_on_a_node(world_size)
    return (
        f"host memory: {ranks} rank(s) per node need {format_bytes(host_peak)} of host RAM "
        f"but a node has {format_bytes(hardware.host_memory_bytes)}"
    )
