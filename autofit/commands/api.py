"""The Python API: ``autofit.estimate``, ``autofit.search`` and ``autofit.ladder``, for notebooks and scripts.

Each takes the model and the options every ``autofit`` command takes (docs/design.md, "CLI"), as keywords:
the fields of :class:`autofit.planning.target.Target`, typed. The model is one of

- an entry point string, ``"path/to/file.py:function"`` or ``"package.module:function"``, whose function returns
  an :class:`autofit.Workload`;
- an ``"hf:ORG/NAME"`` or ``"hf:PATH"`` Hugging Face config (:mod:`autofit.workload.hf`; ``seq_len``, ``task`` and
  ``trust_remote_code`` apply to it);
- an :class:`autofit.Workload` object. :func:`estimate` and :func:`ladder` price it here, in this process. A probe
  runs the model in a subprocess, which loads it from an entry point and cannot be handed an object made in this
  one (a notebook's function is not importable anywhere else): :func:`search`, and :func:`ladder` with
  ``measure=True``, refuse a ``Workload`` object with one :class:`AutofitError` saying to pass its entry point.
  On a CPU device the model's kernel footprint (:mod:`autofit.probe.footprint`) is measured in a subprocess as
  well; for a ``Workload`` object it is not, and the cost model's default stands.

Every mistake is one :class:`AutofitError` naming the value. The ``autofit`` commands ``estimate``, ``run`` and
``ladder`` are the functions ending in ``_target`` below, called with the :class:`Target` their options make;
the public functions build that :class:`Target` and call the same ones, so the API and the CLI cannot drift.

This module imports no torch: ``import autofit`` stays light (the functions import the stack when called).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from autofit.core.errors import AutofitError
from autofit.ds.apply import fill_hint
from autofit.planning.target import Target, prepare
from autofit.workload.entry import check_loadable, in_process_entry
from autofit.workload.types import Workload

if TYPE_CHECKING:
    from autofit.planning.estimate import EstimateResult
    from autofit.planning.ladder import Ladder
    from autofit.planning.target import Setup
    from autofit.tuner import SearchEvent, SearchResult, SearchSettings

__all__ = ["estimate", "estimate_target", "ladder", "ladder_target", "search", "search_target"]

#: what a search reports its progress to: given the trials, a context holding the callback of each event
Progress = Callable[[int], AbstractContextManager[Callable[["SearchEvent"], None]]]
#: a hyperparameter as the API takes it: a number, ``B1,B2`` / a pair for betas, or the CLI's string
Hyperparameter = float | str | tuple[float, float] | None


def _quiet(line: str) -> None:
    """The default ``say``: progress lines go nowhere."""


@contextlib.contextmanager
def _events_to(on_event: Callable[[SearchEvent], None] | None) -> Iterator[Callable[[SearchEvent], None]]:
    """A :data:`Progress` context around a plain callback (None: events go nowhere)."""
    yield on_event if on_event is not None else (lambda event: None)


def _no_progress(trials: int) -> AbstractContextManager[Callable[[SearchEvent], None]]:
    """The default :data:`Progress`: events go nowhere."""
    return _events_to(None)


# -- the commands, over a Target: what the CLI calls ---------------------------------------------------------------


def estimate_target(target: Target, workload: Workload | None = None) -> EstimateResult:
    """``autofit estimate``: trace the model once and price every candidate of the space (no training step);
    ranked, fitting first (:func:`autofit.planning.estimate.estimate`). ``workload``: a :class:`Workload` object used instead
    of loading ``target.entry`` (:func:`autofit.planning.target.prepare`)."""
    from autofit.planning.estimate import estimate as price

    return price(prepare(target, workload).plan())


def ladder_target(target: Target, workload: Workload | None = None, *, measure: bool = False, steps: int = 3,
                  timeout_s: float = 600.0, say: Callable[[str], None] = _quiet) -> Ladder:
    """``autofit ladder``: the build-along table of memory techniques (:func:`autofit.planning.ladder.run_ladder`), its
    demands on ``target`` (a global batch, no space) checked before anything is loaded or traced."""
    from autofit.planning.ladder import check_target, run_ladder

    check_target(target)
    return run_ladder(prepare(target, workload, probes_here=measure), measure=measure, steps=steps, timeout_s=timeout_s, say=say)


def search_target(target: Target, settings: SearchSettings, *, out: str | os.PathLike[str] | None,
                  report: str | os.PathLike[str] | None = None, storage: str | None = None,
                  study_name: str | None = None, script: str | None = None, workload: Workload | None = None,
                  progress: Progress | None = None, say: Callable[[str], None] = _quiet) -> SearchResult:
    """``autofit run``: the search (:func:`autofit.tuner.run_search`) of ``target``'s entry point, or of
    ``script`` (script mode, :mod:`autofit.script`), exactly one of them; the winner's DeepSpeed JSON written to
    ``out`` (None: nowhere), and with ``report`` a report folder (:func:`autofit.report.folder.write_report`: HTML, PNGs
    and the ladder; on a CUDA device the winner's allocator snapshot), whose ``index.html`` is the result's
    ``report_path``. ``progress``: a context per search giving the callback of its events (the CLI's progress bar);
    ``say``: progress lines."""
    from autofit.tuner import run_search

    if (target.entry is None) == (script is None):
        raise AutofitError('autofit run takes an ENTRY or --script "CMD ... {config}", exactly one of them')
    setup = prepare(target, workload, probes_here=True)
    with contextlib.ExitStack() as stack:
        if script is not None:
            from autofit.script.cli import script_plan_and_prober

            plan, prober = script_plan_and_prober(setup, script, stack)
        else:
            check_loadable(setup.entry_point, "a search")
            check_nodes(setup)
            say(f"autofit: {setup.tracing_note()}")
            plan, prober = setup.plan(), None
        say(f"autofit: {len(plan.candidates)} candidates")
        with (progress or _no_progress)(settings.trials) as on_event:
            result = run_search(plan, settings, out_path=out, storage=storage, study_name=study_name,
                                prober=prober, on_event=on_event)
    hint = fill_hint(os.fspath(out), result.deepspeed) if out is not None else None
    if hint:  # plain deepspeed.initialize hands "auto" to the optimizer: say how to fill it, where it was written
        say(hint)
    if report is None:
        return result
    from autofit.probe.snapshot import winner_snapshot
    from autofit.report.folder import write_report

    scripted = script is not None
    snapshot = (winner_snapshot(setup.entry_point, result, os.fspath(report), software=setup.software, say=say)
                if setup.hardware.kind == "cuda" and not scripted else None)
    index = write_report(result, report, ladder=None if scripted else _report_ladder(setup, result, say),
                         snapshot=snapshot)
    return dataclasses.replace(result, report_path=str(index))


def check_nodes(setup: Setup) -> None:
    """Where the probes of several nodes cannot run here, one line before the search starts (nothing written):
    :func:`autofit.probe.elastic.node_launch`."""
    n_nodes = setup.hardware.n_nodes(setup.world_size)
    if n_nodes > 1:
        from autofit.probe.elastic import node_launch

        node_launch(setup.hardware.kind, n_nodes, setup.hardware.ranks_on_a_node(setup.world_size), setup.hosts)


def _report_ladder(setup: Setup, result: SearchResult, say: Callable[[str], None]) -> Ladder | None:
    """The ladder that ends the report, or None (said) where it cannot be made: the winner is written."""
    from autofit.planning.ladder import search_ladder

    try:
        return search_ladder(setup.entry_point, setup.loaded_workload, result, setup.fixed)
    except AutofitError as exc:
        say(f"autofit: the report has no ladder: {exc}")
        return None


# -- the Python API ----------------------------------------------------------------------------------------------


def estimate(
    model: str | Workload,
    *,
    hardware: str = "auto",
    memory: str | int | None = None,
    gpus: int | None = None,
    nodes: int = 1,
    hosts: str | None = None,
    global_batch: int | None = None,
    space: str | os.PathLike[str] | None = None,
    set: Mapping[str, Any] | Sequence[str] | None = None,
    nvme_path: str | os.PathLike[str] | None = None,
    software: str | os.PathLike[str] | None = None,
    seq_len: int | None = None,
    task: str | None = None,
    trust_remote_code: bool = False,
    recipe_from: str | os.PathLike[str] | None = None,
    optimizer: str | None = None,
    precision: str | None = None,
    allow: str | Sequence[str] = (),
    lr: Hyperparameter = None,
    weight_decay: Hyperparameter = None,
    betas: Hyperparameter = None,
    eps: Hyperparameter = None,
    momentum: Hyperparameter = None,
) -> EstimateResult:
    """Price every candidate of the space with the cost model; no training step runs (``autofit estimate``).

    :param model: an entry point (``"path/to/file.py:function"``, ``"package.module:function"``), an ``"hf:"``
        config, or a :class:`autofit.Workload` object (module docstring).
    :param hardware: a preset (``"h100-80gb"``, ``"a100-40gb"``, ...), ``"cpu"`` or ``"auto"`` (detect).
    :param memory: the device memory budget, ``"2GiB"``, ``"800MiB"`` or bytes; None: the device's own.
    :param gpus: devices per node; None: the visible GPUs with ``hardware="auto"`` on a CUDA machine, else 1.
    :param nodes: nodes; the world size is ``gpus x nodes``.
    :param hosts: where probes of several nodes run, ``"a,b"`` or a hostfile (None: the Slurm allocation,
        else simulated nodes here; the CLI's ``--hosts``).
    :param global_batch: samples per optimizer step over every device; None: the space's own.
    :param space: a space name in ``search_spaces/`` or a YAML file; None: the default space.
    :param set: config keys to fix, ``{"zero_stage": 2}`` or ``["zero_stage=2"]`` (the CLI's ``--set``).
    :param nvme_path: a directory on an NVMe drive where NVMe offload swaps (else NVMe offload is pruned).
    :param software: the training machines' software, ``"here"``, ``"cluster"`` or a JSON file (``--software``).
    :param seq_len: an ``hf:`` model's tokens per sample.
    :param task: an ``hf:`` model's task (default: its config's architectures).
    :param trust_remote_code: let an ``hf:`` model run its repository's code.
    :param recipe_from: a DeepSpeed JSON or a Trainer's ``TrainingArguments`` JSON stating the recipe
        (:func:`autofit.ds.recipe_from.read_recipe`; the CLI's ``--recipe-from``); keywords that disagree with it are
        an error.
    :param optimizer: the optimizer you train with (default AdamW); never traded away (docs/recipe.md).
    :param precision: the precision you train in (default: the device's mixed precision; fp32 on a CPU).
    :param allow: substitutes the search may try (``"adamw8bit"``, ``"fp8"``, ``"near"``, ...).
    :param lr: the learning rate the JSON carries (None: ``"auto"``); ``weight_decay``, ``betas`` (a pair or
        ``"B1,B2"``), ``eps`` and ``momentum`` likewise.
    :returns: every candidate with its predicted peak memory and step time, fitting first, fastest first
        (:class:`autofit.planning.estimate.EstimateResult`; ``.fitting[0].deepspeed`` is the best one's DeepSpeed dict).
    """
    target, workload = _request(
        model, hardware=hardware, memory=memory, gpus=gpus, nodes=nodes, hosts=hosts, global_batch=global_batch, space=space,
        set=set, nvme_path=nvme_path, software=software, seq_len=seq_len, task=task, trust_remote_code=trust_remote_code,
        recipe_from=recipe_from,
        optimizer=optimizer, precision=precision, allow=allow, lr=lr, weight_decay=weight_decay, betas=betas,
        eps=eps, momentum=momentum,
    )
    return estimate_target(target, workload)


def ladder(
    model: str | Workload,
    *,
    measure: bool = False,
    steps: int = 3,
    timeout_s: float = 600.0,
    say: Callable[[str], None] | None = None,
    hardware: str = "auto",
    memory: str | int | None = None,
    gpus: int | None = None,
    nodes: int = 1,
    hosts: str | None = None,
    global_batch: int | None = None,
    set: Mapping[str, Any] | Sequence[str] | None = None,
    nvme_path: str | os.PathLike[str] | None = None,
    software: str | os.PathLike[str] | None = None,
    seq_len: int | None = None,
    task: str | None = None,
    trust_remote_code: bool = False,
    recipe_from: str | os.PathLike[str] | None = None,
    optimizer: str | None = None,
    precision: str | None = None,
    allow: str | Sequence[str] = (),
    lr: Hyperparameter = None,
    weight_decay: Hyperparameter = None,
    betas: Hyperparameter = None,
    eps: Hyperparameter = None,
    momentum: Hyperparameter = None,
) -> Ladder:
    """The build-along table of memory techniques (``autofit ladder``): from fp32 + AdamW + ZeRO-0, one technique
    added per rung, each priced and, with ``measure``, probed.

    :param model: an entry point, an ``"hf:"`` config or a :class:`autofit.Workload` object (not with
        ``measure=True``: a probe loads the model from an entry point).
    :param measure: probe every rung predicted to fit (real DeepSpeed steps, one subprocess each).
    :param steps: measured steps per probe.
    :param timeout_s: seconds for each probe.
    :param say: where progress lines go (``print`` shows them); None: nowhere.
    :param global_batch: samples per optimizer step over every device: required (the rungs' micro-batch is
        ``global_batch / world size``). The ladder has no ``space``: its rungs are its space. The other options are
        :func:`estimate`'s; ``set`` may fix the micro-batch, the accumulation or the attention, not what the rungs
        step through.
    :returns: :class:`autofit.planning.ladder.Ladder`, one row per rung (``.rows``; ``.to_dict()`` is ``--json``'s).
    """
    target, workload = _request(
        model, hardware=hardware, memory=memory, gpus=gpus, nodes=nodes, hosts=hosts, global_batch=global_batch, space=None,
        set=set, nvme_path=nvme_path, software=software, seq_len=seq_len, task=task, trust_remote_code=trust_remote_code,
        recipe_from=recipe_from,
        optimizer=optimizer, precision=precision, allow=allow, lr=lr, weight_decay=weight_decay, betas=betas,
        eps=eps, momentum=momentum,
    )
    if measure and target.entry is not None:
        check_loadable(target.entry, "ladder(measure=True)")
    return ladder_target(target, workload, measure=measure, steps=steps, timeout_s=timeout_s, say=say or _quiet)


def search(
    model: str,
    *,
    trials: int = 20,
    out: str | os.PathLike[str] | None = None,
    report: str | os.PathLike[str] | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    timeout_s: float | None = None,
    margin: float = 0.10,
    settings: SearchSettings | None = None,
    on_event: Callable[[SearchEvent], None] | None = None,
    say: Callable[[str], None] | None = None,
    hardware: str = "auto",
    memory: str | int | None = None,
    gpus: int | None = None,
    nodes: int = 1,
    hosts: str | None = None,
    global_batch: int | None = None,
    space: str | os.PathLike[str] | None = None,
    set: Mapping[str, Any] | Sequence[str] | None = None,
    nvme_path: str | os.PathLike[str] | None = None,
    software: str | os.PathLike[str] | None = None,
    seq_len: int | None = None,
    task: str | None = None,
    trust_remote_code: bool = False,
    recipe_from: str | os.PathLike[str] | None = None,
    optimizer: str | None = None,
    precision: str | None = None,
    allow: str | Sequence[str] = (),
    lr: Hyperparameter = None,
    weight_decay: Hyperparameter = None,
    betas: Hyperparameter = None,
    eps: Hyperparameter = None,
    momentum: Hyperparameter = None,
) -> SearchResult:
    """The search (``autofit run``): probe the most promising candidates for real, each in a subprocess, and return
    the fastest one that fits, verified.

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
    :param margin: the share of the device memory the verified winner must leave free.
    :param settings: every knob of the search (:class:`autofit.tuner.SearchSettings`); given, it replaces
        ``trials``, ``timeout_s`` and ``margin``.
    :param on_event: called with each :class:`autofit.tuner.SearchEvent` (progress: probes done, the best so far).
    :param say: where progress lines go (``print`` shows them); None: nowhere.
    :returns: :class:`autofit.tuner.SearchResult`: ``.config`` (the winner), ``.deepspeed`` (its DeepSpeed dict),
        ``.measured``, ``.trials`` (every probe), ``.pruned``, ``.report_path``; ``.to_dict()`` is ``--json``'s.
    :raises AutofitError: a bad option, a ``Workload`` object, or nothing fits (with what the smallest candidate
        would need; nothing is written).

    The other options are :func:`estimate`'s.
    """
    from autofit.tuner import SearchSettings

    if isinstance(model, Workload):
        check_loadable(in_process_entry(model), "autofit.search")
    target, workload = _request(
        model, hardware=hardware, memory=memory, gpus=gpus, nodes=nodes, hosts=hosts, global_batch=global_batch, space=space,
        set=set, nvme_path=nvme_path, software=software, seq_len=seq_len, task=task, trust_remote_code=trust_remote_code,
        recipe_from=recipe_from,
        optimizer=optimizer, precision=precision, allow=allow, lr=lr, weight_decay=weight_decay, betas=betas,
        eps=eps, momentum=momentum,
    )
    if settings is None:
        settings = SearchSettings(trials=trials, timeout_s=timeout_s, margin=margin)
    return search_target(target, settings, out=out, report=report, storage=storage, study_name=study_name,
                         workload=workload, progress=lambda _: _events_to(on_event), say=say or _quiet)


# -- the request from the keywords -------------------------------------------------------------------------------


def _request(model: str | Workload, *, hardware: str, memory: str | int | None, gpus: int | None, nodes: int,
             hosts: str | None = None,
             global_batch: int | None, space: str | os.PathLike[str] | None,
             set: Mapping[str, Any] | Sequence[str] | None,
             nvme_path: str | os.PathLike[str] | None, seq_len: int | None, task: str | None,
             trust_remote_code: bool, optimizer: str | None, precision: str | None, allow: str | Sequence[str],
             lr: Hyperparameter, weight_decay: Hyperparameter, betas: Hyperparameter, eps: Hyperparameter,
             momentum: Hyperparameter, recipe_from: str | os.PathLike[str] | None = None,
             software: str | os.PathLike[str] | None = None) -> tuple[Target, Workload | None]:
    """The :class:`Target` the keywords ask for, and the :class:`Workload` object where ``model`` is one."""
    entry, workload = model_entry(model)
    if not isinstance(hardware, str):
        raise AutofitError(f"hardware must be a preset name, 'cpu' or 'auto', but got hardware={hardware!r}")
    target = Target(
        entry=entry, hardware=hardware, memory=memory, gpus=gpus, nodes=nodes, hosts=hosts, global_batch=global_batch,
        space=os.fspath(space) if space is not None else None, set_values=set_pairs(set),
        nvme_path=os.fspath(nvme_path) if nvme_path is not None else None, seq_len=seq_len, task=task,
        trust_remote_code=trust_remote_code, optimizer=optimizer, precision=precision, allow=names(allow, "allow"),
        lr=hyperparameter(lr, "lr"), weight_decay=hyperparameter(weight_decay, "weight_decay"),
        betas=hyperparameter(betas, "betas"), eps=hyperparameter(eps, "eps"),
        momentum=hyperparameter(momentum, "momentum"),
        recipe_from=os.fspath(recipe_from) if recipe_from is not None else None,
        software=os.fspath(software) if software is not None else None,
    )
    return target, workload


def model_entry(model: str | Workload) -> tuple[str, Workload | None]:
    """``model`` as an entry string, with the :class:`Workload` object where it is one (named by
    :func:`autofit.workload.entry.in_process_entry`)."""
    if isinstance(model, Workload):
        return in_process_entry(model), model
    if isinstance(model, str) and model.strip():
        return model.strip(), None
    raise AutofitError("model must be an autofit.Workload, an entry point 'path/to/file.py:function' or "
                       f"'package.module:function', or an 'hf:' config, but got model={model!r}")


def set_pairs(values: Mapping[str, Any] | Sequence[str] | None) -> tuple[str, ...]:
    """``set`` as ``--set`` gives it: ``{"zero_stage": 2}`` -> ``("zero_stage=2",)``; ``"k=v"`` strings pass
    as they are (one string alone too); the values are parsed and checked by :func:`autofit.core.config.parse_set`."""
    if values is None:
        return ()
    if isinstance(values, str):
        return (values,)
    if isinstance(values, Mapping):
        return tuple(f"{key}={_set_value(value)}" for key, value in values.items())
    if isinstance(values, Sequence) and all(isinstance(v, str) for v in values):
        return tuple(values)
    raise AutofitError(f"set must be a dict of config keys to values or 'key=value' strings, but got set={values!r}")


def _set_value(value: Any) -> str:
    """A ``set`` value as the command line spells it (a bool is not a config value: refused by the parse)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def names(values: str | Sequence[str], field: str) -> tuple[str, ...]:
    """A name or names (``allow="fp8"``, ``allow=["fp8", "adamw8bit"]``) as a tuple of strings."""
    if isinstance(values, str):
        return (values,)
    if isinstance(values, Sequence) and all(isinstance(v, str) for v in values):
        return tuple(values)
    raise AutofitError(f"{field} must be a name or a list of names, but got {field}={values!r}")


def hyperparameter(value: Hyperparameter, field: str) -> str | None:
    """A recipe hyperparameter as the command line spells it: ``3e-4`` -> ``"0.0003"``, ``(0.9, 0.95)`` ->
    ``"0.9,0.95"``; parsed and checked by :func:`autofit.core.recipe.parse_hyperparameters` in
    :func:`autofit.planning.target.prepare`."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise AutofitError(f"{field} must be a number, but got {field}={value!r}")
    if isinstance(value, (int, float)):
        return repr(float(value))
    if isinstance(value, tuple) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return ",".join(repr(float(v)) for v in value)
    raise AutofitError(f"{field} must be a number, a pair of numbers or a string, but got {field}={value!r}")
