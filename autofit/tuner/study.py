"""The Optuna study behind a search: open it (or resume it), record each probe, read probes back.

One trial per probe. The config to run is pinned with Optuna's own ``enqueue_trial`` and then
``ask``: every config key is a categorical parameter of the trial (a dashboard can slice by them),
and the config, phase, prediction and measurement are user attrs. The measurement is stored
before ``tell``, so a process killed between the two loses nothing: :func:`read_back` finds it.
A trial left ``RUNNING`` without a measurement (killed mid-probe) is failed and its config probed
again; a trial left ``WAITING`` (killed between enqueue and ask) is failed too.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any, get_args

from autofit.core.boundary import as_status
from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.storage_url import redact_url
from autofit.cost_model import Prediction, PredictionRecord
from autofit.planning.plan import Plan
from autofit.probe.result import ProbeResult
from autofit.tuner.records import Phase, TrialRecord
from autofit.tuner.storage import rdb_storage

DEFAULT_STORAGE = "sqlite:///autofit.db"

# The user attributes a study keeps, each key named once (as Optuna names its own, e.g. its ``_CONSTRAINTS_KEY``):
# readers (a resumed search, ``autofit schedule list``, the tests) use these, never the bare string.
#: a trial's: the config it ran (:meth:`Config.to_dict`)
CONFIG_ATTR = "config"
#: a trial's: why it ran (:data:`autofit.tuner.records.Phase`)
PHASE_ATTR = "phase"
#: a trial's: the cost model's prediction of it (:meth:`Prediction.to_dict`)
PREDICTED_ATTR = "predicted"
#: a trial's: the config's label, for a dashboard
LABEL_ATTR = "label"
#: a trial's: how its probe ended (:data:`autofit.core.boundary.Status`)
STATUS_ATTR = "status"
#: a trial's: the probe's steps, warm-up included
PLANNED_STEPS_ATTR = "planned_steps"
#: a trial's: whether it ran within the usable budget (its samples/s is the trial's value)
WITHIN_MARGIN_ATTR = "within_margin"
#: a trial's: when its probe started (epoch seconds)
STARTED_S_ATTR = "started_s"
#: a trial's: the probe's result (:meth:`ProbeResult.to_json`); stored last, so a trial with it is finished
MEASURED_ATTR = "measured"
#: the study's: what it is a search of (:func:`signature`); a study started for another search is refused
SIGNATURE_ATTR = "signature"


def device_identity(plan: Plan) -> dict[str, Any]:
    """The device a study's probes measure, as far as it changes a result: its kind and model (``h100-80gb``,
    ``h100-80gb PCIe``; a detected device and its preset alike), its memory in GiB (on a CUDA device; a CPU's
    "device memory" is the host's RAM, counted only as a budget given), the precisions it runs, flash
    attention, and the ranks that share a node. Not the host's RAM or cores, nor devices on a node beyond
    those the search uses: a worker on a host that differs only there takes a search over, keeping its probes."""
    hardware = plan.hardware
    return {
        "kind": hardware.kind,
        "model": hardware.name.split(" (")[0],
        "memory_gib": round(hardware.memory_bytes / 2**30)
        if hardware.kind == "cuda" or hardware.memory_bytes != hardware.host_memory_bytes else None,  # a budget
        "precisions": sorted(hardware.peak_flops),
        "flash": hardware.supports_flash,
        "ranks_per_node": hardware.ranks_on_a_node(plan.world_size),
    }


def signature(plan: Plan) -> str:
    """What a study is a search of: entry, device (:func:`device_identity`), space, world size, global batch and
    ``--set``."""
    text = json.dumps(
        {
            "entry": plan.entry,
            "hardware": device_identity(plan),
            "space": plan.space.to_dict(),
            "world_size": plan.world_size,
            "global_batch": plan.global_batch,
            "fixed": {k: plan.fixed[k] for k in sorted(plan.fixed)},
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def default_study_name(plan: Plan) -> str:
    return f"autofit-{plan.name}-{signature(plan)[:10]}"


def open_study(plan: Plan, storage: str, study_name: str, margin: float) -> Any:
    """Create the study, or load it when it exists and was started for the same search."""
    import optuna


    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        storage=rdb_storage(storage),  # pool_pre_ping: a database restart does not fail the search
        study_name=study_name,
        direction="maximize",
        sampler=optuna.samplers.RandomSampler(seed=0),  # never consulted: every trial is enqueued
        load_if_exists=True,
    )
    mine = signature(plan)
    earlier = study.user_attrs.get(SIGNATURE_ATTR)
    if earlier is not None and earlier != mine:
        raise AutofitError(
            f"study {study_name!r} in {redact_url(storage)} was started with another entry, device, space, world size, "
            "global batch or --set; give a new --study name"
        )
    if earlier is None:
        for key, value in {
            SIGNATURE_ATTR: mine, "entry": plan.entry, "hardware": plan.hardware.name,
            "memory_bytes": plan.hardware.memory_bytes, "world_size": plan.world_size, "margin": margin,
        }.items():
            study.set_user_attr(key, value)
    return study


def distributions(plan: Plan) -> dict[str, Any]:
    """Every config key as a categorical parameter whose choices are the values the candidates take."""
    from optuna.distributions import CategoricalDistribution

    return {
        name: CategoricalDistribution(sorted({getattr(c, name) for c in plan.candidates}, key=str))
        for name in Config.__dataclass_fields__
    }


def record_probe(
    study: Any,
    params: dict[str, Any],
    config: Config,
    phase: Phase,
    predicted: Prediction,
    run: Callable[[], Any],
    usable_bytes: int,
    planned_steps: int = 0,
) -> TrialRecord:
    """Pin ``config`` as the next trial, ``run()`` the probe (a :class:`~autofit.probe.result.ProbeResult`), store
    the measurement (with ``planned_steps``, warm-up included: what bounds a timeout's step), then ``tell``:
    within the margin its samples/s, past it pruned, a failed probe failed."""
    from optuna.trial import TrialState

    study.enqueue_trial(
        config.to_dict(),
        user_attrs={CONFIG_ATTR: config.to_dict(), PHASE_ATTR: phase, PREDICTED_ATTR: predicted.to_dict(),
                    LABEL_ATTR: config.label()},
    )
    trial = study.ask(params)
    started_s = time.time()
    result = run()
    within = result.status == "ok" and result.peak_bytes <= usable_bytes
    # ``measured`` last: read_back takes a trial with it as finished, so everything else must be there by then
    stored = {STATUS_ATTR: result.status, PLANNED_STEPS_ATTR: planned_steps, WITHIN_MARGIN_ATTR: within,
              STARTED_S_ATTR: started_s, MEASURED_ATTR: result.to_json()}
    for key, value in stored.items():
        trial.set_user_attr(key, value)
    if within:
        study.tell(trial, result.samples_per_s)
    elif result.status == "ok":
        study.tell(trial, state=TrialState.PRUNED)  # ran, but past the safety margin
    else:
        study.tell(trial, state=TrialState.FAIL)
    return TrialRecord(
        number=trial.number,
        config=config,
        phase=phase,
        status=result.status,
        measured=result,
        predicted=predicted.record(),
        within_margin=within,
        started_s=started_s,
        wall_s=result.wall_s,
        planned_steps=planned_steps,
    )


def read_back(study: Any) -> list[TrialRecord]:
    """The finished probes of an earlier run of this study; trials a killed run left open are closed."""
    from optuna.trial import TrialState

    records = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        if t.state == TrialState.WAITING:  # enqueued, never asked: take it and fail it
            study.tell(study.ask(), state=TrialState.FAIL)
            continue
        if CONFIG_ATTR not in attrs:
            continue
        if MEASURED_ATTR in attrs:
            records.append(_record(t.number, attrs))
            if t.state == TrialState.RUNNING:  # killed between the measurement and tell
                study.tell(t.number, *_verdict(attrs))
        elif t.state == TrialState.RUNNING:  # killed mid-probe: nothing measured, the config is probed again
            study.tell(t.number, state=TrialState.FAIL)
    return records


def _record(number: int, attrs: dict[str, Any]) -> TrialRecord:
    """A stored probe as a record; what :func:`record_probe` stored, every key of it (a study an older autofit
    wrote, or one with a key renamed, is an :class:`AutofitError` naming the trial and the key)."""
    try:
        measured = ProbeResult.from_json(attrs[MEASURED_ATTR])
        for key in _STORED:
            if key not in attrs:
                raise AutofitError(f"missing key {key!r}")
        return TrialRecord(
            number=number,
            config=Config.from_dict(attrs[CONFIG_ATTR]),
            phase=_phase(attrs[PHASE_ATTR]),
            status=as_status(attrs[STATUS_ATTR]),
            measured=measured,
            predicted=PredictionRecord.from_json(attrs[PREDICTED_ATTR]) if attrs[PREDICTED_ATTR] else None,
            within_margin=bool(attrs[WITHIN_MARGIN_ATTR]),
            started_s=float(attrs[STARTED_S_ATTR]),
            wall_s=measured.wall_s,
            resumed=True,
            planned_steps=int(attrs[PLANNED_STEPS_ATTR]),
        )
    except AutofitError as exc:
        raise AutofitError(f"trial {number} of the study cannot be read back: {exc}") from None


def _phase(value: object) -> Phase:
    for phase in get_args(Phase):
        if value == phase:
            return phase  # type: ignore[no-any-return]
    raise AutofitError(f"phase must be one of {', '.join(get_args(Phase))}, but got {value!r}")


#: the user attrs :func:`record_probe` stores beside ``measured``
_STORED = (CONFIG_ATTR, PHASE_ATTR, PREDICTED_ATTR, STATUS_ATTR, PLANNED_STEPS_ATTR, WITHIN_MARGIN_ATTR, STARTED_S_ATTR)


def _verdict(attrs: dict[str, Any]) -> tuple[Any, Any]:
    """``(value, state)`` to tell for a trial whose measurement was stored: as :func:`record_probe` tells it."""
    from optuna.trial import TrialState

    if attrs[WITHIN_MARGIN_ATTR]:
        return ProbeResult.from_json(attrs[MEASURED_ATTR]).samples_per_s, TrialState.COMPLETE
    if attrs[STATUS_ATTR] == "ok":
        return None, TrialState.PRUNED
    return None, TrialState.FAIL
