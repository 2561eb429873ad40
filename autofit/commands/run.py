"""``autofit run`` and ``autofit.search``: the search, probing the most promising candidates for real.

The command calls :func:`run_target` (its own options made into :class:`autofit.tuner.SearchSettings`, a database
error made one line), which calls :func:`search_target` with the :class:`Target` its shared options make;
:func:`search` makes the same :class:`Target` from its keywords (:mod:`autofit.commands.options`) and calls
:func:`search_target` too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

from autofit.commands.options import Options, model_entry, quiet, takes_options
from autofit.core.errors import AutofitError
from autofit.ds.apply import fill_hint
from autofit.planning.ladder import Ladder, search_ladder
from autofit.planning.target import Setup, Target, prepare
from autofit.probe.snapshot import winner_snapshot
from autofit.report.folder import write_report
from autofit.report.outputs import check_outputs, commit_outputs, staged_report
from autofit.script.cli import script_plan_and_prober
from autofit.tuner import DEFAULT_STORAGE, SearchEvent, SearchResult, SearchSettings, run_search
from autofit.tuner.storage import storage_errors
from autofit.workload.entry import check_loadable, in_process_entry
from autofit.workload.types import Workload

#: what a search reports its progress to: given the trials, a context holding the callback of each event
Progress = Callable[[int], AbstractContextManager[Callable[["SearchEvent"], None]]]
#: a path as the API takes it
PathLike = str | os.PathLike[str]


@contextlib.contextmanager
def events_to(on_event: Callable[[SearchEvent], None] | None) -> Iterator[Callable[[SearchEvent], None]]:
    """A :data:`Progress` context around a plain callback (None: events go nowhere)."""
    yield on_event if on_event is not None else (lambda event: None)


def _no_progress(trials: int) -> AbstractContextManager[Callable[[SearchEvent], None]]:
    """The default :data:`Progress`: events go nowhere."""
    return events_to(None)


def run_target(target: Target, *, trials: int, timeout_s: float | None, out: PathLike | None,
               report: PathLike | None, storage: str | None, study_name: str | None, script: str | None,
               progress: Progress, say: Callable[[str], None]) -> SearchResult:
    """``autofit run``: :func:`search_target` with the command's knobs (the margin is the target's, as every command's);
    a database error is one line, its URL's password hidden (:func:`autofit.tuner.storage.storage_errors`)."""
    settings = SearchSettings(trials=trials, timeout_s=timeout_s, margin=target.margin)
    with storage_errors(storage or DEFAULT_STORAGE):
        return search_target(target, settings, out=out, report=report, storage=storage, study_name=study_name,
                             script=script, progress=progress, say=say)


def search_target(target: Target, settings: SearchSettings, *, out: PathLike | None, report: PathLike | None = None,
                  storage: str | None = None, study_name: str | None = None, script: str | None = None,
                  workload: Workload | None = None, progress: Progress | None = None,
                  say: Callable[[str], None] = quiet) -> SearchResult:
    """The search (:func:`autofit.tuner.run_search`) of ``target``'s entry point, or of ``script`` (script mode,
    :mod:`autofit.script`), exactly one of them, judging what fits with ``settings.margin`` (the plan's too); the
    winner's DeepSpeed JSON written to ``out`` (None: nowhere), and
    with ``report`` a report folder (:func:`write_search_report`), whose ``index.html`` is the result's
    ``report_path``. ``progress``: a context per search giving the callback of its events (the CLI's progress bar);
    ``say``: progress lines."""
    if (target.entry is None) == (script is None):
        raise AutofitError('autofit run takes an ENTRY or --script "CMD ... {config}", exactly one of them')
    check_outputs(out, report)  # before anything is traced: a folder for --out, a report over the user's files
    target = dataclasses.replace(target, margin=settings.margin)  # one margin: what the plan and the search judge by
    setup = prepare(target, workload, probes_here=True)
    with contextlib.ExitStack() as stack:
        if script is not None:

            plan, prober = script_plan_and_prober(setup, script, stack)
        else:
            check_loadable(setup.entry_point, "a search")
            setup.check_nodes()
            say(f"autofit: {setup.tracing_note()}")
            plan, prober = setup.plan(), None
        say(f"autofit: {len(plan.candidates)} candidates")
        with (progress or _no_progress)(settings.trials) as on_event:
            result = run_search(plan, settings, storage=storage, study_name=study_name, prober=prober,
                                on_event=on_event)
    result = dataclasses.replace(result, out_path=None if out is None else str(out))
    hint = fill_hint(os.fspath(out), result.deepspeed) if out is not None else None
    if hint:  # plain deepspeed.initialize hands "auto" to the optimizer: say how to fill it, where it is written
        say(hint)
    with staged_report(report) as staged:  # the report, then --out: all or nothing
        index = (None if staged is None else
                 staged.final(write_search_report(setup, result, staged.folder, scripted=script is not None, say=say)))
        commit_outputs(result.deepspeed, out, staged)
    return result if index is None else dataclasses.replace(result, report_path=str(index))


