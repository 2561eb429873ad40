"""The ``autofit`` command: thin click commands over the library.

Every command takes the same device and space options: the fields of
:class:`autofit.planning.target.Target`, made into click options once (:func:`shared_options`)
and handed to the command as one :class:`Shared`. A command parses, calls the library
(:func:`autofit.planning.target.prepare`, then the estimate, the probe, the ladder or the
search) and prints. ``--json`` prints one JSON document on stdout; progress and logs
go to stderr. A user's mistake is one line on stderr and exit status 1 (a traceback
only with ``--debug``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autofit.commands import estimate as estimate_command
from autofit.commands import ladder as ladder_command
from autofit.commands import probe as probe_command
from autofit.commands import run as run_command
from autofit.commands import schedule as schedule_command
from autofit.commands.numbers import DURATION, SECONDS, FiniteFloat
from autofit.core.bulk import frozen_at_exit, paused_gc
from autofit.core.errors import AutofitError
from autofit.planning.longest import longest_sequence
from autofit.planning.target import CLI_OPTION, Target, cli_fields
from autofit.report.json_text import document_text
from autofit.report.outputs import emit_document, json_stdout
from autofit.report.tables import print_estimate, print_ladder, print_probe
from autofit.trace import cache as trace_cache


@dataclass(frozen=True)
class Shared:
    """What every command's shared options give it: the request, and how to answer."""

    target: Target
    """Which model, on what device, with which space and fixed values (:class:`autofit.planning.target.Target`)."""
    as_json: bool
    """``--json``: one JSON document on stdout, progress and logs on stderr."""
    debug: bool
    """``--debug``: a traceback instead of the one-line error."""


#: the shared options that are not part of the request: how the command answers
ANSWER_OPTIONS = (
    click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout."),
    click.option("--debug", is_flag=True, help="Show tracebacks."),
    click.option("--no-cache", is_flag=True,
                 help="Trace the model again instead of reading the trace cache ($AUTOFIT_CACHE_DIR, "
                      "default ~/.cache/autofit)."),
)


def _click_param(target_field: dataclasses.Field[Any], entry_required: bool) -> Callable[..., Any]:
    """The click argument or option of one :class:`Target` field, from its :func:`autofit.planning.target.option`."""
    spec = target_field.metadata[CLI_OPTION]
    if not spec["flags"]:
        return click.argument(target_field.name, required=entry_required)
    settings: dict[str, Any] = {"default": target_field.default, "help": spec["help"],
                                "show_default": spec["show_default"], "multiple": spec["multiple"]}
    if spec["minimum"] is not None:
        settings["type"] = click.IntRange(min=spec["minimum"])
    if spec["metavar"] is not None:
        settings["metavar"] = spec["metavar"]
    if spec["choices"] is not None:
        settings["type"] = click.Choice(list(spec["choices"]))
    if spec["is_flag"]:
        settings["is_flag"] = True
    return click.option(*spec["flags"], target_field.name, **settings)


def shared_options(entry_required: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options every command shares (docs/design.md, "CLI"), written once: the fields of :class:`Target` (a new
    shared option is a new field there), then ``--json`` and ``--debug``. The command gets them as one
    :class:`Shared` (its first argument) and its own options as keywords; a :class:`AutofitError`, in the
    target's own checks or the command, is one line and exit 1 (:func:`one_line_errors`)."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        names = [f.name for f in cli_fields()]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            as_json, debug, no_cache = kwargs.pop("as_json"), kwargs.pop("debug"), kwargs.pop("no_cache")
            values = {name: kwargs.pop(name) for name in names}
            with one_line_errors(debug), trace_cache.turned_off(no_cache), json_stdout(as_json):  # --json: the document alone
                return command(Shared(Target(**values), as_json, debug), **kwargs)

        params = [_click_param(f, entry_required) for f in cli_fields()] + list(ANSWER_OPTIONS)
        for param in reversed(params):
            wrapper = param(wrapper)
        return wrapper

    return decorate


@contextmanager
def one_line_errors(debug: bool) -> Iterator[None]:
    """AutofitError (and any other failure) -> one line on stderr, exit 1; traceback with --debug."""
    try:
        yield
    except AutofitError as exc:
        if debug:
            raise
        click.echo(f"autofit: error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("autofit: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug or an environment problem: still one line without --debug
        if debug:
            raise
        click.echo(f"autofit: error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", err=True)
        sys.exit(1)


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`one_line_errors` for a command without the shared options (its own ``--debug``)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with one_line_errors(kwargs.get("debug", False)):
            return command(*args, **kwargs)

    return wrapper


def say(line: str) -> None:
    """A progress line on stderr (stdout stays clean for ``--json``): what the library's ``say`` gets."""
    click.echo(line, err=True)


@click.group()
@click.version_option(package_name="autofit")
def main() -> None:
    """Find the fastest training configuration that fits a device."""
    frozen_at_exit()  # a plan's heap is not walked once more by the exit's collections


@main.command()
@shared_options()
def estimate(shared: Shared) -> None:
    """Cost model only: rank the space's candidates by predicted step time; no training step runs."""
    if shared.target.seq_len == "max":  # the longest sequence that fits (autofit/planning/longest.py)
        answer = longest_sequence(shared.target)
        if answer.position_note:
            say(f"autofit: warning: {answer.position_note}")
        if shared.as_json:
            emit_document(document_text(answer.to_dict()))
        else:
            click.echo(answer.text())
        return
    result = estimate_command.estimate_target(shared.target)
    for warning in result.model.warnings if result.model is not None else ():
        say(f"autofit: warning: {warning}")
    if shared.as_json:
        with paused_gc():  # a document of thousands of candidates (autofit/core/bulk.py)
            emit_document(document_text(result.to_dict()))
    else:
        print_estimate(result)


@main.command()
@shared_options()
@click.option("--mode", type=click.Choice(["real", "fake"]), default="real", show_default=True,
              help="real: DeepSpeed steps on the device; fake: FakeTensorMode at full size, memory only.")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="Measured steps.")
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(min=0), help="Warm-up steps.")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True, type=SECONDS, help="Seconds for the probe.")
@click.option("--memory-snapshot", "snapshot_path", default=None, metavar="PATH",
              help="CUDA: record the allocator's history into this pickle (open it at https://pytorch.org/memory_viz).")
