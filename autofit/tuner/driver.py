"""``run_search``: probe what the policy picks, calibrate after each probe, verify, emit.

The loop, with Optuna owning the study and its storage (:mod:`autofit.tuner.study`):

1. The :class:`~autofit.planning.plan.Plan` (made once) is priced against the *usable* budget,
   ``(1 - margin) x device memory`` (:meth:`~autofit.planning.plan.Plan.usable`, the rule every command judges
   by: :mod:`autofit.cost_model.budget`); a config predicted past it is not probed (the memory band aside).
2. Each round, :mod:`autofit.tuner.policy` says whether to stop and what to probe next. The
   ``prober`` runs the probe (by default :func:`subprocess_prober`: real DeepSpeed steps in a
   subprocess with its own deadline; a benchmark's replay or a remote executor plugs in here).
3. Every finished probe recalibrates the cost model (:mod:`autofit.cost_model.calibrate`).
4. The best measured configs are verified (:mod:`autofit.tuner.verify`); the winner's DeepSpeed
   JSON is checked by DeepSpeed and written atomically, and only then. Nothing fits: an
   :class:`AutofitError` with advice (:mod:`autofit.tuner.advice`), and nothing is written.

Resumption: a search started again on the same study (same storage and study name) reads its
finished probes back, skips those configs and keeps their results for calibration and the best.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autofit.core.config import Config
from autofit.core.errors import AutofitError, NothingFits
from autofit.core.software import ops_needed
from autofit.core.storage_url import redact_url
from autofit.cost_model.calibrate import Calibration, calibrate
from autofit.ds.emit import check_with_deepspeed
from autofit.planning.plan import Plan
from autofit.probe.ops import prepare_ops
from autofit.probe.rank.steps import most_steps, usual_steps
from autofit.probe.run import run_probe
from autofit.probe.warm import WarmParent
from autofit.tuner.advice import nothing_fits
from autofit.tuner.policy import is_outlier, next_probe, observe, probe_budget, shared_error, should_stop, untried_values
from autofit.tuner.records import Phase, SearchResult, TrialRecord, best_measured, observations, pruned_entries, searched_keys
from autofit.tuner.settings import SearchSettings
from autofit.tuner.study import DEFAULT_STORAGE, default_study_name, distributions, open_study, read_back, record_probe
from autofit.tuner.verify import verify

Prober = Callable[[Config, int, float], Any]
"""``(config, timed steps, timeout seconds) -> ProbeResult``: runs one candidate and measures it."""


@dataclass(frozen=True)
class SearchEvent:
    """Progress, for a display: what the search is doing now."""

    n_done: int
    """Search probes made so far."""
    trials: int
    """The most search probes it will make."""
    text: str
    """What happens now (``probing mb2x8 ...``, ``mb2x8 ...: 31.2 samples/s, 88 MiB``, ``verifying ...``)."""
    best: TrialRecord | None
    """The fastest probe within the margin so far."""


def subprocess_prober(plan: Plan, on_event: Callable[[SearchEvent], None] | None = None, trials: int = 0,
                      prepare: bool = True) -> SubprocessProber:
    """The default prober: :func:`autofit.probe.run.run_probe`, real DeepSpeed steps in a subprocess. The DeepSpeed
    ops the plan's candidates need are built or loaded first, once, as their own step: a JIT build (a minute
    or more) is then neither in a probe's timing nor in its timeout (``prepare=False``: done already,
    :func:`with_ops_prepared`)."""

    if prepare:
        plan = with_ops_prepared(plan, on_event, trials)
    return SubprocessProber(plan, on_event, trials)


class SubprocessProber:
    """Runs each probe of ``plan`` (:func:`autofit.probe.run.run_probe`), its ranks forked by one warm parent for the
    whole search (:class:`autofit.probe.warm.WarmParent`: the imports and op loads every rank needs, paid once);
    :meth:`close` ends that parent."""

    def __init__(self, plan: Plan, on_event: Callable[[SearchEvent], None] | None = None, trials: int = 0) -> None:
        self.plan, self.on_event, self.trials = plan, on_event, trials
        self.told = False
        keys = sorted({(c.optimizer, c.offload_optimizer, c.offload_params) for c in plan.candidates})
        ops = tuple(op for op in ops_needed(keys, plan.hardware.kind, plan.software)
                    if op not in plan.software.failed_ops)
        attention = plan.candidates[0].attention if plan.candidates else "eager"
        self.warm = WarmParent(plan.entry, attention, plan.hardware.kind, ops)

    def __call__(self, config: Config, steps: int, timeout_s: float) -> Any:
        spec = self.plan.probe_spec(config, steps=steps)
        result = run_probe(spec, timeout_s=timeout_s, hosts=self.plan.hosts, warm=self.warm)
        if not self.told and self.on_event is not None and (self.warm.ready or self.warm.failure):
            self.told = True
            said = (f"probe ranks forked by a warm parent (its start: {self.warm.ready['seconds']:.1f} s, once)"
                    if self.warm.ready else f"probe ranks start as fresh processes: {self.warm.failure}")
            self.on_event(SearchEvent(0, self.trials, said, None))
        return result

    def close(self) -> None:
        self.warm.close()


def with_ops_prepared(plan: Plan, on_event: Callable[[SearchEvent], None] | None = None, trials: int = 0) -> Plan:
    """Build or load the DeepSpeed ops ``plan``'s candidates need (:func:`autofit.probe.ops.prepare_ops`); the plan
    with the failed builds marked in its software, so that its probes and its JSON run AdamW as ``torch_adam``
    where FusedAdam failed to build."""

    if on_event is not None:
        on_event(SearchEvent(0, trials, "building or loading DeepSpeed ops", None))
    report = prepare_ops(list(plan.candidates), plan.hardware, plan.software)
    if on_event is not None and report.ops:
        states = ", ".join(f"{op} {state}" for op, state in report.loaded.items())
        on_event(SearchEvent(0, trials, f"DeepSpeed ops: {states} ({report.seconds:.0f} s)", None))
    software = report.software(plan.software)
    return plan if software == plan.software else replace(plan, software=software)


class _Search:
    """The state one call of :func:`run_search` carries: the study, its records and the calibration."""

    def __init__(self, plan: Plan, settings: SearchSettings, study: Any, prober: Prober,
                 on_event: Callable[[SearchEvent], None]) -> None:
        plan = plan.with_margin(settings.margin)  # what fits is judged by the search's margin, in every price
        self.plan, self.settings, self.study, self.prober, self.on_event = plan, settings, study, prober, on_event
        self.usable = plan.usable()
        self.params = distributions(plan)
        self.records = read_back(study)
        self.n_read_back = len(self.records)
        self.n_done = sum(1 for r in self.records if r.phase == "search")
        self.deadline = math.inf if settings.timeout_s is None else time.monotonic() + settings.timeout_s
        self.calibration = self.calibrate()

    def calibrate(self) -> Calibration:
        observed = observations(self.records, self.plan.hardware.memory_bytes)
        return calibrate(observed, self.plan.facts, self.usable.hardware, self.plan.world_size, self.plan.coefficients)

    def tell(self, text: str) -> None:
        self.on_event(SearchEvent(self.n_done, self.settings.trials, text, best_measured(self.records)))

    def probe(self, config: Config, phase: Phase, steps: int) -> TrialRecord:
        predicted = self.usable.predict(config, self.calibration)
        n_timeouts = sum(1 for r in self.records if r.status == "timeout")
        steps, limit = probe_budget(self.settings, steps, predicted.step_time_s, n_timeouts,
                                    self.deadline - time.monotonic())
        record = record_probe(
            self.study, self.params, config, phase, predicted, lambda: self.prober(config, steps, limit),
            self.usable.hardware.memory_bytes, planned_steps=most_steps(1, steps),  # Plan.probe_spec's warm-up step
        )
        self.records.append(record)
        return record

    def expected_wall_s(self, config: Config, steps: int) -> float:
        """Seconds a probe of ``config`` with ``steps`` timed steps is expected to take: the start-up this search's
        probes took (the median of their wall less their steps; 0 before the first) and the steps a probe usually
        runs (:func:`autofit.probe.rank.steps.usual_steps`) at the calibrated step time."""
        step_s = self.usable.predict(config, self.calibration).step_time_s
        steps, _ = probe_budget(self.settings, steps, step_s, 0, math.inf)
        start_ups = sorted(r.measured.wall_s - r.measured.phases_s.get("steps_s", 0.0)
                           for r in self.records[self.n_read_back:] if "steps_s" in r.measured.phases_s)
        start_up_s = start_ups[len(start_ups) // 2] if start_ups else 0.0
        return start_up_s + usual_steps(1, steps) * step_s if math.isfinite(step_s) else math.inf

    def has_time(self, config: Config, steps: int, then_s: float = 0.0) -> bool:
        """Whether a probe of ``config`` is expected to finish within the time budget, with ``then_s`` to spare."""
        return time.monotonic() + self.expected_wall_s(config, steps) + then_s <= self.deadline

    def verification_s(self) -> float:
        """Seconds to keep for verifying the best measured config so far (0.0 before there is one)."""
        best = best_measured(self.records)
        return self.expected_wall_s(best.config, self.settings.verify_steps) if best is not None else 0.0

    def explore(self) -> str:
        """Probe what the policy picks until it says stop; returns why it stopped."""
        while True:
            state = observe(
                self.records, self.usable, self.calibration, self.settings, device_bytes=self.plan.hardware.memory_bytes,
                n_done=self.n_done, timed_out=time.monotonic() >= self.deadline,
            )
            reason = should_stop(state, self.settings)
            if reason is not None:
                return reason
            config, _ = next_probe(state, self.settings)
            if math.isfinite(self.deadline) and not self.has_time(config, self.settings.probe_steps,
                                                                  then_s=self.verification_s()):
                return (f"the next probe ({config.label()}) and the verification would not finish within the "
                        f"--time-budget of {self.settings.timeout_s:g} s")
            self.tell(f"probing {config.label()}")
            record = self.probe(config, "search", self.settings.probe_steps)
            self.n_done += 1
            self.tell(f"{config.label()}: {record.outcome()}")
            # the calibration that predicted this probe (not yet refitted on it) judges its neighbours too
            if is_outlier(record, self.records, self.settings.outlier_factor,
                          lambda c: self.usable.predict(c, self.calibration).samples_per_s):
                self.tell(f"{config.label()} ran far from the model and its neighbours: measuring it again")
                again = self.probe(config, "repeat", self.settings.probe_steps)
                self.tell(f"{config.label()} again: {again.outcome()}")
            self.calibration = self.calibrate()

    def verify(self) -> TrialRecord | None:
        def probe(config: Config) -> TrialRecord:
            self.tell(f"verifying {config.label()}")
            return self.probe(config, "verify", self.settings.verify_steps)

        def recalibrate() -> None:
            self.calibration = self.calibrate()

        return verify(self.records, probe, self.settings, recalibrate,
                      has_time=lambda config: self.has_time(config, self.settings.verify_steps))

    def result(self, winner: TrialRecord, ds: dict[str, Any], stop_reason: str, storage: str, study_name: str,
               wall_s: float) -> SearchResult:
        """The search's record with ``winner`` and its DeepSpeed JSON ``ds`` (written nowhere yet: ``out_path``
        None)."""
        plan, usable = self.plan, self.usable
        ranked = usable.price(self.calibration)
        searched = searched_keys(self.records)
        return SearchResult(
            config=winner.config,
            measured=winner.measured,
            predicted=usable.predict(winner.config, self.calibration).record(),
            deepspeed=ds,
            trials=sorted(self.records, key=lambda r: r.number),
            pruned=pruned_entries(ranked, searched, winner, plan.rejected, usable.hardware.memory_bytes),
            hardware=plan.hardware,
            world_size=plan.world_size,
            global_batch=plan.global_batch if plan.global_batch is not None else plan.space.global_batch_size,
            margin=self.settings.margin,
            usable_bytes=usable.hardware.memory_bytes,
            n_candidates=len(plan.candidates),
            stop_reason=stop_reason,
            storage=redact_url(storage),  # the report and the JSON record it: never its password
            study_name=study_name,
            out_path=None,
            wall_s=wall_s,
            calibration=self.calibration,
            predictions=ranked,
            facts=plan.facts,
            recipe=plan.stated_recipe,
            software=plan.software,
        )


def run_search(
    plan: Plan,
    settings: SearchSettings | None = None,
    *,
    storage: str | None = None,
    study_name: str | None = None,
    prober: Prober | None = None,
    on_event: Callable[[SearchEvent], None] | None = None,
) -> SearchResult:
    """Find the fastest candidate of ``plan`` that fits its device (measured); the result holds its DeepSpeed JSON
    (:attr:`SearchResult.deepspeed`, checked by DeepSpeed), which the caller writes where it is wanted
    (:func:`autofit.report.outputs.write_deepspeed`: ``autofit run --out``).

    ``settings`` bounds and tunes the search (:class:`SearchSettings`); ``storage`` and ``study_name``
    name the Optuna study (the same name resumes a search); ``prober`` runs one probe (default: a
    subprocess, :func:`subprocess_prober`); ``on_event`` receives progress. Raises
    :class:`~autofit.core.errors.NothingFits` when nothing fits (an :class:`AutofitError` when every probe failed
    alike).
    """

    settings = settings or SearchSettings()
    started = time.monotonic()
    storage = storage or DEFAULT_STORAGE
    study_name = study_name or default_study_name(plan)
    study = open_study(plan, storage, study_name, settings.margin)
    on_event = on_event or (lambda event: None)
    owned = None
    if prober is None:
        plan = with_ops_prepared(plan, on_event, settings.trials)
        prober = owned = subprocess_prober(plan, on_event, settings.trials, prepare=False)
    search = _Search(plan, settings, study, prober, on_event)
    try:
        stop_reason = search.explore()
        winner = search.verify()
    finally:
        if owned is not None:
            owned.close()
    if winner is None:
        error = shared_error(search.records)
        if error is not None:
            untried = untried_values(search.records, list(plan.candidates))
            if not untried:  # policy.common_error: the error came with every setting
                raise AutofitError(f"every probe failed with the same error, whatever the config: {error}")
            listed = ", ".join(f"{k}={v}" for k, v in sorted(untried, key=str))
            raise AutofitError(
                f"all {len(search.records)} probes failed with the same error (not yet tried: {listed}; more "
                f"--trials try them): {error}"
            )
        raise NothingFits(
            nothing_fits(search.records, search.usable, search.calibration, plan.hardware, settings.margin)
        )
    ds = plan.deepspeed(winner.config)
    check_with_deepspeed(ds)
    return search.result(winner, ds, stop_reason, storage, study_name, time.monotonic() - started)
