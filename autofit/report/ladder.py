"""The ladder as text, table rows and a chart: for ``autofit ladder`` and the end of ``autofit run``'s report.

The chart is drawn like the report's other pictures (:mod:`autofit.report.folder`): matplotlib with the Agg
backend, one PNG beside ``report.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.core.config import Config
from autofit.core.recipe import differences
from autofit.core.units import format_bytes
from autofit.cost_model.budget import budget_text
from autofit.cost_model.prediction import PredictionRecord
from autofit.planning.ladder import Ladder, LadderRow, recipe_label
from autofit.report.plots import pyplot

if TYPE_CHECKING:
    from autofit.tuner.records import SearchResult

HEADER = ["#", "rung", "changed", "config", "vs recipe", "pred. peak", "pred. samples/s", "fits", "why not"]
MEASURED_HEADER = ["probe", "meas. peak", "meas. samples/s"]
COLORS = {"fits": "#2a9d8f", "too big": "#e63946", "cannot run": "#adb5bd", "winner": "#e9c46a"}


def ladder_title(ladder: Ladder) -> str:
    return (f"{ladder.name} ({ladder.n_params / 1e6:,.1f} M parameters) on {ladder.world_size} x "
            f"{ladder.hardware.name} ({budget_text(ladder.hardware.memory_bytes, ladder.margin)} each), "
            f"global batch {ladder.global_batch}")


def fit_label(row: LadderRow) -> str:
    return "yes" if row.fits else ("cannot run" if row.rule else "no")


def ladder_rows(ladder: Ladder) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the ladder; the measured columns only where some rung was probed."""
    measured = any(row.measured for row in ladder.rows)
    header = HEADER + (MEASURED_HEADER if measured else [])
    rows = []
    for row in ladder.rows:
        p = row.prediction
        cells = [str(row.index), row.rung.name, row.rung.changed, row.config.label(), row.recipe_label,
                 format_bytes(p.peak_bytes),
                 f"{p.samples_per_s:.3g}", fit_label(row), row.why_not or ""]
        if measured:
            cells += _measured_cells(row.measured)
        rows.append(cells)
    return header, rows


def _measured_cells(measured: dict[str, Any] | None) -> list[str]:
    if not measured:
        return ["-", "-", "-"]
    ok = measured.get("status") == "ok"
    peak = int(measured.get("peak_bytes") or 0)
    return [str(measured.get("status")), format_bytes(peak) if peak else "-",
            f"{measured.get('samples_per_s', 0):.3g}" if ok else "-"]


def winner_place(ladder: Ladder, winner: Config, predicted_samples_per_s: float) -> str:
    """Where the search's winner stands against the rungs (both priced by the same calibrated model)."""
    same = [row for row in ladder.rows if row.config == winner]
    if same:
        return f"The winner is rung {same[0].index} ({same[0].rung.name}) of the ladder."
    fitting = [row for row in ladder.rows if row.fits]
    if not fitting:
        return (f"No rung of the ladder is predicted to fit {budget_text(ladder.hardware.memory_bytes, ladder.margin)}; the winner "
                f"({winner.label()}) does: it differs from the last rung in {_differences(winner, ladder.rows[-1].config)}.")
    best = max(fitting, key=lambda row: row.prediction.samples_per_s)
    ratio = predicted_samples_per_s / best.prediction.samples_per_s if best.prediction.samples_per_s else 0.0
    return (f"{len(fitting)} of the {len(ladder.rows)} rungs are predicted to fit; the fastest of them, rung "
            f"{best.index} ({best.rung.name}), is predicted {best.prediction.samples_per_s:.3g} samples/s. The winner "
            f"({winner.label()}) is predicted {predicted_samples_per_s:.3g} samples/s, {ratio:.2f}x that rung, and "
            f"differs from it in {_differences(winner, best.config)}.")


def _differences(config: Config, other: Config) -> str:
    a, b = config.to_dict(), other.to_dict()
    return ", ".join(f"{key}={a[key]} (rung: {b[key]})" for key in a if a[key] != b[key]) or "nothing"


def search_ladder(ladder: Ladder, result: SearchResult) -> Ladder:
    """The ladder with the search's own measurements of any rung it probed (the latest ok probe of that config)."""
    probed = {t.config: t.measured.to_json() for t in result.trials if t.status == "ok"}
    return ladder.with_measured({row.index: probed[row.config] for row in ladder.rows if row.config in probed})


def winner_recipe_label(ladder: Ladder, result: SearchResult) -> str:
    """The winner's ``vs recipe`` cell, as the rungs' (:func:`autofit.planning.ladder.recipe_label`) against the
    recipe the rungs are compared with (the search's); ``-`` for a ladder made without one."""
    recipe = ladder.recipe
    return "-" if recipe is None else recipe_label(differences(recipe, result.config))


def ladder_section(ladder: Ladder, result: SearchResult) -> tuple[str, str, list[str], list[list[str]]]:
    """``(title, paragraph, header, rows)`` of the report's last section: the ladder, then the winner's row."""
    ladder = search_ladder(ladder, result)
    _, rows = ladder_rows(ladder)
    if not any(row.measured for row in ladder.rows):
        rows = [cells + _measured_cells(None) for cells in rows]
    predicted = result.predicted
    rows.append(["*", "winner", "the search's verified pick", result.config.label(), winner_recipe_label(ladder, result),
                 format_bytes(predicted.peak_bytes), f"{predicted.samples_per_s:.3g}", "yes",
                 "", *_measured_cells(result.measured.to_json())])
    text = (f"The build-along table of memory techniques for this model: {ladder_title(ladder)}. Each rung adds one "
            "memory technique to the rung before; predictions are the search's calibrated ones, measurements the "
            "search's own probes of that config where it made one. "
            f"{winner_place(ladder, result.config, predicted.samples_per_s)}")
    return "Ladder", text, HEADER + MEASURED_HEADER, rows


def ladder_chart(ladder: Ladder, path: str | Path,
                 winner: tuple[str, PredictionRecord, dict[str, Any]] | None = None) -> None:
    """Predicted peak against the device memory and predicted samples/s, one bar a rung, a black tick where it was
    measured; ``winner``: ``(label, predicted, measured)`` of the search's winner, drawn as the last bar."""
    plt = pyplot()
    scale, unit = (2**30, "GiB") if ladder.hardware.memory_bytes >= 4 * 2**30 else (2**20, "MiB")
    bars = [(f"{row.index} {row.rung.name}", COLORS["fits" if row.fits else "cannot run" if row.rule else "too big"],
             row.prediction.record(), row.measured) for row in ladder.rows]
    if winner:
        bars.append((f"winner: {winner[0]}", COLORS["winner"], winner[1], winner[2]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.45 * len(bars) + 1.6), sharey=True)
    for i, (_, color, predicted, measured) in enumerate(bars):
        left.barh(i, predicted.peak_bytes / scale, color=color)
        right.barh(i, predicted.samples_per_s, color=color)
        if measured and measured.get("status") == "ok":
            left.plot([measured["peak_bytes"] / scale] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
            right.plot([measured["samples_per_s"]] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
    budget = left.axvline(ladder.hardware.memory_bytes / scale, color="red", ls="--")
    left.set_yticks(range(len(bars)), [name for name, *_ in bars], fontsize=8)
    left.invert_yaxis()
    left.set_xlabel(f"predicted peak ({unit}); black: measured")
    right.set_xlabel("predicted samples/s; black: measured")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    left.legend([*handles, budget], [*COLORS, "device memory"], fontsize=7, loc="best")
    fig.suptitle(ladder_title(ladder), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
