"""What to probe next and when to stop. Pure: no probe, no study, no I/O.

Each round the driver :func:`observe`\\ s the records and the calibrated prices into a
:class:`SearchState`; :func:`should_stop` names a reason to stop or returns None, and
:func:`next_probe` picks the candidate. The rules:

- **Who may be probed.** A candidate predicted within the usable budget, or past it by less than
  the memory model's uncertainty (:func:`memory_band`): its measured peak decides. Candidates are
  ranked by :func:`probe_worth`: predicted samples/s times the chance it fits, times the chance it runs
  where its nearest measured families errored (:func:`error_chance`).
- **Explore first.** Each optimizer and precision is probed once (:func:`unexplored`): what an
  update costs and how fast a dtype runs on a device are what an analytic model knows least.
- **Measure before "nothing fits".** When nothing measured has fit and nothing is left that is
  predicted to, the smallest candidate of each family not yet measured is probed, smallest first
  (up to ``last_resort_probes`` past ``trials``). A family a probe errored in is not probed again. While
  every probe has failed with one error, the next probe tries the most setting values none has had
  (:func:`covering_probe`); once every value of every family key has failed with it, the search stops with
  that error (:func:`common_error`), not with "nothing fits".
- **Stop.** At ``trials`` probes, at the timeout, when nothing is left, or (after ``min_probes``)
  when no candidate left could beat the best measured even if it ran faster than predicted by the
  calibrated model's leave-one-out miss (:func:`stop_margin`). This is the shape of Optuna's
  ``RegretBoundEvaluator`` + ``CrossValidationErrorEvaluator`` terminator: stop when the regret
  bound of what is left falls below the model's cross-validated error.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.cost_model import Coefficients, ModelFacts, Prediction
from autofit.cost_model.calibrate import Calibration, Observation, calibrate
from autofit.cost_model.memory_correction import FAMILY_KEYS, distance, family
from autofit.planning.plan import Plan
from autofit.tuner.records import TrialRecord, best_measured, observations, searched_keys
from autofit.tuner.settings import SearchSettings


def stop_margin(
    observed: list[Observation],
    facts: ModelFacts,
    usable: Hardware,
    world_size: int,
    prior: Coefficients | None,
    floor: float,
    cap: float = SearchSettings.max_stop_tolerance,
) -> float:
    """The stop rule's tolerance: how far the calibrated model misses a measured step time it was not
    fitted on (leave-one-out over the probes so far), at least ``floor``, at most ``cap``.
    Fitted on every probe the misses would shrink to nothing whatever the model's real skill.

    Where a probe timed its optimizer update apart, only forward and backward are held out: every
    optimizer the stop rule weighs has had its update measured (:func:`unexplored`), so what is in
    doubt is how the model carries one measured point to another micro-batch or checkpoint ratio.
    """
    misses = []
    for i, held_out in enumerate(observed):
        if held_out.status != "ok" or held_out.step_time_s <= 0:
            continue
        others = [o for j, o in enumerate(observed) if j != i]
        prediction = calibrate(others, facts, usable, world_size, prior).predict(held_out.config, facts, usable, world_size)
        if held_out.split:
            update_s = prediction.time_breakdown.get("optimizer", 0.0)
            miss = (prediction.step_time_s - update_s) - (held_out.step_time_s - held_out.optimizer_time_s)
        else:
            miss = prediction.step_time_s - held_out.step_time_s
        misses.append(abs(miss) / held_out.step_time_s)
    return min(cap, max([floor, *misses]))


def memory_band(
    records: list[TrialRecord], calibration: Calibration, usable: Plan, floor: float, cap: float
) -> float:
    """How far past the usable budget a prediction may be and the candidate still be probed.

    A prediction within a few % of the budget cannot say whether the config fits: the probe's measured
    peak can (it must be within the budget to win). The band is the calibrated model's largest relative
    miss on the peaks it has measured, within ``[floor, cap]``.
    """
    misses = [
        abs(r.peak_bytes / predicted - 1.0)
        for r in records
        if r.status == "ok" and r.peak_bytes > 0 and (predicted := usable.predict(r.config, calibration).peak_bytes) > 0
    ]
    return min(cap, max([floor, *misses]))


def fit_chance(prediction: Prediction, usable_bytes: int, band: float) -> float:
    """1 for a prediction within the usable budget, falling linearly to 0 at ``band`` past it."""
    over = prediction.peak_bytes / usable_bytes - 1.0
    if over <= 0:
        return 1.0
    return max(0.0, 1.0 - over / band) if band > 0 else 0.0


def expected_speed(prediction: Prediction, usable_bytes: int, band: float) -> float:
    """Predicted samples/s times the chance that the config fits: what a probe of it is worth."""
    return prediction.samples_per_s * fit_chance(prediction, usable_bytes, band)


def errored_families(records: list[TrialRecord]) -> dict[tuple[object, ...], bool]:
    """Each family a search probe measured, and whether a probe of it errored."""
    measured: dict[tuple[object, ...], bool] = {}
    for r in records:
        if r.phase == "search":
            measured[family(r.config)] = measured.get(family(r.config), False) or r.status == "error"
    return measured


def error_chance(config: Config, records: list[TrialRecord],
                 measured: dict[tuple[object, ...], bool] | None = None) -> float:
    """The chance a probe of ``config`` errors, as its nearest measured families say: of the families a search
    probe measured at the least :func:`~autofit.cost_model.memory_correction.distance` from ``config``'s, the
    share that errored. An error comes from some settings together (bf16 with BatchNorm's fp32 buffers at ZeRO
    0-2, an op a device cannot build): a config that shares more of them with an errored family than with any
    that ran is likely to meet it too, and is probed after those that are not, not never. ``measured``:
    :func:`errored_families` of ``records``, when the caller has it already."""
    measured = errored_families(records) if measured is None else measured
    if not measured:
        return 0.0
    mine = family(config)
    nearest = min(distance(mine, f) for f in measured)
    near = [errored for f, errored in measured.items() if distance(mine, f) == nearest]
    return sum(near) / len(near)


def probe_worth(config: Config, prediction: Prediction, usable_bytes: int, band: float,
                records: list[TrialRecord], measured: dict[tuple[object, ...], bool] | None = None) -> float:
    """What a probe of ``config`` is worth: :func:`expected_speed` times the chance that it runs
    (:func:`error_chance` over ``records``)."""
    return expected_speed(prediction, usable_bytes, band) * (1.0 - error_chance(config, records, measured))


def by_expected_speed(
    candidates: list[tuple[Config, Prediction]], usable_bytes: int, band: float,
    records: list[TrialRecord] | None = None,
) -> list[tuple[Config, Prediction]]:
    """The candidates that may fit (within the memory band), by :func:`probe_worth`, best first: a config
    predicted just past the budget is probed only where its speed makes up for the doubt."""
    done = records or []
    measured = errored_families(done)  # once for the whole ranking
    may_fit = [(c, p) for c, p in candidates if fit_chance(p, usable_bytes, band) > 0]
    return sorted(may_fit, key=lambda cp: -probe_worth(cp[0], cp[1], usable_bytes, band, done, measured))


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


#: the widest memory band (:attr:`SearchSettings.memory_band_cap`): how far past the budget the uncorrected
#: model may put a last-resort probe
MAX_BAND = SearchSettings.memory_band_cap


def probe_budget(settings: SearchSettings, steps: int, predicted_step_s: float, n_timeouts: int,
                 remaining_s: float) -> tuple[int, float]:
    """Timed steps and the timeout of one probe of a config predicted at ``predicted_step_s`` a step.

    A slow config is timed over fewer steps (about :attr:`SearchSettings.probe_seconds` of them, never fewer
    than ``min_timed_steps``); the probe may take ``probe_timeout_s`` plus ``timeout_slack`` times its predicted
    duration (a warm-up and the timed steps), doubled for each probe that timed out before, up to ``max_timeout_doublings`` times
    (a timeout teaches the calibration nothing, so the limit itself learns), and no more than is left of the search's deadline
    (but never less than ``min_probe_timeout_s``).
    """
    allowance = 0.0
    if predicted_step_s > 0 and math.isfinite(predicted_step_s):
        steps = max(min(steps, settings.min_timed_steps), min(steps, math.ceil(settings.probe_seconds / predicted_step_s)))
        allowance = settings.timeout_slack * (steps + 1) * predicted_step_s
    limit = (settings.probe_timeout_s + allowance) * 2 ** min(n_timeouts, settings.max_timeout_doublings)
    if math.isfinite(remaining_s):
        limit = max(settings.min_probe_timeout_s, min(limit, remaining_s))
    return steps, limit


def failed_families(records: list[TrialRecord]) -> set[tuple[object, ...]]:
    """Families a probe ended in ``error`` for: a DeepSpeed op that does not build, a kernel a device lacks.
    Their other candidates are not probed (the error says nothing of the others)."""
    return {family(r.config) for r in records if r.status == "error"}


def shared_error(records: list[TrialRecord]) -> str | None:
    """The first line of the one error every probe so far ended in (nothing ran, not even out of memory), or None."""
    if not records or any(r.status != "error" for r in records):
        return None
    messages = {((r.measured.message or "an error without a message").splitlines() or [""])[0] for r in records}
    return messages.pop() if len(messages) == 1 else None


def untried_values(records: list[TrialRecord], candidates: list[Config]) -> set[tuple[str, object]]:
    """``(key, value)`` of each family key's value the candidates offer that no probe has had yet."""
    tried = {(key, getattr(r.config, key)) for r in records for key in FAMILY_KEYS}
    offered = {(key, getattr(c, key)) for c in candidates for key in FAMILY_KEYS}
    return offered - tried


