"""``autofit run``: probe the candidates the cost model ranks best, calibrate as it goes, verify and emit.

The loop, with Optuna owning the study and its storage (ask/tell, one direction:
maximise measured samples/s):

1. Enumerate the space, trace the model once, price every candidate against the
   *usable* budget, ``(1 - margin) x device memory``: a config predicted past it
   is never probed (it is listed in ``pruned`` with its reason).
2. Each trial asks Optuna for a config. :class:`PlannedSampler` answers with the
   fitting, not yet probed candidate of highest calibrated predicted throughput,
   so the study records every key as a parameter (the dashboard can slice by
   them). The probe (:func:`autofit.probe.run_probe`, a subprocess with its own
   deadline) cannot hang the search; its status goes in the trial's user attrs.
3. Every finished probe recalibrates the cost model
   (:mod:`autofit.cost_model.calibrate`): an ``oom`` raises ``memory_scale`` so
   similar configs get pruned, a slow bf16 makes every bf16 prediction slow.
4. The search stops at ``trials`` probes, at ``timeout_s``, or when no candidate
   left could beat the best measured even if the calibrated model under-predicts
   it by its tolerance: the larger of ``stop_tolerance`` and how far the calibrated
   model still misses the configs it has measured (capped at ``MAX_STOP_TOLERANCE``).
   A model that explains its probes stops early; one that does not keeps probing.
   Before that rule may fire, each optimizer and precision is probed once
   (:func:`unexplored`).
5. The best measured config is probed once more (a verification of its own); it
   wins if that run is ok within the usable budget, else the next is tried. Its
   DeepSpeed JSON is checked by DeepSpeed and written atomically, and only then.

Resumption: the config and the measurement of each finished probe are user attrs
of its trial, written before ``tell``. A search started again on the same study
(``--study NAME`` and the same storage) reads them back, skips those configs and
keeps their results for calibration and the best; a trial left ``RUNNING`` by a
killed process is marked failed (it has no ``measured`` attr) and its config is probed again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autofit.config import Config
from autofit.cost_model import Coefficients, ModelFacts, Prediction
from autofit.cost_model.calibrate import Calibration, Observation, calibrate
from autofit.errors import AutofitError
from autofit.hardware import Hardware
from autofit.space import SearchSpace, enumerate_candidates
from autofit.units import format_bytes
from autofit.workload import Workload

DEFAULT_STORAGE = "sqlite:///autofit.db"
#: the least doubt the stop rule allows a prediction: a candidate predicted more than 1/(1 + this) of the
#: best measured throughput may still beat it and is probed
STOP_TOLERANCE = 0.05
#: the stop rule's tolerance never grows past this, however poorly the model explains the probes
MAX_STOP_TOLERANCE = 0.30
#: probes made before the stopping rule may end the search: one probe calibrates a scale,
#: not the ranking of the cost model, so the next fastest predicted are measured too
MIN_PROBES = 3
#: timed steps of a search probe and of the verification probe (their median is the step time): within one
#: probe they agree to a few %, and next to the ~7 s of start-up on a CPU five cost little
PROBE_STEPS = 5
VERIFY_STEPS = 5
#: seconds one probe may take when the search has no overall timeout (start-up included)
PROBE_TIMEOUT_S = 300.0
#: a probe is never given less than this, even near the overall deadline
MIN_PROBE_TIMEOUT_S = 30.0
#: a candidate predicted past the usable budget by less than the memory model's uncertainty is still probed
#: (its measured peak decides): at least the median |error| of benchmarks/memory_accuracy.py (~2 %),
#: widened to the calibrated model's largest miss on the probes so far, at most MEMORY_BAND_CAP
MEMORY_BAND_FLOOR = 0.02
MEMORY_BAND_CAP = 0.10
#: configs verified before giving up (each a probe)
MAX_VERIFICATIONS = 3
#: configs verified together: the best measured and up to two close runners-up
CONTENDERS = 3
#: a runner-up measured within this of the best is verified too: two probes of one config on this
#: project's shared 2-core machine differed by up to ~25 % (ViT, 5 runs; ResNet mb1x4 SGD 25.1 then 19.8
#: samples/s within one search), so one probe cannot separate them
CONTENDER_WITHIN = 0.20
#: world sizes tried when saying how many GPUs would make the smallest candidate fit
_GPU_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _key(config: Config) -> str:
    return config.key()


@dataclass
class TrialRecord:
    """One probe of the search, as the study stores it."""

    number: int
    """Optuna trial number."""
    config: Config
    """What ran."""
    phase: str
    """``search`` or ``verify``."""
    status: str
    """``ok``, ``oom``, ``timeout``, ``error``, or ``interrupted`` (killed with the search)."""
    measured: dict[str, Any]
    """The probe's JSON (``autofit probe``'s) less config and predicted; empty when interrupted."""
    predicted: dict[str, Any]
    """The calibrated prediction the search held when it chose this probe."""
    within_margin: bool = False
    """ok and measured peak <= the usable budget."""
    started_s: float = 0.0
    """Seconds since the epoch the probe started."""
    wall_s: float = 0.0
    """Seconds the probe took."""
    resumed: bool = False
    """Read back from an earlier run of the study."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "config": self.config.to_dict(),
            "phase": self.phase,
            "status": self.status,
            "within_margin": self.within_margin,
            "measured": self.measured,
            "predicted": self.predicted,
            "started_s": self.started_s,
            "wall_s": self.wall_s,
            "resumed": self.resumed,
        }

    @property
    def samples_per_s(self) -> float:
        return float(self.measured.get("samples_per_s") or 0.0)

    @property
    def peak_bytes(self) -> int:
        return int(self.measured.get("peak_bytes") or 0)


