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
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import click

from autofit.core.errors import AutofitError
from autofit.planning.target import CLI_OPTION, Setup, Target, cli_fields, prepare


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
            as_json, debug = kwargs.pop("as_json"), kwargs.pop("debug")
            if kwargs.pop("no_cache"):
                from autofit.trace.cache import NO_CACHE_ENV

                os.environ[NO_CACHE_ENV] = "1"  # read by autofit.trace.cache, here and in subprocesses
            values = {name: kwargs.pop(name) for name in names}
            with one_line_errors(debug):
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


def _prepare_ops(configs: list[Any], setup: Setup) -> Any:
    """Build or load the DeepSpeed ops the configs need, as its own step (not in a probe's time); the setup's
    software with the failed builds marked (AdamW runs as ``torch_adam`` where FusedAdam failed)."""
    from autofit.probe.ops import prepare_ops

    report = prepare_ops(configs, setup.hardware, setup.software)
    for line in report.lines():
        say(line)
    return report.software(setup.software)


def _say_fragmentation(measured: Any) -> None:
    from autofit.probe.snapshot import fragmentation_advice

    advice = fragmentation_advice(measured.device_memory)
    if advice:
        say(f"autofit: {advice}")


@main.command()
@shared_options()
def estimate(shared: Shared) -> None:
    """Cost model only: rank the space's candidates by predicted step time; no training step runs."""
    from autofit.commands.api import estimate_target

    result = estimate_target(shared.target)
    if shared.as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    from autofit.report.tables import print_estimate

    print_estimate(result)


@main.command()
@shared_options()
@click.option("--mode", type=click.Choice(["real", "fake"]), default="real", show_default=True,
              help="real: DeepSpeed steps on the device; fake: FakeTensorMode at full size, memory only.")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="Measured steps.")
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(min=0), help="Warm-up steps.")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True, type=float, help="Seconds for the probe.")
@click.option("--memory-snapshot", "snapshot_path", default=None, metavar="PATH",
              help="CUDA: record the allocator's history into this pickle (open it at https://pytorch.org/memory_viz).")
def probe(shared: Shared, mode: str, steps: int, warmup: int, timeout_s: float, snapshot_path: str | None) -> None:
    """Run one candidate (the fastest predicted that fits, after --set) for a few real steps."""
    from autofit.commands.api import check_nodes
    from autofit.planning.estimate import estimate as run_estimate
    from autofit.probe.run import run_probe

    setup = prepare(shared.target, probes_here=True)
    if mode == "real":
        check_nodes(setup)  # nodes that cannot be placed: one line before the trace and the ops
    result = run_estimate(setup.plan())
    chosen = (result.fitting or result.candidates)[0]
    software = setup.software
    if mode == "real":
        software = _prepare_ops([chosen.config], setup)
    say(f"probing {chosen.config.label()} ({mode})")
    measured = run_probe(setup.entry_point, chosen.config, setup.hardware, setup.world_size, mode=mode, steps=steps,
                         warmup_steps=warmup, timeout_s=timeout_s, memory_snapshot=snapshot_path,
                         software=software, hosts=setup.hosts,
                         hidden_size=result.facts.hidden_size if result.facts else 0,
                         largest_param_numel=result.facts.largest_param_numel if result.facts else 0)
    _say_fragmentation(measured)
    document = measured.to_json() | {"predicted": chosen.prediction.to_dict()}
    if shared.as_json:
        click.echo(json.dumps(document, indent=1))
    else:
        from autofit.report.tables import print_probe

        print_probe(document)
    if measured.status != "ok":
        sys.exit(2)


@main.command()
@shared_options()
@click.option("--measure", is_flag=True, help="Probe every rung predicted to fit and add the measured columns.")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="Measured steps per probe.")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True, type=float, help="Seconds for each probe.")
def ladder(shared: Shared, measure: bool, steps: int, timeout_s: float) -> None:
    """The build-along table of memory techniques: from fp32 + AdamW + ZeRO-0, one technique added per rung,
    each priced (peak, fits, samples/s) and, with --measure, probed."""
    from autofit.commands.api import ladder_target

    result = ladder_target(shared.target, measure=measure, steps=steps, timeout_s=timeout_s, say=say)
    if shared.as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    from autofit.report.tables import print_ladder

    print_ladder(result)


@main.command()
@shared_options(entry_required=False)
@click.option("--script", default=None, metavar="CMD",
              help='Script mode instead of ENTRY: an unmodified DeepSpeed script, "python train.py --deepspeed_config {config}".')
@click.option("--trials", default=20, show_default=True, type=click.IntRange(min=1), help="Most probes to run.")
@click.option("--timeout", "timeout_s", default=None, type=float, help="Stop the search after this many seconds.")
@click.option("--storage", default=None, help="Optuna storage URL (default: sqlite:///autofit.db here).")
@click.option("--study", "study_name", default=None, help="Study name; the same name resumes a search.")
@click.option("--out", "out_path", default="ds_config.json", show_default=True, help="Where the winner's JSON goes.")
@click.option("--report", "report_dir", default=None, help="Write a report (HTML + PNG) to this folder.")
@click.option("--margin", default=0.10, show_default=True, type=click.FloatRange(0.0, 0.9),
              help="Fraction of the device memory the verified winner must leave free.")