def common_error(records: list[TrialRecord], candidates: list[Config]) -> str | None:
    """The one error the search's probes all ended in, once it cannot be blamed on any one setting: every value
    of every family key the space offers (each precision, optimizer, ZeRO stage, offload and kernel) has had a
    probe fail with it. The setup is then the problem, not the configs, and that error is what the user needs to
    read. An error of some values only (bf16 where BatchNorm's fp32 buffers meet bf16 inputs at ZeRO 0-2) leaves
    the others to be measured."""
    error = shared_error(records)
    if error is None or untried_values(records, candidates):
        return None
    return error


def covering_probe(todo: list[tuple[Config, Prediction]], records: list[TrialRecord]) -> tuple[Config, Prediction]:
    """While every probe has failed with one error, the candidate that tries the most family-key values no probe
    has had (the best expected of those): the error's cause is found, or shown to be everywhere, in as few probes
    as the widest key has values."""
    untried = untried_values(records, [c for c, _ in todo])

    def new_values(config: Config) -> int:
        return sum((key, getattr(config, key)) in untried for key in FAMILY_KEYS)

    return max(todo, key=lambda cp: new_values(cp[0]))  # max keeps the first of equals: the best expected


def is_outlier(record: TrialRecord, records: list[TrialRecord], factor: float,
               predicted_samples: Callable[[Config], float] | None = None) -> bool:
    """A throughput far from its prediction *and* from what its measured neighbours say of the model: its
    measured / predicted samples/s differs from the median of the other search probes' by more than
    ``factor`` either way (a probe run while the machine is busy, 7x slow, would move the calibration and
    the stop rule for the rest of a search). Needs two other probes to compare with.

    ``predicted_samples``: the model the record was predicted with (the calibration before it), applied to the
    others too. Without it each probe's own stored prediction is used; those were made by the calibrations of
    their time, so an uncalibrated first probe 2.4x off makes every well-predicted later probe look 2x off (and
    the search would probe again configs that ran as predicted)."""
    def ratio(r: TrialRecord) -> float:
        stored = r.predicted.samples_per_s if r.predicted is not None else 0.0
        predicted = stored if predicted_samples is None or r is record else predicted_samples(r.config)
        return r.samples_per_s / predicted if predicted > 0 and r.samples_per_s > 0 else 0.0

    mine = ratio(record)
    others = [ratio(r) for r in records if r is not record and r.phase == "search" and ratio(r) > 0]
    if record.status != "ok" or mine <= 0 or len(others) < 2:
        return False
    typical = statistics.median(others)
    return mine > factor * typical or mine * factor < typical


