"""The ``autofit`` command: thin click commands over the library.

Every command takes the same device and space options. ``--json`` prints one
JSON document on stdout; progress and logs go to stderr. A user's mistake is one
line on stderr and exit status 1 (a traceback only with ``--debug``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from autofit.errors import AutofitError

if TYPE_CHECKING:
    from autofit.workload import Workload


def common_options(command: Callable[..., Any], entry_required: bool = True) -> Callable[..., Any]:
    """The options every command shares (DESIGN.md, CLI)."""
    options = [
        click.argument("entry", required=entry_required),
        click.option("--hardware", default="auto", show_default=True,
                      help="Preset (h100-80gb, h200, a100-40gb, a100-80gb, l4, rtx4090), cpu, or auto."),
        click.option("--memory", default=None, help="Device memory budget, e.g. 2GiB, 1.5GiB, 800MiB."),
        click.option("--gpus", default=1, show_default=True, type=click.IntRange(min=1), help="Devices per node."),
        click.option("--nodes", default=1, show_default=True, type=click.IntRange(min=1), help="Nodes."),
        click.option("--global-batch", "global_batch", default=None, type=click.IntRange(min=1),
                     help="Samples per optimizer step over all devices."),
        click.option("--space", default=None, help="Search space: a name in search_spaces/ or a YAML file."),
        click.option("--set", "set_values", multiple=True, metavar="KEY=VALUE",
                     help="Fix a dimension, e.g. --set zero_stage=2 (repeatable)."),
        click.option("--nvme-path", default=None, expose_value=False, callback=_remember("nvme_path"),
                     help="A writable directory on an NVMe drive: NVMe offload swaps there (else it is pruned)."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout."),
        click.option("--debug", is_flag=True, help="Show tracebacks."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _remember(key: str) -> Callable[[click.Context, Any, Any], None]:
    """A callback keeping an option's value in the context (read by :class:`Setup`, not a command argument)."""

    def callback(ctx: click.Context, param: Any, value: Any) -> None:
        ctx.meta[f"autofit.{key}"] = value

    return callback


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """AutofitError (and any other failure) -> one line on stderr, exit 1; traceback with --debug."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = kwargs.get("debug", False)
        try:
            return command(*args, **kwargs)
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

    return wrapper


@click.group()
@click.version_option(package_name="autofit")
def main() -> None:
    """Find the fastest training configuration that fits a device."""


class Setup:
    """The parsed common options: workload, hardware, space, world size, fixed values."""

    def __init__(self, entry: str | None, hardware: str, memory: str | None, gpus: int, nodes: int,
                 global_batch: int | None, space: str | None, set_values: tuple[str, ...]) -> None:
        from autofit.config import parse_set
        from autofit.hardware import get_hardware
        from autofit.space import load_space
        from autofit.units import parse_bytes
        from autofit.workload import load_workload

        self.entry = entry
        self.fixed = parse_set(set_values)
        self.hardware = get_hardware(hardware, parse_bytes(memory) if memory is not None else None)
        if self.hardware.kind == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.space = load_space(space)
        _use_nvme_path(click.get_current_context().meta.get("autofit.nvme_path"))
        self.world_size = gpus * nodes
        self.nodes = nodes
        # --gpus ranks share each node's host memory and links (cost_model.host, cost_model.time)
        self.hardware = dataclasses.replace(self.hardware, devices_per_node=gpus)
        self.global_batch = global_batch
        self.workload: Workload | None = load_workload(entry) if entry is not None else None  # None: script mode

    @property
    def entry_point(self) -> str:
        """ENTRY; an :class:`AutofitError` in script mode, which has none."""
        if self.entry is None:
            raise AutofitError("this needs an ENTRY (a model entry point); script mode (--script) has none")
        return self.entry

    @property
    def loaded_workload(self) -> Workload:
        """ENTRY's workload; an :class:`AutofitError` in script mode, which has none."""
        if self.workload is None:
            raise AutofitError("this needs an ENTRY (a model entry point); script mode (--script) has none")
        return self.workload

    def plan(self) -> Any:
        """Trace the workload and enumerate the space's candidates (:class:`autofit.plan.Plan`)."""
        from autofit.plan import Plan

        return Plan.make(self.entry_point, self.loaded_workload, self.hardware, self.space, world_size=self.world_size,
                         global_batch=self.global_batch, fixed=self.fixed)