def run(shared: Shared, trials: int, timeout_s: float | None, storage: str | None, study_name: str | None,
        out_path: str, report_dir: str | None, margin: float, script: str | None) -> None:
    """The search: probe the most promising candidates and write the fastest that fits as DeepSpeed JSON."""
    from autofit.commands.api import search_target
    from autofit.tuner import DEFAULT_STORAGE, SearchSettings
    from autofit.tuner.storage import storage_errors

    settings = SearchSettings(trials=trials, timeout_s=timeout_s, margin=margin)
    with storage_errors(storage or DEFAULT_STORAGE):  # a database error: one line, the URL's password hidden
        result = search_target(shared.target, settings, out=out_path, report=report_dir, storage=storage,
                               study_name=study_name, script=script, progress=progress_display, say=say)
    if shared.as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        say(f"wrote {out_path}")


@contextmanager
def progress_display(total: int) -> Iterator[Callable[[Any], None]]:
    """Progress on stderr (stdout stays clean for ``--json``), fed by the search's events: a rich progress bar
    on a terminal, one plain line an event otherwise (a log file, CI, a scheduler's worker)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
    from autofit.schedule.submit import absolute_entry, make_request, submit

    target = dataclasses.replace(shared.target, entry=absolute_entry(shared.target.entry or ""))
    setup = prepare(target)
    request = make_request(setup.entry_point, setup.hardware, gpus=setup.gpus, nodes=target.nodes,
                           global_batch=target.global_batch, space=setup.space, fixed=setup.fixed, trials=trials,
                           memory_bytes=target.memory_bytes(), recipe=setup.recipe)
    from autofit.tuner.storage import storage_errors

    with storage_errors(storage):  # a database error: one line, the URL's password hidden
        added = submit(storage, setup.plan(), setup.loaded_workload, request)
    if shared.as_json:
        click.echo(json.dumps(added.to_dict()))
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
    from autofit.schedule.status import print_searches, search_summaries
    from autofit.tuner.storage import storage_errors

    with storage_errors(storage):
        searches = search_summaries(storage)
    if as_json:
        click.echo(json.dumps({"searches": searches}, indent=1))
    else:
        print_searches(searches)


@main.command()
@click.option("--storage", required=True, envvar="AUTOFIT_STORAGE", help="Optuna storage URL shared with `autofit schedule add`.")
@click.option("--hardware", default="auto", show_default=True, help="This machine's device: auto (detect), a preset, or cpu.")
@click.option("--gpus", default=None, type=click.IntRange(min=1), help="Devices here (default: detected).")
@click.option("--nodes", default=1, show_default=True, type=click.IntRange(min=1),
              help="Nodes a probe of this worker spans (agents on this machine: a CPU worker only; a CUDA worker "
                   "runs one-node searches).")
@click.option("--idle-exit", "idle_exit_s", default=60.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Exit after this many seconds with nothing to claim.")
@click.option("--lease", "lease_s", default=60.0, show_default=True, type=click.FloatRange(min=1.0),
              help="Seconds without a heartbeat before another worker takes a search over.")
@click.option("--max-claims", default=3, show_default=True, type=click.IntRange(min=1),
              help="A search whose worker vanished this many times (its lease ran out) ends failed.")
@click.option("--entry-root", "entry_root", multiple=True, metavar="DIR",
              help="Import queued entry points only from under DIR (repeatable; also AUTOFIT_ENTRY_ROOTS, "
                   "os.pathsep-separated); an entry elsewhere or missing here is given back for another worker.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@user_errors
def worker(storage: str, hardware: str, gpus: int | None, nodes: int, idle_exit_s: float, lease_s: float,
           max_claims: int, entry_root: tuple[str, ...], debug: bool) -> None:
    """Run queued searches that match this machine's hardware fingerprint until idle for --idle-exit seconds.

    SIGTERM or SIGINT stops the running probe, gives its search back (queued) and exits 0."""
    from autofit.machine.device import get_hardware
    from autofit.machine.fingerprint import detect_machine, worker_name
    from autofit.schedule.checks import check_device, check_nodes, detected_devices, entry_roots
    from autofit.schedule.worker import Worker
    from autofit.tuner.storage import check_url, storage_errors

    check_url(storage)  # a wrong URL: one line before anything else, never a retry
    roots = entry_roots(entry_root)  # a root that is no folder: one line
    device = get_hardware(hardware)
    check_nodes(device.kind, nodes)  # a worker launches on this machine: no multi-node CUDA search on one node
    check_device(hardware, detected_devices())  # a preset must be the GPU here: else it claims another's searches
    machine = detect_machine(device, gpus)
    with storage_errors(storage):  # what is no outage (a failed statement): one line, not a retry
        Worker(storage, worker_name(), device, machine, nodes=nodes, lease_s=lease_s, idle_exit_s=idle_exit_s,
               max_claims=max_claims, entry_roots=roots).serve()


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
    from autofit.schedule.results import compare, parse_prices, print_results, write_results_report
    from autofit.tuner.storage import storage_errors

    with storage_errors(storage):
        rows = compare(storage, parse_prices(prices), entry)
    if report_dir is not None:
        write_results_report(rows, report_dir)
    if as_json:
        click.echo(json.dumps({"results": rows}, indent=1))
    else:
        print_results(rows)