def write_search_report(setup: Setup, result: SearchResult, report: PathLike, *, scripted: bool,
                        say: Callable[[str], None]) -> Path:
    """The report folder of a search (:func:`autofit.report.folder.write_report`: HTML, PNGs and the ladder; on a
    CUDA device the winner's allocator snapshot) written into ``report``; its ``index.html``."""
    snapshot = (winner_snapshot(setup.entry_point, result.config, result.hardware, result.world_size, result.facts,
                                os.fspath(report), software=setup.software, say=say)
                if setup.hardware.kind == "cuda" and not scripted else None)
    return write_report(result, report, ladder=None if scripted else _report_ladder(setup, result, say),
                        snapshot=snapshot)


def _report_ladder(setup: Setup, result: SearchResult, say: Callable[[str], None]) -> Ladder | None:
    """The ladder that ends the report, or None (said) where it cannot be made: the winner is written."""
    try:
        return search_ladder(setup.entry_point, setup.loaded_workload, result.config, setup.fixed,
                             hardware=result.hardware, world_size=result.world_size, facts=result.facts,
                             margin=result.margin, calibration=result.calibration, recipe=setup.recipe,
                             software=setup.software)
    except AutofitError as exc:
        say(f"autofit: the report has no ladder: {exc}")
        return None


@takes_options()
def search(model: str, options: Options, *, trials: int = 20, out: PathLike | None = None,
           report: PathLike | None = None, storage: str | None = None, study_name: str | None = None,
           timeout_s: float | None = None, settings: SearchSettings | None = None,
           on_event: Callable[[SearchEvent], None] | None = None,
           say: Callable[[str], None] | None = None) -> SearchResult:
    """The search (``autofit run``): probe the most promising candidates for real, each in a subprocess, and return
    the fastest one that fits, verified. The options are :func:`autofit.estimate`'s keywords
    (:mod:`autofit.commands.options`); ``margin`` among them is the share of the device memory every candidate must
    leave free (predicted, and the verified winner measured).

    :param model: an entry point (``"path/to/file.py:function"``, ``"package.module:function"``) or an ``"hf:"``
        config: each probe's subprocess loads the model from it. A :class:`autofit.Workload` object is refused
        (:class:`AutofitError`): put the function returning it in a file and pass ``"that_file.py:function"``.
    :param trials: the most search probes.
    :param out: where the winner's DeepSpeed JSON is written; None: nowhere (``result.deepspeed`` holds it).
    :param report: a folder for the report (HTML + PNG); its ``index.html`` is ``result.report_path``.
    :param storage: the Optuna storage URL; None: ``sqlite:///autofit.db`` in the working directory, as the CLI.
        The same storage and study resume a search: its finished probes are not run again.
    :param study_name: the study's name; None: one made from the model, device, space and request.
    :param timeout_s: stop searching after this many seconds; None: no limit.
    :param settings: every knob of the search (:class:`autofit.tuner.SearchSettings`); given, it replaces
        ``trials``, ``timeout_s`` and ``margin``.
    :param on_event: called with each :class:`autofit.tuner.SearchEvent` (progress: probes done, the best so far).
    :param say: where progress lines go (``print`` shows them); None: nowhere.
    :returns: :class:`autofit.tuner.SearchResult`: ``.config`` (the winner), ``.deepspeed`` (its DeepSpeed dict),
        ``.measured``, ``.trials`` (every probe), ``.pruned``, ``.report_path``; ``.to_dict()`` is ``--json``'s.
    :raises AutofitError: a bad option, a ``Workload`` object, or nothing fits (with what the smallest candidate
        would need; nothing is written).
    """
    if isinstance(model, Workload):
        check_loadable(in_process_entry(model), "autofit.search")
    entry, workload = model_entry(model)
    target = options.target(entry)
    if settings is None:
        settings = SearchSettings(trials=trials, timeout_s=timeout_s, margin=target.margin)
    return search_target(target, settings, out=out, report=report, storage=storage,
                         study_name=study_name, workload=workload, progress=lambda _: events_to(on_event),
                         say=say or quiet)