def _use_nvme_path(path: str | None) -> None:
    """Check ``--nvme-path`` and hand it to the search, the emitted JSON and the probes (their environment)."""
    from autofit.software import NVME_PATH_ENV, check_nvme_path, detect_software

    if path is not None:
        os.environ[NVME_PATH_ENV] = check_nvme_path(path)
        detect_software.cache_clear()


def _announce_trace(setup: Setup) -> None:
    """The plan's step on stderr: the trace, and on a CPU device the kernels' footprint (autofit.probe.footprint)."""
    measured = " and measuring what its kernels hold on this CPU" if setup.hardware.kind == "cpu" else ""
    click.echo(f"autofit: tracing {setup.loaded_workload.name or setup.entry_point}{measured}", err=True)


def _prepare_ops(configs: list[Any], hardware: Any) -> None:
    """Build or load the DeepSpeed ops the configs need, as its own step (not in a probe's time)."""
    from autofit.probe.ops import prepare_ops

    report = prepare_ops(configs, hardware)
    for lock in report.cleared_locks:
        click.echo(f"removed a stale build lock: {lock}", err=True)
    if report.ops:
        states = ", ".join(f"{op} {state}" for op, state in report.loaded.items())
        click.echo(f"DeepSpeed ops: {states} ({report.seconds:.1f} s)", err=True)


@main.command()
@common_options
@user_errors
def estimate(entry: str, hardware: str, memory: str | None, gpus: int, nodes: int, global_batch: int | None,
             space: str | None, set_values: tuple[str, ...], as_json: bool, debug: bool) -> None:
    """Cost model only: rank the space's candidates by predicted step time; no training step runs."""
    from autofit.estimate import estimate as run_estimate

    setup = Setup(entry, hardware, memory, gpus, nodes, global_batch, space, set_values)
    result = run_estimate(setup.plan())
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    from autofit.tables import print_estimate

    print_estimate(result)


@main.command()
@common_options
@click.option("--mode", type=click.Choice(["real", "fake"]), default="real", show_default=True,
              help="real: DeepSpeed steps on the device; fake: FakeTensorMode at full size, memory only.")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="Measured steps.")
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(min=0), help="Warm-up steps.")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True, type=float, help="Seconds for the probe.")
@click.option("--memory-snapshot", "snapshot_path", default=None, metavar="PATH",
              help="CUDA: record the allocator's history into this pickle (open it at https://pytorch.org/memory_viz).")
@user_errors
def probe(entry: str, hardware: str, memory: str | None, gpus: int, nodes: int, global_batch: int | None,
          space: str | None, set_values: tuple[str, ...], as_json: bool, debug: bool, mode: str, steps: int,
          warmup: int, timeout_s: float, snapshot_path: str | None) -> None:
    """Run one candidate (the fastest predicted that fits, after --set) for a few real steps."""
    from autofit.estimate import estimate as run_estimate
    from autofit.probe import run_probe

    setup = Setup(entry, hardware, memory, gpus, nodes, global_batch, space, set_values)
    result = run_estimate(setup.plan())
    chosen = (result.fitting or result.candidates)[0]
    if mode == "real":
        _prepare_ops([chosen.config], setup.hardware)
    click.echo(f"probing {chosen.config.label()} ({mode})", err=True)
    measured = run_probe(setup.entry_point, chosen.config, setup.hardware, setup.world_size, mode=mode, steps=steps,
                         warmup_steps=warmup, timeout_s=timeout_s, memory_snapshot=snapshot_path)
    _say_fragmentation(measured)
    document = measured.to_json() | {"predicted": chosen.prediction.to_dict()}
    if as_json:
        click.echo(json.dumps(document, indent=1))
    else:
        from autofit.tables import print_probe

        print_probe(document)
    if measured.status != "ok":
        sys.exit(2)


