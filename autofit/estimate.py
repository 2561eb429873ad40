"""``autofit estimate``: trace the model once, price every candidate of the space, rank them.

No training step runs: the model is traced on fake tensors (:mod:`autofit.trace`)
and each candidate is priced by the pure cost model (:mod:`autofit.cost_model`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autofit.config import Config
from autofit.cost_model import Coefficients, ModelFacts, Prediction, predict
from autofit.emit import deepspeed_config
from autofit.hardware import Hardware
from autofit.space import SearchSpace, enumerate_candidates
from autofit.workload import Workload


@dataclass(frozen=True)
class Candidate:
    """One config with its prediction and the exact DeepSpeed JSON it would run with."""

    config: Config
    prediction: Prediction
    deepspeed: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "predicted": self.prediction.to_dict(),
            "fits": self.prediction.fits,
            "reason": self.prediction.reason,
            "deepspeed": self.deepspeed,
        }


@dataclass(frozen=True)
class EstimateResult:
    """Every candidate of the space, fitting ones first, each group fastest first."""

    hardware: Hardware
    world_size: int
    candidates: list[Candidate]
    rejected: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    facts: ModelFacts | None = None

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.prediction.fits]

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware.to_dict() | {"world_size": self.world_size},
            "candidates": [c.to_dict() for c in self.candidates],
            "rejected": [{"config": partial, "reason": reason} for partial, reason in self.rejected],
        }


def traces_needed(configs: list[Config]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The precisions and attention kernels the candidates use (each traced once)."""
    precisions = tuple(sorted({c.precision for c in configs}))
    attentions = tuple(sorted({c.attention for c in configs}))
    return precisions, attentions


def facts_for(workload: Workload, configs: list[Config]) -> ModelFacts:
    from autofit.trace import trace_workload

    precisions, attentions = traces_needed(configs)
    ratios = tuple(sorted({c.checkpoint_ratio for c in configs}))
    return trace_workload(workload, precisions=precisions, attentions=attentions, checkpoint_ratios=ratios)


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fitting first, then by predicted step time (the global batch is the same for all)."""
    return sorted(candidates, key=lambda c: (not c.prediction.fits, c.prediction.step_time_s, c.prediction.peak_bytes))


def price(
    configs: list[Config],
    facts: ModelFacts,
    hardware: Hardware,
    world_size: int,
    coefficients: Coefficients | None = None,
) -> list[Candidate]:
    """Predict each config and attach its DeepSpeed JSON; ranked."""
    coefficients = coefficients or Coefficients.for_hardware(hardware)
    return rank(
        [
            Candidate(
                config=config,
                prediction=predict(config, facts, hardware, world_size, coefficients),
                deepspeed=deepspeed_config(config, world_size, hardware.kind),
            )
            for config in configs
        ]
    )


def estimate(
    workload: Workload,
    hardware: Hardware,
    space: SearchSpace,
    *,
    world_size: int = 1,
    global_batch: int | None = None,
    fixed: dict[str, Any] | None = None,
    coefficients: Coefficients | None = None,
    facts: ModelFacts | None = None,
) -> EstimateResult:
    """Enumerate the space's candidates, trace the model once, and price them all."""
    enumeration = enumerate_candidates(
        space,
        hardware=hardware,
        world_size=world_size,
        global_batch=global_batch,
        fixed=fixed or {},
        searches_attention=workload.searches_attention,
    )
    facts = facts or facts_for(workload, enumeration.candidates)
    candidates = price(enumeration.candidates, facts, hardware, world_size, coefficients)
    return EstimateResult(
        hardware=hardware,
        world_size=world_size,
        candidates=candidates,
        rejected=list(enumeration.rejected),
        facts=facts,
    )