def probe(shared: Shared, mode: str, steps: int, warmup: int, timeout_s: float, snapshot_path: str | None) -> None:
    """Run one candidate (the fastest predicted that fits, after --set) for a few real steps."""
    answer = probe_command.probe_target(shared.target, mode=mode, steps=steps, warmup=warmup, timeout_s=timeout_s,
                                        snapshot_path=snapshot_path, say=say)
    if shared.as_json:
        emit_document(document_text(answer.to_dict()))
    else:
        print_probe(answer.result())
    if not answer.ok:
        sys.exit(2)


@main.command()
@shared_options()
@click.option("--measure", is_flag=True, help="Probe every rung predicted to fit and add the measured columns.")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="Measured steps per probe.")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True, type=SECONDS, help="Seconds for each probe.")
def ladder(shared: Shared, measure: bool, steps: int, timeout_s: float) -> None:
    """The build-along table of memory techniques: from fp32 + AdamW + ZeRO-0, one technique added per rung,
    each priced (peak, fits, samples/s) and, with --measure, probed."""
    result = ladder_command.ladder_target(shared.target, measure=measure, steps=steps, timeout_s=timeout_s, say=say)
    if shared.as_json:
        emit_document(document_text(result.to_dict()))
    else:
        print_ladder(result)


@main.command()
@shared_options(entry_required=False)
@click.option("--script", default=None, metavar="CMD",
              help='Script mode instead of ENTRY: an unmodified DeepSpeed script, "python train.py --deepspeed_config {config}".')
@click.option("--trials", default=20, show_default=True, type=click.IntRange(min=1), help="Most probes to run.")
@click.option("--time-budget", "--timeout", "timeout_s", default=None, type=DURATION,
              help="Wall time for the search and its verification (600, 90s, 10m, 1.5h): no probe starts that would "
                   "not finish within it; the best verified config so far wins.")
@click.option("--storage", default=None, help="Optuna storage URL (default: sqlite:///autofit.db here).")
@click.option("--study", "study_name", default=None, help="Study name; the same name resumes a search.")
@click.option("--out", "out_path", default="ds_config.json", show_default=True, help="Where the winner's JSON goes.")
@click.option("--report", "report_dir", default=None, help="Write a report (HTML + PNG) to this folder.")
def run(shared: Shared, trials: int, timeout_s: float | None, storage: str | None, study_name: str | None,
        out_path: str, report_dir: str | None, script: str | None) -> None:
    """The search: probe the most promising candidates and write the fastest that fits as DeepSpeed JSON."""
    result = run_command.run_target(shared.target, trials=trials, timeout_s=timeout_s, out=out_path,
                                    report=report_dir, storage=storage, study_name=study_name, script=script,
                                    progress=progress_display, say=say)
    if shared.as_json:
        emit_document(document_text(result.to_dict()))
    else:
        say(f"wrote {out_path}")


@contextmanager
def progress_display(total: int) -> Iterator[Callable[[Any], None]]:
    """Progress on stderr (stdout stays clean for ``--json``), fed by the search's events: a rich progress bar
    on a terminal, one plain line an event otherwise (a log file, CI, a scheduler's worker)."""

    def describe(event: Any) -> str:
        best = f"best {event.best.samples_per_s:.3g} samples/s" if event.best is not None else "best -"
        return f"trial {event.n_done}/{event.trials} | {best} | {event.text}"

    console = Console(file=sys.stderr)
    if not console.is_terminal:
        yield lambda event: print(f"autofit: {describe(event)}", file=sys.stderr, flush=True)
        return
    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(f"trial 0/{total}", total=total)
        yield lambda event: progress.update(
            task, completed=min(event.n_done, event.trials), description=describe(event)
        )


@main.group()
def schedule() -> None:
    """Queue searches for workers on other machines (Optuna storage: SQLite here, PostgreSQL across machines)."""