@main.command()
@common_options
@click.option("--measure", is_flag=True, help="Probe every rung predicted to fit and add the measured columns.")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="Measured steps per probe.")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True, type=float, help="Seconds for each probe.")
@user_errors
def ladder(entry: str, hardware: str, memory: str | None, gpus: int, nodes: int, global_batch: int | None,
           space: str | None, set_values: tuple[str, ...], as_json: bool, debug: bool, measure: bool, steps: int,
           timeout_s: float) -> None:
    """Seed 004's build-along table: from fp32 + AdamW + ZeRO-0, one memory technique added per rung, each priced
    (peak, fits, samples/s) and, with --measure, probed."""
    from autofit.ladder import check_fixed, ladder_plan, price_ladder

    if space is not None:
        raise AutofitError("autofit ladder takes no --space: its rungs are fixed (autofit/ladder.py)")
    if global_batch is None:
        raise AutofitError("autofit ladder needs --global-batch N (samples per optimizer step; seed 004 uses 16)")
    setup = Setup(entry, hardware, memory, gpus, nodes, global_batch, space, set_values)
    check_fixed(setup.fixed)
    if measure and setup.hardware.kind == "cuda" and not _cuda_devices_here():
        raise AutofitError(f"--measure on {setup.hardware.name} needs a CUDA device and none is visible here; "
                           "without --measure the ladder is predicted only")
    _announce_trace(setup)
    plan = ladder_plan(setup.entry_point, setup.loaded_workload, setup.hardware, world_size=setup.world_size,
                       global_batch=global_batch, fixed=setup.fixed)
    result = price_ladder(plan)
    if measure:
        result = _measure_ladder(result, setup, steps, timeout_s)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    from autofit.tables import print_ladder

    print_ladder(result)


def _measure_ladder(ladder: Any, setup: Setup, steps: int, timeout_s: float) -> Any:
    """Probe each rung predicted to fit (its own subprocess probe, as ``autofit probe``); the ladder with the results."""
    from autofit.probe import run_probe

    fitting = [row for row in ladder.rows if row.fits]
    if not fitting:
        click.echo("autofit: no rung is predicted to fit: nothing to probe", err=True)
        return ladder
    _prepare_ops([row.config for row in fitting], setup.hardware)
    measured = {}
    for row in fitting:
        click.echo(f"autofit: probing rung {row.index} ({row.rung.name}): {row.config.label()}", err=True)
        probed = run_probe(setup.entry_point, row.config, setup.hardware, setup.world_size, steps=steps, timeout_s=timeout_s)
        measured[row.index] = probed.to_json()
    return ladder.with_measured(measured)


def _cuda_devices_here() -> int:
    """CUDA devices this process may use: NVML's count (or ``CUDA_VISIBLE_DEVICES``), else torch's."""
    from autofit.probe import visible_cuda_devices

    visible = visible_cuda_devices()
    if visible is not None:
        return visible
    import torch

    return torch.cuda.device_count()


@main.command()
@functools.partial(common_options, entry_required=False)
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
@user_errors
def run(entry: str, hardware: str, memory: str | None, gpus: int, nodes: int, global_batch: int | None,
        space: str | None, set_values: tuple[str, ...], as_json: bool, debug: bool, trials: int,
        timeout_s: float | None, storage: str | None, study_name: str | None, out_path: str,
        report_dir: str | None, margin: float, script: str | None) -> None:
    """The search: probe the most promising candidates and write the fastest that fits as DeepSpeed JSON."""
    from autofit.search import SearchSettings, run_search

    if (entry is None) == (script is None):
        raise AutofitError('autofit run takes an ENTRY or --script "CMD ... {config}", exactly one of them')
    settings = SearchSettings(trials=trials, timeout_s=timeout_s, margin=margin)
    setup = Setup(entry, hardware, memory, gpus, nodes, global_batch, space, set_values)
    with contextlib.ExitStack() as stack:
        if script is not None:
            from autofit.script.cli import script_plan_and_prober

            plan, prober = script_plan_and_prober(setup, script, stack)
        else:
            _announce_trace(setup)
            plan, prober = setup.plan(), None
        click.echo(f"autofit: {len(plan.candidates)} candidates", err=True)
        with progress_display(trials) as on_event:
            result = run_search(plan, settings, out_path=out_path, storage=storage, study_name=study_name,
                                prober=prober, on_event=on_event)
    if report_dir is not None:
        from autofit.report import write_report

        snapshot = _winner_snapshot(setup, result, report_dir) if setup.hardware.kind == "cuda" and script is None else None
        write_report(result, report_dir, ladder=_report_ladder(setup, result) if script is None else None, snapshot=snapshot)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        click.echo(f"wrote {out_path}", err=True)


def _winner_snapshot(setup: Setup, result: Any, report_dir: str) -> Any:
    """The winner probed once more with the CUDA allocator's history recorded into the report's folder."""
    from autofit.probe import run_probe

    path = Path(report_dir) / "memory_snapshot.pickle"
    click.echo(f"autofit: recording the winner's CUDA memory snapshot into {path}", err=True)
    measured = run_probe(setup.entry_point, result.config, setup.hardware, setup.world_size, steps=1, memory_snapshot=str(path))
    _say_fragmentation(measured)
    return measured


