"""What a search records: one :class:`TrialRecord` per probe, one :class:`SearchResult` at the end.

Plain data with derived values as methods; the report, the CLI and the benchmarks read these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from autofit.core.boundary import Status
from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.core.recipe import Recipe, differences
from autofit.core.software import Software
from autofit.core.units import format_bytes
from autofit.cost_model import ModelFacts, Prediction
from autofit.cost_model.calibrate import Calibration, Observation
from autofit.cost_model.cuda_runtime import measured_outside_allocator_bytes
from autofit.cost_model.prediction import PredictionRecord
from autofit.probe.result import ProbeResult

Phase = Literal["search", "repeat", "verify"]
"""``search``: a probe the policy chose; ``repeat``: that probe again, when its throughput was an outlier;
``verify``: a leader probed again before it may win."""


@dataclass
class TrialRecord:
    """One probe of the search, as the study stores it."""

    number: int
    """Optuna trial number."""
    config: Config
    """What ran."""
    phase: Phase
    """``search`` or ``verify``."""
    status: Status
    """``ok``, ``oom``, ``timeout`` or ``error``."""
    measured: ProbeResult
    """What the probe measured (stored as ``autofit probe``'s JSON, :meth:`ProbeResult.to_json`)."""
    predicted: PredictionRecord | None
    """The calibrated prediction the search held when it chose this probe (None: none; ``{}`` in its JSON)."""
    within_margin: bool = False
    """ok and measured peak <= the usable budget."""
    started_s: float = 0.0
    """Seconds since the epoch the probe started."""
    wall_s: float = 0.0
    """Seconds the probe took."""
    resumed: bool = False
    """Read back from an earlier run of the study."""
    planned_steps: int = 0
    """Optimizer steps the probe was to run, warm-up included (what bounds a timeout's step); 0 when unknown."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "config": self.config.to_dict(),
            "phase": self.phase,
            "status": self.status,
            "within_margin": self.within_margin,
            "measured": self.measured.to_json(),
            "predicted": self.predicted.to_json() if self.predicted is not None else {},
            "started_s": self.started_s,
            "wall_s": self.wall_s,
            "resumed": self.resumed,
            "planned_steps": self.planned_steps,
        }

    @property
    def samples_per_s(self) -> float:
        return self.measured.samples_per_s

    @property
    def peak_bytes(self) -> int:
        return self.measured.peak_bytes

    def observation(self, budget_bytes: int, start_up_s: float = 0.0) -> Observation:
        """This probe as calibration sees it (``budget_bytes``: the device memory it ran under). A timeout
        with its ``planned_steps`` known bounds the step: its time less ``start_up_s`` over those steps."""
        planned = self.planned_steps
        bound = max(0.0, self.wall_s - start_up_s) / planned if self.status == "timeout" and planned else 0.0
        return Observation(
            self.config,
            self.status,
            self.peak_bytes,
            self.measured.step_time_s,
            budget_bytes,
            self.measured.optimizer_time_s,
            time_lower_bound_s=bound,
            outside_allocator_bytes=measured_outside_allocator_bytes(self.measured.device_memory),
        )

    def outcome(self) -> str:
        """One line: throughput and peak, or the status and its message."""
        if self.status == "ok":
            note = "" if self.within_margin else " (past the safety margin)"
            return f"{self.samples_per_s:.3g} samples/s, {format_bytes(self.peak_bytes)}{note}"
        message = self.measured.message or ""
        return f"{self.status} {message}"[:120]


def observations(records: list[TrialRecord], budget_bytes: int) -> list[Observation]:
    """The probes calibration learns from (ok and oom; a timeout as a bound on its step, taking the longest
    start-up an ok probe had; an error says nothing of the model).
    Of a search probe and its repeat, only the faster counts: a busy machine slows a probe, never speeds it."""
    start_up = max((r.measured.overhead_s for r in records if r.status == "ok"), default=0.0)
    return [r.observation(budget_bytes, start_up) for r in records
            if r.status in ("ok", "oom", "timeout") and not _superseded(r, records)]


def _superseded(record: TrialRecord, records: list[TrialRecord]) -> bool:
    if record.phase not in ("search", "repeat"):
        return False
    pair = [r for r in records if r.phase in ("search", "repeat") and r.config.key() == record.config.key()]
    return len(pair) > 1 and record is not max(pair, key=lambda r: (r.samples_per_s, r.phase == "repeat"))


def best_measured(records: list[TrialRecord]) -> TrialRecord | None:
    """The fastest single probe that ran within the margin."""
    good = [r for r in records if r.within_margin]
    return max(good, key=lambda r: r.samples_per_s) if good else None


def searched_keys(records: list[TrialRecord]) -> set[str]:
    """Configs a search probe has measured (each is probed by the search once)."""
    return {r.config.key() for r in records if r.phase == "search"}


def mean_samples(records: list[TrialRecord], config: Config) -> float:
    """Mean samples/s over the probes of ``config`` (search and verification) that ran within the margin."""
    runs = [r.samples_per_s for r in records if r.within_margin and r.config.key() == config.key()]
    return sum(runs) / len(runs) if runs else 0.0


def measured_leaders(records: list[TrialRecord]) -> list[Config]:
    """Configs a search probe ran within the margin, by mean measured samples/s, fastest first."""
    configs = {r.config.key(): r.config for r in records if r.phase == "search" and r.within_margin}
    return sorted(configs.values(), key=lambda c: -mean_samples(records, c))


@dataclass
class SearchResult:
    """The winner, every trial and every candidate left unprobed with why."""

    config: Config
    """The verified winner."""
    measured: ProbeResult
    """Its verification probe."""
    predicted: PredictionRecord
    """The final calibrated prediction for it."""
    deepspeed: dict[str, Any]
    """The winner's DeepSpeed JSON, as written to ``out_path``."""
    trials: list[TrialRecord]
    """Every probe, search and verification, in trial order (resumed ones included)."""
    pruned: list[dict[str, Any]]
    """Unprobed candidates: ``{"config", "reason", "kind"}`` with kind ``memory`` (predicted past the
    usable budget), ``dominated`` (predicted slower than the winner) or ``rule`` (a space rule, partial config)."""
    hardware: Hardware
    world_size: int
    global_batch: int | None
    margin: float
    """Safety margin: the winner's measured peak is within ``(1 - margin) x`` the device memory."""
    usable_bytes: int
    """``(1 - margin) x hardware.memory_bytes``."""
    n_candidates: int
    """Candidates of the space after its rules (what "% of the space probed" divides by)."""
    stop_reason: str
    """Why the search stopped probing."""
    storage: str
    study_name: str
    out_path: str | None
    """Where the DeepSpeed JSON was written; None: nowhere (:func:`autofit.search` without ``out``)."""
    wall_s: float
    calibration: Calibration
    predictions: list[tuple[Config, Prediction]] = field(default_factory=list)
    """Every candidate with its final calibrated prediction, fastest first (for the report)."""
    facts: ModelFacts | None = None
    report_path: str | None = None
    """The report's ``index.html`` where one was written (``autofit run --report``); None otherwise."""
    recipe: Recipe | None = None
    """The user's recipe the winner's JSON was written for (the plan's
    :attr:`~autofit.planning.plan.Plan.stated_recipe`); None: a result made by hand."""
    software: Software | None = None
    """What the rules judged by and the JSON was written with (the plan's, failed op builds marked); None: a result
    made by hand."""

    @property
    def n_search_probes(self) -> int:
        return sum(1 for t in self.trials if t.phase == "search")

    @property
    def n_probes(self) -> int:
        return len(self.trials)

    def runner_ups(self, n: int = 5) -> list[TrialRecord]:
        """The best other measured configs within the margin, fastest first (one per config)."""
        seen = {self.config.key()}
        out = []
        for t in sorted(self.trials, key=lambda t: -t.samples_per_s):
            if t.within_margin and t.config.key() not in seen:
                seen.add(t.config.key())
                out.append(t)
        return out[:n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": {"config": self.config.to_dict(), "measured": self.measured.to_json(), "predicted": self.predicted.to_json(),
                     "differs_from_recipe": [d.to_dict() for d in differences(self.recipe, self.config)]
                     if self.recipe is not None else []},
            "model": ({"name": self.facts.name, "n_params": self.facts.n_params,
                       "n_trainable_params": self.facts.n_trainable_params} if self.facts is not None else None),
            "trials": [t.to_dict() for t in self.trials],
            "pruned": self.pruned,
            "search": {
                "hardware": self.hardware.to_dict(),
                "world_size": self.world_size,
                "global_batch": self.global_batch,
                "margin": self.margin,
                "usable_bytes": self.usable_bytes,
                "n_candidates": self.n_candidates,
                "n_probes": self.n_probes,
                "stop_reason": self.stop_reason,
                "storage": self.storage,
                "study_name": self.study_name,
                "out_path": self.out_path,
                "wall_s": self.wall_s,
                "calibration": self.calibration.to_dict(),
            },
        }


def pruned_entries(
    ranked: list[tuple[Config, Prediction]],
    searched: set[str],
    winner: TrialRecord,
    rejected: tuple[tuple[dict[str, Any], str], ...],
    usable_bytes: int,
) -> list[dict[str, Any]]:
    """Every candidate the search did not probe, with why: ``memory``, ``dominated`` or ``rule``."""
    out: list[dict[str, Any]] = []
    for config, prediction in ranked:
        if config.key() in searched:
            continue
        if not prediction.fits:
            out.append({
                "config": config.to_dict(),
                "kind": "memory",
                "reason": f"predicted {format_bytes(prediction.peak_bytes)} > usable {format_bytes(usable_bytes)}",
                "predicted_peak_bytes": prediction.peak_bytes,
            })
        else:
            out.append({
                "config": config.to_dict(),
                "kind": "dominated",
                "reason": (
                    f"predicted {prediction.samples_per_s:.3g} samples/s, not enough to beat the winner's measured "
                    f"{winner.samples_per_s:.3g}"
                ),
                "predicted_samples_per_s": prediction.samples_per_s,
            })
    out.extend({"config": dict(partial), "kind": "rule", "reason": reason} for partial, reason in rejected)
    return out