@schedule.command("add")
@shared_options()
@click.option("--trials", default=20, show_default=True, type=click.IntRange(min=1), help="Most probes of the search.")
@click.option("--storage", required=True, envvar="AUTOFIT_STORAGE",
              help="Optuna storage URL shared with the workers (sqlite:///FILE, postgresql://USER@HOST:PORT/DB).")
def schedule_add(shared: Shared, trials: int, storage: str) -> None:
    """Queue one search of ENTRY on --hardware (a preset or cpu) and print its id.

    ENTRY is loaded again by the workers where they run: it must be importable there (a path on a
    shared file system, or package.module:function of a package installed on the workers). A search
    already done for the same model, space, request and machine returns its stored winner at once.
    """
    added = schedule_command.add_target(shared.target, trials=trials, storage=storage)
    if shared.as_json:
        emit_document(json.dumps(added.to_dict()))
        return
    click.echo(added.id)
    say(f"autofit: {added.state}{' (cached)' if added.cached else ''}")


@schedule.command("list")
@click.option("--storage", required=True, envvar="AUTOFIT_STORAGE", help="Optuna storage URL.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@user_errors
def schedule_list(storage: str, as_json: bool, debug: bool) -> None:
    """Every search: hardware, state (queued, running, done, failed, nothing-fits), trials, worker, best so far."""
    with json_stdout(as_json):  # --json: the document alone
        searches = schedule_command.list_searches(storage)
        if as_json:
            emit_document(document_text({"searches": searches}))
            return
    from autofit.schedule.status import print_searches  # sqlalchemy: autofit.commands.schedule

    print_searches(searches)


@main.command()
@click.option("--storage", required=True, envvar="AUTOFIT_STORAGE", help="Optuna storage URL shared with `autofit schedule add`.")
@click.option("--hardware", default="auto", show_default=True, help="This machine's device: auto (detect), a preset, or cpu.")
@click.option("--gpus", default=None, type=click.IntRange(min=1), help="Devices here (default: detected).")
@click.option("--nodes", default=1, show_default=True, type=click.IntRange(min=1),
              help="Nodes a probe of this worker spans (agents on this machine: a CPU worker only; a CUDA worker "
                   "runs one-node searches).")
@click.option("--idle-exit", "idle_exit_s", default=60.0, show_default=True, type=FiniteFloat(0.0),
              help="Exit after this many seconds with nothing to claim.")
@click.option("--lease", "lease_s", default=60.0, show_default=True, type=FiniteFloat(1.0),
              help="Seconds without a heartbeat before another worker takes a search over.")
@click.option("--max-claims", default=3, show_default=True, type=click.IntRange(min=1),
              help="A search whose worker vanished this many times (its lease ran out) ends failed.")
@click.option("--entry-root", "entry_root", multiple=True, metavar="DIR",
              help="Import queued entry points only from under DIR (repeatable; also AUTOFIT_ENTRY_ROOTS, "
                   "os.pathsep-separated); an entry elsewhere or missing here is given back for another worker.")
@click.option("--allow-hub", "allow_hub", multiple=True, metavar="ORG/NAME",
              help="With entry roots: a Hub model (ORG/NAME or ORG/*) this worker may load (repeatable; also "
                   "AUTOFIT_ALLOW_HUB, comma-separated); any other is given back.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@user_errors
def worker(storage: str, hardware: str, gpus: int | None, nodes: int, idle_exit_s: float, lease_s: float,
           max_claims: int, entry_root: tuple[str, ...], allow_hub: tuple[str, ...], debug: bool) -> None:
    """Run queued searches that match this machine's hardware fingerprint until idle for --idle-exit seconds.

    SIGTERM or SIGINT stops the running probe, gives its search back (queued) and exits 0."""
    schedule_command.serve(storage, hardware=hardware, gpus=gpus, nodes=nodes, idle_exit_s=idle_exit_s,
                           lease_s=lease_s, max_claims=max_claims, entry_root=entry_root, allow_hub=allow_hub)


@main.command()
@click.option("--storage", required=True, envvar="AUTOFIT_STORAGE", help="Optuna storage URL.")
@click.option("--entry", default=None, help="Only this entry point (as queued).")
@click.option("--price", "prices", multiple=True, metavar="NAME=USD_PER_DEVICE_HOUR",
              help="Price of one device-hour, e.g. --price h100-80gb=3.5 (repeatable).")
@click.option("--report", "report_dir", default=None, help="Write results.md, results.json and results.png here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@user_errors
def results(storage: str, entry: str | None, prices: tuple[str, ...], report_dir: str | None, as_json: bool,
            debug: bool) -> None:
    """Each model's winners across hardware: samples/s, tokens/s, memory headroom, cost per million tokens."""
    with json_stdout(as_json):  # --json: the document alone
        rows = schedule_command.results(storage, prices=prices, entry=entry, report_dir=report_dir)
        if as_json:
            emit_document(document_text({"results": rows}))
            return
    from autofit.schedule.results import print_results  # sqlalchemy: autofit.commands.schedule

    print_results(rows)
