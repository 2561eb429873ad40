"""The Optuna study behind a search: pinned configs, resumption, and what a killed run leaves behind."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import optuna
import pytest
from optuna.trial import TrialState

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.planning.plan import Plan
from autofit.probe.result import ProbeResult
from autofit.tuner import study as studies

#: what record_probe stores of a probe that ran within the margin, before its measurement
_BEFORE_MEASURED = {studies.STATUS_ATTR: "ok", studies.PLANNED_STEPS_ATTR: 2, studies.WITHIN_MARGIN_ATTR: True,
                    studies.STARTED_S_ATTR: 1.0}


def _measured(config: Config, status: str = "ok", peak: int = 10 * 2**20) -> Callable[[], ProbeResult]:
    return lambda: ProbeResult(config, status, peak, 0.5 if status == "ok" else 0.0,
                               32.0 if status == "ok" else 0.0, None, None, 1.0)


def test_each_probe_is_a_trial_with_its_config_as_params(storage: str, tiny_plan) -> None:  # noqa: ANN001
    plan: Plan = tiny_plan(1024, [1, 2, 4])
    study = studies.open_study(plan, storage, "s", 0.1)
    params = studies.distributions(plan)
    usable = 900 * 2**20
    for config in plan.candidates:
        record = studies.record_probe(study, params, config, "search", plan.predict(config), _measured(config), usable)
        assert record.within_margin and record.samples_per_s == 32.0
    past = studies.record_probe(study, params, plan.candidates[0], "verify", plan.predict(plan.candidates[0]),
                                _measured(plan.candidates[0], peak=2**30), usable)
    assert not past.within_margin
    trials = study.get_trials()
    assert [Config.from_dict(t.params) for t in trials] == [*plan.candidates, plan.candidates[0]]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3 + [TrialState.PRUNED]
    back = studies.read_back(optuna.load_study(study_name="s", storage=storage))
    assert [(r.config, r.phase, r.within_margin, r.resumed) for r in back] == [
        (c, "search", True, True) for c in plan.candidates
    ] + [(plan.candidates[0], "verify", False, True)]


def test_read_back_closes_what_a_killed_run_left_open(storage: str, tiny_plan) -> None:  # noqa: ANN001
    plan: Plan = tiny_plan(1024, [1, 2, 4])
    study = studies.open_study(plan, storage, "s", 0.1)
    first, second, third = plan.candidates
    # killed after storing the measurement, before tell: the measurement is kept and told
    study.enqueue_trial(first.to_dict(), user_attrs={studies.CONFIG_ATTR: first.to_dict(), studies.PHASE_ATTR: "search",
                                                     studies.PREDICTED_ATTR: plan.predict(first).to_dict()})
    trial = study.ask(studies.distributions(plan))
    result = _measured(first)()
    for key, value in _BEFORE_MEASURED.items():
        trial.set_user_attr(key, value)
    trial.set_user_attr(studies.MEASURED_ATTR, result.to_json())
    # killed mid-probe: no measurement, the trial fails and its config will be probed again
    study.enqueue_trial(second.to_dict(), user_attrs={studies.CONFIG_ATTR: second.to_dict(), studies.PHASE_ATTR: "search"})
    study.ask(studies.distributions(plan))
    # killed between enqueue and ask: a waiting trial that must not be handed to the next probe
    study.enqueue_trial(third.to_dict(), user_attrs={studies.CONFIG_ATTR: third.to_dict(), studies.PHASE_ATTR: "search"})

    records = studies.read_back(study)
    assert [r.config for r in records] == [first]
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.FAIL]
    # the next probe gets the config it asked for, not the stale one
    record = studies.record_probe(study, studies.distributions(plan), second, "search", plan.predict(second),
                                  _measured(second), 2**30)
    assert Config.from_dict(study.get_trials()[-1].params) == record.config == second


def test_a_probe_reads_back_as_it_was_recorded(storage: str, tiny_plan) -> None:  # noqa: ANN001
    plan: Plan = tiny_plan(1024, [1, 2, 4])
    study = studies.open_study(plan, storage, "s", 0.1)
    config = plan.candidates[0]
    recorded = studies.record_probe(study, studies.distributions(plan), config, "search", plan.predict(config),
                                    _measured(config), 2**30, planned_steps=4)
    [back] = studies.read_back(studies.open_study(plan, storage, "s", 0.1))
    assert back == replace(recorded, resumed=True)
    assert back.measured == recorded.measured and back.planned_steps == 4


def test_a_stored_probe_with_a_renamed_key_is_refused_naming_the_trial_and_the_key(storage: str, tiny_plan) -> None:  # noqa: ANN001
    plan: Plan = tiny_plan(1024, [1, 2, 4])
    study = studies.open_study(plan, storage, "s", 0.1)
    config = plan.candidates[0]
    # as record_probe stores a probe (a run killed before tell), with one key of the measurement renamed
    study.enqueue_trial(config.to_dict(), user_attrs={studies.CONFIG_ATTR: config.to_dict(), studies.PHASE_ATTR: "search",
                                                      studies.PREDICTED_ATTR: plan.predict(config).to_dict()})
    trial = study.ask(studies.distributions(plan))
    for key, value in _BEFORE_MEASURED.items():
        trial.set_user_attr(key, value)
    measured = _measured(config)().to_json()
    measured["peak_byte"] = measured.pop("peak_bytes")
    trial.set_user_attr(studies.MEASURED_ATTR, measured)
    with pytest.raises(AutofitError, match="trial 0 .*peak_byte"):
        studies.read_back(study)


def test_a_study_of_another_search_is_refused(storage: str, tiny_plan) -> None:  # noqa: ANN001
    studies.open_study(tiny_plan(1024, [1, 2, 4]), storage, "s", 0.1)
    with pytest.raises(AutofitError, match="give a new --study name"):
        studies.open_study(tiny_plan(1024, [1, 2]), storage, "s", 0.1)