def _say_fragmentation(measured: Any) -> None:
    from autofit.probe.snapshot import fragmentation_advice

    advice = fragmentation_advice(measured.device_memory)
    if advice:
        click.echo(f"autofit: {advice}", err=True)


def _report_ladder(setup: Setup, result: Any) -> Any:
    """The ladder that ends the report, or None (said on stderr) where it cannot be made: the winner is written."""
    from autofit.ladder import search_ladder

    try:
        return search_ladder(setup.entry_point, setup.loaded_workload, result, setup.fixed)
    except AutofitError as exc:
        click.echo(f"autofit: the report has no ladder: {exc}", err=True)
        return None


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
@common_options
@click.option("--trials", default=20, show_default=True, type=click.IntRange(min=1), help="Most probes of the search.")
@click.option("--storage", required=True, envvar="AUTOFIT_STORAGE",
              help="Optuna storage URL shared with the workers (sqlite:///FILE, postgresql://USER@HOST:PORT/DB).")
@user_errors
def schedule_add(entry: str, hardware: str, memory: str | None, gpus: int, nodes: int, global_batch: int | None,
                 space: str | None, set_values: tuple[str, ...], as_json: bool, debug: bool, trials: int,
                 storage: str) -> None:
    """Queue one search of ENTRY on --hardware (a preset or cpu) and print its id.

    ENTRY is loaded again by the workers where they run: it must be importable there (a path on a
    shared file system, or package.module:function of a package installed on the workers). A search
    already done for the same model, space, request and machine returns its stored winner at once.
    """
    from autofit.schedule.submit import absolute_entry, make_request, submit
    from autofit.units import parse_bytes

    setup = Setup(absolute_entry(entry), hardware, memory, gpus, nodes, global_batch, space, set_values)
    request = make_request(setup.entry_point, setup.hardware, gpus=gpus, nodes=nodes, global_batch=global_batch,
                           space=setup.space, fixed=setup.fixed, trials=trials,
                           memory_bytes=parse_bytes(memory) if memory is not None else None)
    added = submit(storage, setup.plan(), setup.workload, request)
    if as_json:
        click.echo(json.dumps(added.to_dict()))
        return
    click.echo(added.id)
    click.echo(f"autofit: {added.state}{' (cached)' if added.cached else ''}", err=True)


@schedule.command("list")
@click.option("--storage", required=True, envvar="AUTOFIT_STORAGE", help="Optuna storage URL.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@user_errors
def schedule_list(storage: str, as_json: bool, debug: bool) -> None:
    """Every search: hardware, state (queued, running, done, failed, nothing-fits), trials, worker, best so far."""
    from autofit.schedule.status import print_searches, search_summaries

    searches = search_summaries(storage)
    if as_json:
        click.echo(json.dumps({"searches": searches}, indent=1))
    else:
        print_searches(searches)


@main.command()
@click.option("--storage", required=True, envvar="AUTOFIT_STORAGE", help="Optuna storage URL shared with `autofit schedule add`.")
@click.option("--hardware", default="auto", show_default=True, help="This machine's device: auto (detect), a preset, or cpu.")
@click.option("--gpus", default=None, type=click.IntRange(min=1), help="Devices here (default: detected).")
@click.option("--nodes", default=1, show_default=True, type=click.IntRange(min=1), help="Nodes this worker launches on.")
@click.option("--idle-exit", "idle_exit_s", default=60.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Exit after this many seconds with nothing to claim.")
@click.option("--lease", "lease_s", default=60.0, show_default=True, type=click.FloatRange(min=1.0),
              help="Seconds without a heartbeat before another worker takes a search over.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@user_errors
def worker(storage: str, hardware: str, gpus: int | None, nodes: int, idle_exit_s: float, lease_s: float,
           debug: bool) -> None:
    """Run queued searches that match this machine's hardware fingerprint until idle for --idle-exit seconds."""
    from autofit.hardware import get_hardware
    from autofit.schedule.fingerprint import detect_machine, worker_name
    from autofit.schedule.worker import Worker

    device = get_hardware(hardware)
    if device.kind == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    machine = detect_machine(device, gpus)
    Worker(storage, worker_name(), device, machine, nodes=nodes, lease_s=lease_s, idle_exit_s=idle_exit_s).serve()


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

    rows = compare(storage, parse_prices(prices), entry)
    if report_dir is not None:
        write_results_report(rows, report_dir)
    if as_json:
        click.echo(json.dumps({"results": rows}, indent=1))
    else:
        print_results(rows)
