"""Readable tables (rich) for the CLI when ``--json`` is not given; written to stdout."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from autofit.core.recipe import recipe_line
from autofit.core.space import describe_rejections
from autofit.core.units import format_bytes
from autofit.cost_model.budget import budget_text
from autofit.cost_model.uncertainty import cuda_band_line
from autofit.probe.result import ProbeResult
from autofit.report.ladder import ladder_rows, ladder_title

MAX_ROWS = 25


def print_estimate(result: Any, max_rows: int = MAX_ROWS) -> None:
    """Candidates ranked by predicted step time, fitting ones first."""
    console = Console(width=None if Console().is_terminal else 180)
    if getattr(result, "model", None) is not None:
        console.print(model_line(result.model), markup=False)
        for note in result.model.notes:
            console.print(f"  note: {note}", markup=False)
    hw = result.hardware
    fitting = len(result.fitting)
    table = Table(title=f"{hw.name} x {result.world_size}: {fitting} of {len(result.candidates)} candidates fit "
                        f"{budget_text(hw.memory_bytes, result.margin)}")
    for column in ("#", "config", "peak", "params", "grads", "optim", "activ", "other", "step s", "samples/s", "fits"):
        table.add_column(column, justify="right" if column not in ("config", "fits") else "left")
    for i, candidate in enumerate(result.candidates[:max_rows], 1):
        p = candidate.prediction
        b = p.breakdown
        table.add_row(
            str(i), candidate.config.label(), (">" if p.peak_is_lower_bound else "") + format_bytes(p.peak_bytes),
            format_bytes(b.params),
            format_bytes(b.grads), format_bytes(b.optimizer), format_bytes(b.activations), format_bytes(b.other),
            f"{p.step_time_s:.3g}", f"{p.samples_per_s:.3g}", "yes" if p.fits else f"no: {p.reason}",
        )
    console.print(table)
    if hw.kind == "cuda":
        console.print(cuda_band_line(result.margin), markup=False)
    if result.recipe is not None:

        console.print(recipe_line(result.recipe.to_dict()), markup=False)
    if getattr(result, "software", None) is not None:
        console.print(f"software: {result.software.summary()}", markup=False)
    if len(result.candidates) > max_rows:
        console.print(f"... {len(result.candidates) - max_rows} more (--json lists all)")
    if getattr(result, "kernel_note", None):
        console.print(f"Attention: {result.kernel_note}", markup=False)
    traces = getattr(result.facts, "attention_traces", None) or {}
    for kernel, how in traces.items():
        console.print(f"{kernel} attention is predicted from a trace through the {how}", markup=False)
    if result.rejected:

        console.print("Pruned by the space's rules before pricing:")
        for line in describe_rejections(result.rejected):
            console.print(f"  {line}", markup=False)  # a reason may name an extra: pip install -e '.[fp8]'


def model_line(model: Any) -> str:
    """``model: llama_gqa, 3.2 M parameters (3.2 M trainable)`` (:class:`autofit.planning.estimate.ModelSummary`)."""
    return (f"model: {model.name}, {parameter_count(model.n_params)} parameters "
            f"({parameter_count(model.n_trainable_params)} trainable)")


def parameter_count(n: int) -> str:
    """Millions with one decimal (the ladder's title writes them so), a count under 100,000 whole."""
    return f"{n / 1e6:,.1f} M" if n >= 100_000 else f"{n:,}"


def print_probe(measured: ProbeResult) -> None:
    """``autofit probe``'s table: what the probe measured beside what was predicted for it (0 where nothing was)."""
    console = Console(width=None if Console().is_terminal else 180)
    table = Table(title=f"probe: {measured.status}")
    table.add_column("")
    table.add_column("measured", justify="right")
    table.add_column("predicted", justify="right")
    predicted = measured.predicted
    table.add_row("peak memory", format_bytes(measured.peak_bytes), format_bytes(predicted.peak_bytes if predicted else 0))
    table.add_row("step time s", f"{measured.step_time_s:.4g}", f"{predicted.step_time_s if predicted else 0:.4g}")
    table.add_row("samples/s", f"{measured.samples_per_s:.4g}", f"{predicted.samples_per_s if predicted else 0:.4g}")
    console.print(table)
    if measured.message:
        console.print(measured.message)


def print_ladder(ladder: Any) -> None:
    """The ladder (:class:`autofit.planning.ladder.Ladder`): one row a rung, measured columns where it was probed."""

    console = Console(width=None if Console().is_terminal else 200)
    header, rows = ladder_rows(ladder)
    table = Table(title=ladder_title(ladder))
    for column in header:
        table.add_column(column, justify="left" if column in ("rung", "changed", "config", "vs recipe", "fits") else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