@dataclass
class SearchResult:
    """The winner, every trial and every candidate left unprobed with why."""

    config: Config
    """The verified winner."""
    measured: dict[str, Any]
    """Its verification probe."""
    predicted: dict[str, Any]
    """The final calibrated prediction for it."""
    deepspeed: dict[str, Any]
    """The JSON written to ``out_path``."""
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
    out_path: str
    wall_s: float
    calibration: Calibration
    predictions: list[tuple[Config, Prediction]] = field(default_factory=list)
    """Every candidate with its final calibrated prediction, fastest first (for the report)."""
    facts: ModelFacts | None = None

    @property
    def n_search_probes(self) -> int:
        return sum(1 for t in self.trials if t.phase == "search")

    @property
    def n_probes(self) -> int:
        return len([t for t in self.trials if t.status != "interrupted"])

    def runner_ups(self, n: int = 5) -> list[TrialRecord]:
        """The best other measured configs within the margin, fastest first (one per config)."""
        seen = {_key(self.config)}
        out = []
        for t in sorted(self.trials, key=lambda t: -t.samples_per_s):
            if t.within_margin and _key(t.config) not in seen:
                seen.add(_key(t.config))
                out.append(t)
        return out[:n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": {"config": self.config.to_dict(), "measured": self.measured, "predicted": self.predicted},
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


class PlannedSampler:
    """An Optuna sampler that returns the config the search planned for the next trial.

    The choice of *which* config is the cost model's (calibrated predicted throughput);
    Optuna owns the study, its storage and its records. Each config key is a categorical
    parameter of the trial.
    """

    def __init__(self) -> None:
        self.plan: dict[str, Any] = {}

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return {}

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        return self.plan[param_name]

    def before_trial(self, study: Any, trial: Any) -> None:
        pass

    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        pass

    def reseed_rng(self) -> None:
        pass


def _sampler() -> Any:
    from optuna.samplers import BaseSampler

    class _Planned(PlannedSampler, BaseSampler):  # type: ignore[misc]
        pass

    return _Planned()


def stop_margin(observed: list[Observation], facts: Any, usable: Any, world_size: int, prior: Any,
                floor: float) -> float:
    """The stop rule's tolerance: how far the calibrated model misses a measured step time it was not
    fitted on (leave-one-out over the probes so far), at least ``floor``, at most ``MAX_STOP_TOLERANCE``.
    Fitted on every probe the misses would shrink to nothing whatever the model's real skill.

    Where a probe timed its optimizer update apart, only forward and backward are held out: every
    optimizer the stop rule weighs has had its update measured (:func:`unexplored`), so what is in
    doubt is how the model carries one measured point to another micro-batch or checkpoint ratio.
    """
    timed = [i for i, o in enumerate(observed) if o.status == "ok" and o.step_time_s > 0]
    misses = []
    for i in timed:
        others = [o for j, o in enumerate(observed) if j != i]
        held_out = observed[i]
        calibration = calibrate(others, facts, usable, world_size, prior)
        prediction = calibration.predict(held_out.config, facts, usable, world_size)
        if held_out.split:
            update_s = prediction.time_breakdown.get("optimizer", 0.0)
            miss = (prediction.step_time_s - update_s) - (held_out.step_time_s - held_out.optimizer_time_s)
        else:
            miss = prediction.step_time_s - held_out.step_time_s
        misses.append(abs(miss) / held_out.step_time_s)
    return min(MAX_STOP_TOLERANCE, max([floor, *misses]))


def memory_band(
    records: list[TrialRecord], calibration: Calibration, facts: ModelFacts, usable: Hardware, world_size: int
) -> float:
    """How far past the usable budget a prediction may be and the candidate still be probed.

    A prediction within a few % of the budget cannot say whether the config fits: the probe's measured
    peak can (it must be within the budget to win). The band is the calibrated model's largest relative
    miss on the peaks it has measured, within ``[MEMORY_BAND_FLOOR, MEMORY_BAND_CAP]``.
    """
    misses = [
        abs(r.peak_bytes / predicted - 1.0)
        for r in records
        if r.status == "ok" and r.peak_bytes > 0
        and (predicted := calibration.predict(r.config, facts, usable, world_size).peak_bytes) > 0
    ]
    return min(MEMORY_BAND_CAP, max([MEMORY_BAND_FLOOR, *misses]))


def fit_chance(prediction: Prediction, usable_bytes: int, band: float) -> float:
    """1 for a prediction within the usable budget, falling linearly to 0 at ``band`` past it."""
    over = prediction.peak_bytes / usable_bytes - 1.0
    if over <= 0:
        return 1.0
    return max(0.0, 1.0 - over / band) if band > 0 else 0.0


def expected_speed(prediction: Prediction, usable_bytes: int, band: float) -> float:
    """Predicted samples/s times the chance that the config fits: what a probe of it is worth."""
    return prediction.samples_per_s * fit_chance(prediction, usable_bytes, band)


def by_expected_speed(
    candidates: list[tuple[Config, Prediction]], usable_bytes: int, band: float
) -> list[tuple[Config, Prediction]]:
    """The candidates that may fit (within the memory band), by :func:`expected_speed`, best first: a
    config predicted just past the budget is probed only where its speed makes up for the doubt."""
    worth = [(c, p) for c, p in candidates if fit_chance(p, usable_bytes, band) > 0]
    return sorted(worth, key=lambda cp: -expected_speed(cp[1], usable_bytes, band))


def unexplored(
    todo: list[tuple[Config, Prediction]], records: list[TrialRecord], best: TrialRecord | None, tolerance: float
) -> list[tuple[Config, Prediction]]:
    """Candidates with an optimizer or a precision no probe has measured yet that could still win, fastest first.

    What an optimizer's update costs on a device (a bitsandbytes or Python optimizer on a CPU) and how
    fast a precision runs on it (a CPU without native bf16) are what the analytic model knows least, and
    the calibration learns them only from a probe of that optimizer or precision. So before the stop
    rule may end the search, each gets one probe, unless nothing of it fits or (an optimizer) even a
    free update, with the model's ``tolerance`` in its favour too, could not make it beat the best measured.
    An oom leaves its optimizer and precision unexplored; an error or a timeout does not.
    """
    settled = [r for r in records if r.status in ("ok", "error", "timeout")]
    optimizers = {r.config.optimizer for r in settled}
    precisions = {r.config.precision for r in settled}
    out = []
    for config, prediction in todo:
        new_precision = config.precision not in precisions
        if not new_precision and config.optimizer in optimizers:
            continue
        if not new_precision and best is not None:
            without_update = prediction.step_time_s - prediction.time_breakdown.get("optimizer", 0.0)
            bound = prediction.samples_per_s * prediction.step_time_s / without_update if without_update > 0 else math.inf
            if bound * (1.0 + tolerance) <= best.samples_per_s:
                continue
        out.append((config, prediction))
    return out


def run_search(
    entry: str,
    workload: Workload,
    hardware: Hardware,
    space: SearchSpace,
    *,
    world_size: int = 1,
    global_batch: int | None = None,
    fixed: dict[str, Any] | None = None,
    trials: int = 20,
    timeout_s: float | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    out_path: str | os.PathLike[str],
    report_dir: str | os.PathLike[str] | None = None,
    margin: float = 0.10,
    progress: bool = True,
    coefficients: Coefficients | None = None,
    stop_tolerance: float = STOP_TOLERANCE,
    min_probes: int = MIN_PROBES,
    probe_steps: int = PROBE_STEPS,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
    facts: ModelFacts | None = None,
) -> SearchResult:
    """Find the fastest config of ``space`` that fits ``hardware`` (measured), write its DeepSpeed JSON.

    ``trials`` bounds the search probes of the study (resumed ones count); the search stops earlier,
    after at least ``min_probes`` and one probe of each optimizer and precision that could win, once no
    unprobed candidate could beat the best measured even with its calibrated prediction raised by the
    tolerance (at least ``stop_tolerance``, the model's leave-one-out miss);
    ``timeout_s`` the wall time of this call's search (the verification may run past it,
    once). Raises :class:`AutofitError` when nothing fits; then nothing is written.
    """
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState

    from autofit.emit import check_with_deepspeed, deepspeed_config
    from autofit.plan import trace_for
    from autofit.probe import run_probe

    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise AutofitError(f"trials must be an integer >= 1, but got {trials!r}")
    if not 0.0 <= margin < 1.0:
        raise AutofitError(f"margin must be within [0, 1), but got {margin!r}")
    if timeout_s is not None and timeout_s <= 0:
        raise AutofitError(f"timeout must be positive, but got {timeout_s!r}")
    started = time.monotonic()
    deadline = started + timeout_s if timeout_s is not None else math.inf
    fixed = dict(fixed or {})
    out = Path(out_path)

    enumeration = enumerate_candidates(
        space,
        hardware=hardware,
        world_size=world_size,
        global_batch=global_batch,
        fixed=fixed,
        searches_attention=workload.searches_attention,
    )
    configs = enumeration.candidates
    with _status(progress, f"tracing {workload.name or entry} ({len(configs)} candidates)"):
        facts = facts or trace_for(workload, configs)
    usable_bytes = int((1.0 - margin) * hardware.memory_bytes)
    usable = hardware.with_memory(usable_bytes)
    prior = coefficients or Coefficients.for_hardware(hardware)

    storage = storage or DEFAULT_STORAGE
    signature = _signature(entry, hardware, space, world_size, global_batch, fixed)
    study_name = study_name or f"autofit-{workload.name or 'workload'}-{signature[:10]}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = _sampler()
    study = optuna.create_study(
        storage=storage, study_name=study_name, direction="maximize", sampler=sampler, load_if_exists=True
    )
    earlier = study.user_attrs.get("signature")
    if earlier is not None and earlier != signature:
        raise AutofitError(
            f"study {study_name!r} in {storage} was started with another entry, device, space, world size, "
            "global batch or --set; give a new --study name"
        )
    if earlier is None:
        study.set_user_attr("signature", signature)
        study.set_user_attr("entry", entry)
        study.set_user_attr("hardware", hardware.name)
        study.set_user_attr("memory_bytes", hardware.memory_bytes)
        study.set_user_attr("world_size", world_size)
        study.set_user_attr("margin", margin)

    # every key is a categorical parameter: its choices are the values the candidates take
    distributions = {
        name: CategoricalDistribution(sorted({getattr(c, name) for c in configs}, key=str))
        for name in Config.__dataclass_fields__
    }

    records = _read_back(study, TrialState)
    probed = {_key(r.config) for r in records if r.phase == "search" and r.status != "interrupted"}

    def observations() -> list[Observation]:
        return [
            Observation(
                r.config,
                r.status,
                r.peak_bytes,
                float(r.measured.get("step_time_s") or 0.0),
                hardware.memory_bytes,
                float(r.measured.get("optimizer_time_s") or 0.0),
            )
            for r in records
            if r.status in ("ok", "oom")
        ]

    def best_measured() -> TrialRecord | None:
        good = [r for r in records if r.within_margin]
        return max(good, key=lambda r: r.samples_per_s) if good else None

    def priced(calibration: Calibration) -> list[tuple[Config, Prediction]]:
        out_list = [(c, calibration.predict(c, facts, usable, world_size)) for c in configs]
        out_list.sort(key=lambda cp: -cp[1].samples_per_s)
        return out_list

    def probe(config: Config, phase: str, predicted: Prediction, steps: int) -> TrialRecord:
        sampler.plan = config.to_dict()
        trial = study.ask()
        for name, dist in distributions.items():
            trial.suggest_categorical(name, dist.choices)  # the sampler answers with the plan
        trial.set_user_attr("config", config.to_dict())
        trial.set_user_attr("phase", phase)
        trial.set_user_attr("predicted", predicted.to_dict())
        trial.set_user_attr("label", config.label())
        remaining = deadline - time.monotonic()
        limit = probe_timeout_s if math.isinf(remaining) else max(MIN_PROBE_TIMEOUT_S, min(probe_timeout_s, remaining))
        t0 = time.time()
        result = run_probe(entry, config, hardware, world_size, steps=steps, timeout_s=limit)
        measured = {k: v for k, v in result.to_dict().items() if k not in ("config", "predicted")}
        within = result.status == "ok" and result.peak_bytes <= usable_bytes
        # the measurement is stored before tell: a kill between the two loses nothing
        trial.set_user_attr("status", result.status)
        trial.set_user_attr("measured", measured)
        trial.set_user_attr("within_margin", within)
        trial.set_user_attr("started_s", t0)
        if within:
            study.tell(trial, result.samples_per_s)
        elif result.status == "ok":
            study.tell(trial, state=TrialState.PRUNED)  # ran, but past the safety margin
        else:
            study.tell(trial, state=TrialState.FAIL)
        record = TrialRecord(
            number=trial.number,
            config=config,
            phase=phase,
            status=result.status,
            measured=measured,
            predicted=predicted.to_dict(),
            within_margin=within,
            started_s=t0,
            wall_s=result.wall_s,
        )
        records.append(record)
        return record

    n_done = sum(1 for r in records if r.phase == "search" and r.status != "interrupted")
    calibration = calibrate(observations(), facts, usable, world_size, prior)
    stop_reason = ""
    with _progress(progress, trials, n_done) as bar:
        while True:
            ranked = priced(calibration)
            best = best_measured()
            band = memory_band(records, calibration, facts, usable, world_size)
            todo = by_expected_speed(
                [(c, p) for c, p in ranked if _key(c) not in probed], usable_bytes, band
            )
            if n_done >= trials:
                stop_reason = f"reached --trials {trials}"
                break
            if time.monotonic() >= deadline:
                stop_reason = f"reached --timeout {timeout_s:g} s"
                break
            if not todo:
                stop_reason = "every candidate predicted to fit has been probed"
                break
            tolerance = stop_margin(observations(), facts, usable, world_size, prior, stop_tolerance)
            explore = unexplored(todo, records, best, tolerance)
            if explore:
                config, predicted = explore[0]
            elif (
                best is not None
                and n_done >= min_probes
                and expected_speed(todo[0][1], usable_bytes, band) * (1.0 + tolerance) <= best.samples_per_s
            ):
                stop_reason = (
                    f"no candidate left could beat the best measured {best.samples_per_s:.3g} samples/s, even "
                    f"{tolerance:.0%} faster than predicted (the calibrated model's largest leave-one-out miss, "
                    f"at least {stop_tolerance:.0%})"
                )
                break
            else:
                config, predicted = todo[0]
            bar.describe(n_done, f"probing {config.label()}", best)
            record = probe(config, "search", predicted, probe_steps)
            probed.add(_key(config))
            n_done += 1
            calibration = calibrate(observations(), facts, usable, world_size, prior)
            bar.describe(n_done, f"{config.label()}: {_outcome(record)}", best_measured())

        ranked = priced(calibration)
        # verification: the best measured config is probed again, and so are runners-up measured within
        # CONTENDER_WITHIN of it (one probe can be that far off); of those that run again within the
        # margin, the one with the higher mean over its probes wins. A config that does not verify is
        # dropped and the next best tried, up to MAX_VERIFICATIONS configs.
        winner: TrialRecord | None = None
        tried: set[str] = set()
        while winner is None and len(tried) < MAX_VERIFICATIONS:
            leaders = [c for c in _measured_leaders(records) if _key(c) not in tried]
            if not leaders:
                break
            lead = _mean_samples(records, leaders[0])
            contenders = [leaders[0]] + [
                c for c in leaders[1:CONTENDERS] if _mean_samples(records, c) >= (1.0 - CONTENDER_WITHIN) * lead
            ]
            for config in contenders[: MAX_VERIFICATIONS - len(tried)]:
                tried.add(_key(config))
                # a verification an earlier run of the study finished is not repeated
                if not any(r.phase == "verify" and _key(r.config) == _key(config) for r in records):
                    bar.describe(n_done, f"verifying {config.label()}", best_measured())
                    prediction = calibration.predict(config, facts, usable, world_size)
                    probe(config, "verify", prediction, VERIFY_STEPS)
            verified = [r for r in records if r.phase == "verify" and r.within_margin and _key(r.config) in tried]
            if verified:
                winner = max(verified, key=lambda r: (_mean_samples(records, r.config), r.number))
            else:
                calibration = calibrate(observations(), facts, usable, world_size, prior)

    if winner is None:
        raise AutofitError(
            _nothing_fits(records, ranked, facts, hardware, usable, world_size, calibration, global_batch, margin)
        )

    ds = deepspeed_config(winner.config, world_size, hardware.kind)
    check_with_deepspeed(ds)
    ranked = priced(calibration)
    final_prediction = (
        dict(ranked)[winner.config]
        if winner.config in dict(ranked)
        else calibration.predict(winner.config, facts, usable, world_size)
    )
    pruned = _pruned(ranked, probed, winner, enumeration.rejected, usable_bytes)
    result = SearchResult(
        config=winner.config,
        measured=winner.measured,
        predicted=final_prediction.to_dict(),
        deepspeed=ds,
        trials=sorted(records, key=lambda r: r.number),
        pruned=pruned,
        hardware=hardware,
        world_size=world_size,
        global_batch=global_batch if global_batch is not None else space.global_batch_size,
        margin=margin,
        usable_bytes=usable_bytes,
        n_candidates=len(configs),
        stop_reason=stop_reason,
        storage=storage,
        study_name=study_name,
        out_path=str(out),
        wall_s=time.monotonic() - started,
        calibration=calibration,
        predictions=ranked,
        facts=facts,
    )
    write_json_atomic(out, ds)
    if report_dir is not None:
        from autofit.report import write_report

        write_report(result, report_dir)
    return result


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to a temporary file beside ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _signature(
    entry: str, hardware: Hardware, space: SearchSpace, world_size: int, global_batch: int | None, fixed: dict[str, Any]
) -> str:
    text = json.dumps(
        {
            "entry": entry,
            "hardware": hardware.fingerprint(),
            "space": space.to_dict(),
            "world_size": world_size,
            "global_batch": global_batch,
            "fixed": {k: fixed[k] for k in sorted(fixed)},
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _read_back(study: Any, trial_state: Any) -> list[TrialRecord]:
    """The finished probes of an earlier run of this study; mark trials a killed run left running."""
    records = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        if "config" not in attrs:
            continue
        config = Config.from_dict(attrs["config"])
        if "measured" in attrs:
            records.append(
                TrialRecord(
                    number=t.number,
                    config=config,
                    phase=attrs.get("phase", "search"),
                    status=attrs.get("status", "error"),
                    measured=dict(attrs["measured"]),
                    predicted=dict(attrs.get("predicted", {})),
                    within_margin=bool(attrs.get("within_margin", False)),
                    started_s=float(attrs.get("started_s", 0.0)),
                    wall_s=float(attrs["measured"].get("wall_s", 0.0)),
                    resumed=True,
                )
            )
            if t.state == trial_state.RUNNING:  # killed between the measurement and tell
                _finish_orphan(study, t, trial_state, attrs)
        elif t.state == trial_state.RUNNING:
            # killed mid-probe: nothing was measured, the config will be probed again
            study.tell(t.number, state=trial_state.FAIL)
    return records


def _finish_orphan(study: Any, t: Any, trial_state: Any, attrs: dict[str, Any]) -> None:
    if attrs.get("within_margin"):
        study.tell(t.number, float(attrs["measured"].get("samples_per_s") or 0.0))
    elif attrs.get("status") == "ok":
        study.tell(t.number, state=trial_state.PRUNED)
    else:
        study.tell(t.number, state=trial_state.FAIL)


def _mean_samples(records: list[TrialRecord], config: Config) -> float:
    """Mean samples/s over the probes of ``config`` (search and verification) that ran within the margin."""
    runs = [r.samples_per_s for r in records if r.within_margin and _key(r.config) == _key(config)]
    return sum(runs) / len(runs) if runs else 0.0


def _measured_leaders(records: list[TrialRecord]) -> list[Config]:
    """Configs a search probe ran within the margin, by mean measured samples/s, fastest first."""
    configs = {_key(r.config): r.config for r in records if r.phase == "search" and r.within_margin}
    return sorted(configs.values(), key=lambda c: -_mean_samples(records, c))


def _outcome(record: TrialRecord) -> str:
    if record.status == "ok":
        note = "" if record.within_margin else " (past the safety margin)"
        return f"{record.samples_per_s:.3g} samples/s, {format_bytes(record.peak_bytes)}{note}"
    message = record.measured.get("message") or ""
    return f"{record.status} {message}"[:120]


def _pruned(
    ranked: list[tuple[Config, Prediction]],
    probed: set[str],
    winner: TrialRecord,
    rejected: list[tuple[dict[str, Any], str]],
    usable_bytes: int,
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for config, prediction in ranked:
        if _key(config) in probed:
            continue
        if not prediction.fits:
            reason = f"predicted {format_bytes(prediction.peak_bytes)} > usable {format_bytes(usable_bytes)}"
            out.append(
                {
                    "config": config.to_dict(),
                    "kind": "memory",
                    "reason": reason,
                    "predicted_peak_bytes": prediction.peak_bytes,
                }
            )
        else:
            reason = (
                f"predicted {prediction.samples_per_s:.3g} samples/s, not enough to beat the winner's measured "
                f"{winner.samples_per_s:.3g}"
            )
            out.append(
                {
                    "config": config.to_dict(),
                    "kind": "dominated",
                    "reason": reason,
                    "predicted_samples_per_s": prediction.samples_per_s,
                }
            )
    for partial, reason in rejected:
        out.append({"config": dict(partial), "kind": "rule", "reason": reason})
    return out


def _nothing_fits(
    records: list[TrialRecord],
    ranked: list[tuple[Config, Prediction]],
    facts: ModelFacts,
    hardware: Hardware,
    usable: Hardware,
    world_size: int,
    calibration: Calibration,
    global_batch: int | None,
    margin: float,
) -> str:
    """One paragraph: what the smallest candidate needs, and what would make it fit."""
    smallest_config, smallest = min(ranked, key=lambda cp: cp[1].peak_bytes)
    budget = format_bytes(usable.memory_bytes)
    failed = [r for r in records if r.phase == "search"]
    head = (
        f"nothing fits {hardware.name} ({format_bytes(hardware.memory_bytes)}, {budget} usable with the "
        f"{margin:.0%} safety margin): "
    )
    if failed:
        outcomes = ", ".join(sorted({r.status if r.status != "ok" else "past the margin" for r in failed}))
        head += f"{len(failed)} probe(s) ended {outcomes}; "
    head += f"the smallest candidate ({smallest_config.label()}) needs {format_bytes(smallest.peak_bytes)}."
    ideas = []
    sharded = smallest_config.with_(zero_stage=3)
    if hardware.kind == "cuda" or world_size > 1:
        for n in _GPU_COUNTS:
            if n <= world_size:
                continue
            p = calibration.predict(_at_world(sharded, n, global_batch), facts, usable, n)
            if p.fits:
                ideas.append(f"{n} GPUs with ZeRO-3 sharding (about {format_bytes(p.peak_bytes)} each)")
                break
        offloaded = sharded.with_(offload_optimizer="cpu", offload_params="cpu")
        p = calibration.predict(offloaded, facts, usable, world_size)
        if p.fits:
            ideas.append(
                f"ZeRO-3 with optimizer and parameters offloaded to the CPU (about {format_bytes(p.peak_bytes)})"
            )
    else:
        for n in _GPU_COUNTS:
            p = calibration.predict(_at_world(sharded, n, global_batch), facts, usable, n)
            if p.fits:
                ideas.append(f"{n} ranks with ZeRO-3 sharding (about {format_bytes(p.peak_bytes)} each)")
                break
    lean = smallest_config.with_(micro_batch_size=1, checkpoint_ratio=1.0)
    p = calibration.predict(lean.with_(grad_accum_steps=1), facts, usable, world_size)
    if p.fits and (smallest_config.micro_batch_size > 1 or smallest_config.checkpoint_ratio < 1.0):
        gb = world_size * lean.grad_accum_steps
        ideas.append(
            f"micro-batch 1 with full checkpointing (about {format_bytes(p.peak_bytes)}): allow them in the space, "
            f"with a global batch divisible by {gb}"
        )
    if ideas:
        return head + " It would fit with " + "; or ".join(ideas) + "."
    return head + " Even sharded over 1024 GPUs it would not fit: a larger device or a smaller model is needed."


def _at_world(config: Config, n: int, global_batch: int | None) -> Config:
    """``config`` at ``n`` ranks: the accumulation shrinks to keep the global batch where it divides."""
    if global_batch is not None and global_batch % (config.micro_batch_size * n) == 0:
        return config.with_(grad_accum_steps=global_batch // (config.micro_batch_size * n))
    return config.with_(grad_accum_steps=1)


class _Bar:
    def __init__(self, progress: Any, task: Any, total: int) -> None:
        self.progress, self.task, self.total = progress, task, total

    def describe(self, done: int, what: str, best: TrialRecord | None) -> None:
        if self.progress is None:
            return
        best_text = f"best {best.samples_per_s:.3g} samples/s" if best is not None else "best -"
        self.progress.update(
            self.task, completed=min(done, self.total), description=f"trial {done}/{self.total} | {best_text} | {what}"
        )


@contextmanager
def _progress(enabled: bool, total: int, done: int) -> Iterator[_Bar]:
    """A rich progress bar on stderr (stdout stays clean for ``--json``)."""
    if not enabled:
        yield _Bar(None, None, total)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=sys.stderr)
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task(f"trial {done}/{total}", total=total, completed=done)
        yield _Bar(progress, task, total)


@contextmanager
def _status(enabled: bool, text: str) -> Iterator[None]:
    if enabled:
        print(f"autofit: {text}", file=sys.stderr, flush=True)
    yield


__all__ = ["DEFAULT_STORAGE", "SearchResult", "TrialRecord", "run_search", "write_json_atomic"]