@dataclass(frozen=True)
class SearchState:
    """What the policy decides from, one round of the search."""

    usable: Plan
    """The plan priced against the usable budget."""
    records: list[TrialRecord]
    """Every probe so far (resumed ones included)."""
    ranked: list[tuple[Config, Prediction]]
    """Every candidate with its calibrated prediction, fastest first."""
    usable_bytes: int
    """The budget a winner's measured peak must stay within."""
    band: float
    """:func:`memory_band` of this round."""
    tolerance: float
    """:func:`stop_margin` of this round."""
    n_done: int
    """Search probes made (resumed ones count)."""
    timed_out: bool
    """The search's own deadline has passed."""

    @cached_property
    def best(self) -> TrialRecord | None:
        return best_measured(self.records)

    def fits_host(self, prediction: Prediction) -> bool:
        """Within the node's host RAM: a hard limit, which no probe of the device measures or corrects."""
        host = self.usable.hardware.host_memory_bytes
        return not host or prediction.host_peak_bytes <= host

    @cached_property
    def todo(self) -> list[tuple[Config, Prediction]]:
        """Candidates no search probe has measured that may fit, by expected speed (a family that errored
        is left out)."""
        searched, failed = searched_keys(self.records), failed_families(self.records)
        unprobed = [(c, p) for c, p in self.ranked
                    if c.key() not in searched and family(c) not in failed and self.fits_host(p)]
        return by_expected_speed(unprobed, self.usable_bytes, self.band, self.records)

    @cached_property
    def last_resort(self) -> list[tuple[Config, Prediction]]:
        """Before "nothing fits" is said, it is measured: the smallest candidate of each family, as the
        *uncorrected* model predicts it (within the widest memory band of the usable budget), whose family
        has no measured OOM, error or probe yet; smallest first."""
        settled = {family(r.config) for r in self.records if r.phase == "search"}
        smallest: dict[tuple[object, ...], tuple[Config, Prediction]] = {}
        for config, prediction in self.usable.price():
            f = family(config)
            if f not in settled and (f not in smallest or prediction.peak_bytes < smallest[f][1].peak_bytes):
                smallest[f] = (config, prediction)
        # what the uncorrected model itself puts past the memory band is not worth a probe, and host RAM (which no
        # probe measures or corrects) is a hard limit
        within = [cp for cp in smallest.values()
                  if fit_chance(cp[1], self.usable_bytes, MAX_BAND) > 0 and self.fits_host(cp[1])]
        return sorted(within, key=lambda cp: cp[1].peak_bytes)

    @cached_property
    def explore(self) -> list[tuple[Config, Prediction]]:
        return unexplored(self.todo, self.records, self.best, self.tolerance)


