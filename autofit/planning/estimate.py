"""``autofit estimate``: trace the model once, price every candidate of the space, rank them.

No training step runs: the :class:`~autofit.planning.plan.Plan` traced the model on fake tensors
(:mod:`autofit.trace`) and each candidate is priced by the pure cost model (:mod:`autofit.cost_model`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autofit.core.bulk import paused_gc
from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.core.recipe import Recipe
from autofit.core.software import Software
from autofit.cost_model import ModelFacts, Prediction
from autofit.cost_model.budget import DEFAULT_MARGIN, budget_dict, usable_bytes
from autofit.cost_model.uncertainty import cuda_bands
from autofit.planning.plan import Plan
from autofit.trace.source_cache import recorded_entry_lengths


@dataclass(frozen=True)
class Candidate:
    """One config with its prediction and, where it is predicted to fit, the exact DeepSpeed JSON it would run with."""

    config: Config
    prediction: Prediction
    deepspeed: dict[str, Any] | None
    """None where the candidate does not fit: a config that would not run gets no JSON to run it with (most of a large
    plan's candidates; docs/results/planning.md); ``--set`` its keys to see its JSON."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "predicted": self.prediction.to_dict(),
            "fits": self.prediction.fits,
            "reason": self.prediction.reason,
            "deepspeed": self.deepspeed,
        }


@dataclass(frozen=True)
class ModelSummary:
    """What was planned, said first (as accelerate's ``estimate-memory`` leads with the parameter count): the model,
    its parameters as traced (each shared tensor once, as ``sum(p.numel() for p in model.parameters())`` counts
    them), and what the plan says of its sequence (:func:`autofit.workload.hf.entry_lengths`, kept for a warm plan)."""

    name: str
    """The workload's name."""
    n_params: int
    """Every parameter."""
    n_trainable_params: int
    """Those with ``requires_grad``: what the gradients and optimizer states cover."""
    notes: tuple[str, ...] = ()
    """Sentences about the planned sequence: a length taken from the config, one past its position limit."""
    warnings: tuple[str, ...] = ()
    """The notes the command also says on stderr (a length past the position limit)."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "n_params": self.n_params, "n_trainable_params": self.n_trainable_params,
                "notes": list(self.notes)}


def model_summary(plan: Plan) -> ModelSummary:
    """:class:`ModelSummary` of ``plan``: its traced counts, and an ``hf:`` entry's notes from its config."""
    lengths = recorded_entry_lengths(plan.entry)
    return ModelSummary(name=plan.name, n_params=plan.facts.n_params, n_trainable_params=plan.facts.n_trainable_params,
                        notes=lengths.notes if lengths else (), warnings=lengths.warnings if lengths else ())


@dataclass(frozen=True)
class EstimateResult:
    """Every candidate of the space, fitting ones first, each group fastest first."""

    hardware: Hardware
    """The device, with its memory budget (``--memory``)."""
    world_size: int
    candidates: list[Candidate]
    rejected: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    margin: float = DEFAULT_MARGIN
    """The safety margin every candidate's ``fits`` was judged with: predicted within :attr:`usable_bytes`."""
    facts: ModelFacts | None = None
    recipe: Recipe | None = None
    """The user's recipe the candidates were narrowed to (what each JSON's ``differs_from_recipe`` compares with)."""
    software: Software | None = None
    """What the rules assumed of the target's software (docs/design.md, "The target's software")."""
    kernels: tuple[str, ...] | None = None
    """The attention kernels planned (:attr:`autofit.planning.plan.Plan.kernels`); (): the model has no kernel
    dimension, and its candidates' JSON has no ``attention`` key."""
    kernel_note: str | None = None
    """Why the kernels are fewer than every kernel, where they are."""
    model: ModelSummary | None = None
    """The model planned: its name, parameter count and the notes on its sequence."""

    @property
    def usable_bytes(self) -> int:
        """``(1 - margin) x`` the device memory: what a fitting candidate is predicted within
        (:mod:`autofit.cost_model.budget`)."""
        return usable_bytes(self.hardware.memory_bytes, self.margin)

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.prediction.fits]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict() if self.model is not None else None,
            "hardware": self.hardware.to_dict() | {"world_size": self.world_size},
            # what "fits" was judged against: peak_bytes <= usable_bytes = (1 - margin) x memory_bytes
            "budget": budget_dict(self.hardware.memory_bytes, self.margin),
            # how sure an unprobed plan is on a GPU: the prior's error on every GPU row so far (cost_model/uncertainty.py)
            "expected_error": cuda_bands() if self.hardware.kind == "cuda" else None,
            "candidates": [_without_kernel(c.to_dict()) if self.kernels == () else c.to_dict() for c in self.candidates],
            "rejected": [{"config": partial, "reason": reason} for partial, reason in self.rejected],
            # how a kernel was traced where not as itself: {"flash": "flash-attn" | "sdpa flash backend"}
            "attention_traces": dict(self.facts.attention_traces) if self.facts is not None else {},
            "recipe": self.recipe.to_dict() if self.recipe is not None else None,
            "software": self.software.to_dict() if self.software is not None else None,
            # the kernel dimension: the kernels the model can be built with, and why where they are not all
            "attention": {"kernels": list(self.kernels) if self.kernels is not None else None,
                          "note": self.kernel_note},
        }


def _without_kernel(candidate: dict[str, Any]) -> dict[str, Any]:
    """A candidate's JSON without the ``attention`` key, for a model with no kernel to choose (a state-space model;
    its DeepSpeed JSON names none already: :func:`autofit.ds.emit.deepspeed_config`)."""
    candidate["config"].pop("attention", None)
    return candidate


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fitting first, then by predicted step time (the global batch is the same for all)."""
    return sorted(candidates, key=lambda c: (not c.prediction.fits, c.prediction.step_time_s, c.prediction.peak_bytes))


def estimate(plan: Plan) -> EstimateResult:
    """Price every candidate of ``plan`` with its prior coefficients, attach each fitting one's DeepSpeed JSON (with
    the plan's recipe: its hyperparameters, and what the candidate changes of it); ranked. Each ``fits`` is the plan's
    judgement (:meth:`autofit.planning.plan.Plan.predict`: within ``(1 - margin) x`` the device memory)."""
    recipe = plan.stated_recipe
    with paused_gc():  # thousands of candidates, none in a cycle (autofit/core/bulk.py)
        candidates = [
            Candidate(config=config, prediction=prediction,
                      deepspeed=plan.deepspeed(config) if prediction.fits else None)
            for config, prediction in plan.price()
        ]
    return EstimateResult(
        hardware=plan.hardware,
        world_size=plan.world_size,
        candidates=rank(candidates),
        rejected=list(plan.rejected),
        facts=plan.facts,
        recipe=recipe,
        software=plan.software,
        kernels=plan.kernels,
        kernel_note=plan.kernel_note,
        margin=plan.margin,
        model=model_summary(plan),
    )
