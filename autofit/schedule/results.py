"""``autofit results``: the winners of one model across hardware, side by side, with what they cost.

One row per (entry, device, device count): the newest finished search's measured winner, or, where no
worker has run it yet, the cost model's best predicted candidate for the preset (``source:
predicted``, what ``schedule add`` planned). Per row: samples/s, tokens/s, peak memory and headroom
(device memory minus the winner's peak), and with ``--price NAME=USD_PER_DEVICE_HOUR`` the cost of a
million tokens (or samples): ``price x devices / 3600 / (tokens per s) x 10^6`` dollars.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS
from autofit.core.units import format_bytes
from autofit.cost_model.prediction import PredictionRecord
from autofit.ds.emit import write_text_atomic
from autofit.probe.result import ProbeResult
from autofit.schedule import queue
from autofit.schedule.store import FINISHED, optuna_storage


def parse_prices(pairs: tuple[str, ...] | list[str]) -> dict[str, float]:
    """``("h100-80gb=3.5", ...)`` -> ``{"h100-80gb": 3.5}`` (US dollars per device-hour); a name that is no
    preset nor ``cpu`` is an error (a typo would silently price nothing)."""

    known = (*PRESETS, "cpu")
    prices = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not name or not 0 <= price < math.inf:
            raise AutofitError(f"--price takes NAME=USD_PER_DEVICE_HOUR (e.g. h100-80gb=3.5, finite, >= 0), "
                               f"but got {pair!r}")
        if name.lower() not in known:
            raise AutofitError(f"--price {pair}: unknown hardware {name!r}; known: {', '.join(known)}")
        prices[name.lower()] = price
    return prices


MISSING = {"config": None, "memory_bytes": None, "samples_per_s": None, "tokens_per_s": None, "peak_bytes": None,
           "machine": None}
"""A row whose study is missing from the store: shown as such, with no figures."""
RANK = {"measured": 2, "predicted": 1, "missing": 0}
"""Which row of one (entry, device, count) is shown: the newest of the best known source."""


def _row(search: Any, attrs: dict[str, Any] | None) -> dict[str, Any] | None:
    """One search as a results row: measured when a worker finished it, else predicted (planned at add time);
    ``attrs`` None: its study is missing from the store."""
    base = {"id": search.id, "entry": search.entry, "hardware": search.hardware, "devices": search.gpus * search.nodes,
            "state": search.state}
    if attrs is None:
        return base | {"source": "missing"} | MISSING
    result = attrs.get(queue.RESULT_ATTR)
    if search.state == "done" and result:
        measured = ProbeResult.from_json(result["best"]["measured"])
        return base | {"source": "measured", "config": result["best"]["config"], "memory_bytes": result["memory_bytes"],
                       "samples_per_s": measured.samples_per_s, "tokens_per_s": measured.tokens_per_s,
                       "peak_bytes": measured.peak_bytes, "machine": result["machine"]["key"]}
    planned = attrs.get(queue.PLANNED_ATTR)
    if search.state in FINISHED or not planned:
        return None  # nothing fits: no winner to compare
    predicted = PredictionRecord.from_json(planned["predicted"], "a search's planned winner: predicted")
    return base | {"source": "predicted", "config": planned["config"], "memory_bytes": planned["memory_bytes"],
                   "samples_per_s": predicted.samples_per_s, "tokens_per_s": predicted.tokens_per_s,
                   "peak_bytes": predicted.peak_bytes, "machine": None}


def priced(row: dict[str, Any], prices: dict[str, float]) -> dict[str, Any]:
    """``row`` with headroom and, where the device has a price, dollars per hour and per million tokens/samples."""
    if row["memory_bytes"] is None:  # a missing study: nothing to price
        return row | {"headroom_bytes": None, "headroom_fraction": None, "usd_per_hour": None,
                      "usd_per_million_tokens": None, "usd_per_million_samples": None}
    headroom = row["memory_bytes"] - int(row["peak_bytes"] or 0)
    out = row | {"headroom_bytes": headroom, "headroom_fraction": headroom / row["memory_bytes"],
                 "usd_per_hour": None, "usd_per_million_tokens": None, "usd_per_million_samples": None}
    price = prices.get(row["hardware"])
    if price is None:
        return out
    per_hour = price * row["devices"]
    out["usd_per_hour"] = per_hour
    if row["samples_per_s"]:
        out["usd_per_million_samples"] = per_hour / 3600 / row["samples_per_s"] * 1e6
    if row["tokens_per_s"]:
        out["usd_per_million_tokens"] = per_hour / 3600 / row["tokens_per_s"] * 1e6
    return out


def compare(url: str, prices: dict[str, float] | None = None, entry: str | None = None) -> list[dict[str, Any]]:
    """The newest row per (entry, device, count), measured before predicted, fastest first within an entry."""
    import optuna

    storage = optuna_storage(url)
    newest: dict[tuple[str, str, int], dict[str, Any]] = {}
    for search in queue.search_rows(url):  # oldest first: a newer search replaces an older one
        if entry is not None and search.entry != entry:
            continue
        try:
            attrs: dict[str, Any] | None = dict(optuna.load_study(study_name=search.study_name, storage=storage).user_attrs)
        except KeyError:  # the study was deleted from the store: the row says so, the others are shown
            attrs = None
        row = _row(search, attrs)
        if row is None:
            continue
        key = (row["entry"], row["hardware"], row["devices"])
        if key not in newest or RANK[row["source"]] >= RANK[newest[key]["source"]]:  # newer, unless less known
            newest[key] = row
    rows = [priced(r, prices or {}) for r in newest.values()]
    return sorted(rows, key=lambda r: (r["entry"], -(r["samples_per_s"] or 0.0)))


def print_results(rows: list[dict[str, Any]]) -> None:

    table = Table(title="autofit results")
    for column in ("entry", "hardware", "source", "config", "samples/s", "tokens/s", "headroom", "$/h", "$/M"):
        table.add_column(column)
    for r in rows:
        table.add_row(*_cells(r))
    Console().print(table)


def _cells(r: dict[str, Any]) -> list[str]:

    per_million = r["usd_per_million_tokens"] if r["usd_per_million_tokens"] is not None else r["usd_per_million_samples"]
    unit = " tok" if r["usd_per_million_tokens"] is not None else " samples"
    if r["source"] == "missing":
        return [r["entry"].rsplit("/", 1)[-1], f"{r['hardware']} x{r['devices']}", "missing (study not in the store)",
                *["-"] * 6]
    return [
        r["entry"].rsplit("/", 1)[-1], f"{r['hardware']} x{r['devices']}", r["source"], Config.from_dict(r["config"]).label(),
        f"{r['samples_per_s']:.4g}", "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.4g}",
        f"{format_bytes(r['headroom_bytes'])} ({r['headroom_fraction']:.0%})",
        "-" if r["usd_per_hour"] is None else f"{r['usd_per_hour']:.2f}",
        "-" if per_million is None else f"{per_million:.4g}{unit}",
    ]


def write_results_report(rows: list[dict[str, Any]], report_dir: str | os.PathLike[str]) -> Path:
    """``results.json``, ``results.md`` (the table) and ``results.png`` (throughput and cost by device), each
    written to a temporary file beside it and renamed into place (:func:`autofit.ds.emit.write_text_atomic`): a
    reader never sees half a report, a failure leaves the old one."""

    folder = Path(report_dir)
    folder.mkdir(parents=True, exist_ok=True)
    header = ["entry", "hardware", "source", "config", "samples/s", "tokens/s", "headroom", "$/h", "$/M"]
    lines = ["# autofit results", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    chart = folder / f".results.png.{os.getpid()}.tmp"
    try:
        _chart([r for r in rows if r["source"] != "missing"], chart)
        write_text_atomic(folder / "results.json", json.dumps({"results": rows}, indent=1))
        write_text_atomic(folder / "results.md", "\n".join(lines) + "\n")
        os.replace(chart, folder / "results.png")
    finally:
        chart.unlink(missing_ok=True)
    return folder / "results.md"


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['hardware']} x{r['devices']}\n{r['entry'].rsplit('/', 1)[-1].rsplit(':', 1)[-1]}" for r in rows]
    colors = ["#2a9d8f" if r["source"] == "measured" else "#a8dadc" for r in rows]
    fig, (speed, cost) = plt.subplots(1, 2, figsize=(max(6.0, 1.6 * len(rows) + 2), 4))
    speed.bar(labels, [r["samples_per_s"] or 0.0 for r in rows], color=colors)
    speed.set_ylabel("samples/s (light: predicted)")
    speed.set_title("Throughput of each device's winner")
    per_million = [r["usd_per_million_tokens"] or r["usd_per_million_samples"] or 0.0 for r in rows]
    cost.bar(labels, per_million, color=colors)
    cost.set_ylabel("USD per 1M tokens (or samples)")
    cost.set_title("Cost (devices with a --price)")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