def observe(
    records: list[TrialRecord], usable: Plan, calibration: Calibration, settings: SearchSettings, *,
    device_bytes: int, n_done: int, timed_out: bool,
) -> SearchState:
    """The state of one round: ``usable`` is the plan priced against the usable budget, ``device_bytes``
    the whole device's memory (what the probes ran under)."""
    observed = observations(records, device_bytes)
    return SearchState(
        usable=usable,
        records=records,
        ranked=usable.price(calibration),
        usable_bytes=usable.hardware.memory_bytes,
        band=memory_band(records, calibration, usable, settings.memory_band_floor, settings.memory_band_cap),
        tolerance=stop_margin(
            observed, usable.facts, usable.hardware, usable.world_size, usable.coefficients,
            settings.stop_tolerance, settings.max_stop_tolerance,
        ),
        n_done=n_done,
        timed_out=timed_out,
    )


def should_stop(state: SearchState, settings: SearchSettings) -> str | None:
    """Why the search stops probing now, or None to go on (the rules of the module docstring, in order)."""
    error = common_error(state.records, [c for c, _ in state.ranked])
    if error is not None:
        return f"every probe failed with the same error, whatever the precision, optimizer, ZeRO stage and offload: {error}"
    nothing_measured_fits = state.best is None and bool(state.last_resort)
    if state.n_done >= settings.trials:
        if nothing_measured_fits and state.n_done < settings.trials + settings.last_resort_probes and not state.timed_out:
            return None
        return f"reached --trials {settings.trials}"
    if state.timed_out:
        return f"reached --time-budget {settings.timeout_s:g} s"
    if not state.todo:
        return None if nothing_measured_fits else "every candidate predicted to fit has been probed"
    if state.explore:
        return None
    best = state.best
    if (
        best is not None
        and state.n_done >= settings.min_probes
        and probe_worth(*state.todo[0], state.usable_bytes, state.band, state.records) * (1.0 + state.tolerance)
        <= best.samples_per_s
    ):
        return (
            f"no candidate left could beat the best measured {best.samples_per_s:.3g} samples/s, even "
            f"{state.tolerance:.0%} faster than predicted (the calibrated model's largest leave-one-out miss, "
            f"at least {settings.stop_tolerance:.0%})"
        )
    return None


def next_probe(state: SearchState, settings: SearchSettings) -> tuple[Config, Prediction]:
    """The candidate to probe when :func:`should_stop` said go on: an unexplored one first, else the best
    expected; the last resort once the trials are spent or nothing is predicted to fit."""
    if state.n_done >= settings.trials or not state.todo:
        return state.last_resort[0]
    if shared_error(state.records) is not None:
        return covering_probe(state.todo, state.records)
    return (state.explore or state.todo)[0]
