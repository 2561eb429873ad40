"""``autofit results``: the winners of one model across hardware, side by side, with what they cost.

One row per (entry, device, device count): the newest finished search's measured winner, or, where no
worker has run it yet, the cost model's best predicted candidate for the preset (``source:
predicted``, what ``schedule add`` planned). Per row: samples/s, tokens/s, peak memory and headroom
(device memory minus the winner's peak), and with ``--price NAME=USD_PER_DEVICE_HOUR`` the cost of a
million tokens (or samples): ``price x devices / 3600 / (tokens per s) x 10^6`` dollars.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from autofit.errors import AutofitError
from autofit.probe import ProbeResult
from autofit.schedule import queue
from autofit.schedule.store import FINISHED, optuna_storage


def parse_prices(pairs: tuple[str, ...] | list[str]) -> dict[str, float]:
    """``("h100-80gb=3.5", ...)`` -> ``{"h100-80gb": 3.5}`` (US dollars per device-hour)."""
    prices = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not name or not price >= 0:
            raise AutofitError(f"--price takes NAME=USD_PER_DEVICE_HOUR (e.g. h100-80gb=3.5), but got {pair!r}")
        prices[name.lower()] = price
    return prices


def _row(search: Any, attrs: dict[str, Any]) -> dict[str, Any] | None:
    """One search as a results row: measured when a worker finished it, else predicted (planned at add time)."""
    base = {"id": search.id, "entry": search.entry, "hardware": search.hardware, "devices": search.gpus * search.nodes,
            "state": search.state}
    result = attrs.get(queue.RESULT_ATTR)
    if search.state == "done" and result:
        measured = ProbeResult.from_json(result["best"]["measured"])
        return base | {"source": "measured", "config": result["best"]["config"], "memory_bytes": result["memory_bytes"],
                       "samples_per_s": measured.samples_per_s, "tokens_per_s": measured.tokens_per_s,
                       "peak_bytes": measured.peak_bytes, "machine": result["machine"]["key"]}
    planned = attrs.get(queue.PLANNED_ATTR)
    if search.state in FINISHED or not planned:
        return None  # nothing fits: no winner to compare
    predicted = planned["predicted"]
    return base | {"source": "predicted", "config": planned["config"], "memory_bytes": planned["memory_bytes"],
                   "samples_per_s": predicted["samples_per_s"], "tokens_per_s": predicted.get("tokens_per_s"),
                   "peak_bytes": predicted["peak_bytes"], "machine": None}


def priced(row: dict[str, Any], prices: dict[str, float]) -> dict[str, Any]:
    """``row`` with headroom and, where the device has a price, dollars per hour and per million tokens/samples."""
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
        attrs = dict(optuna.load_study(study_name=search.study_name, storage=storage).user_attrs)
        row = _row(search, attrs)
        if row is None:
            continue
        key = (row["entry"], row["hardware"], row["devices"])
        if row["source"] == "measured" or newest.get(key, {}).get("source") != "measured":
            newest[key] = row
    rows = [priced(r, prices or {}) for r in newest.values()]
    return sorted(rows, key=lambda r: (r["entry"], -(r["samples_per_s"] or 0.0)))


def print_results(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="autofit results")
    for column in ("entry", "hardware", "source", "config", "samples/s", "tokens/s", "headroom", "$/h", "$/M"):
        table.add_column(column)
    for r in rows:
        table.add_row(*_cells(r))
    Console().print(table)


def _cells(r: dict[str, Any]) -> list[str]:
    from autofit.config import Config
    from autofit.units import format_bytes

    per_million = r["usd_per_million_tokens"] if r["usd_per_million_tokens"] is not None else r["usd_per_million_samples"]
    unit = " tok" if r["usd_per_million_tokens"] is not None else " samples"
    return [
        r["entry"].rsplit("/", 1)[-1], f"{r['hardware']} x{r['devices']}", r["source"], Config.from_dict(r["config"]).label(),
        f"{r['samples_per_s']:.4g}", "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.4g}",
        f"{format_bytes(r['headroom_bytes'])} ({r['headroom_fraction']:.0%})",
        "-" if r["usd_per_hour"] is None else f"{r['usd_per_hour']:.2f}",
        "-" if per_million is None else f"{per_million:.4g}{unit}",
    ]


def write_results_report(rows: list[dict[str, Any]], report_dir: str | os.PathLike[str]) -> Path:
    """``results.json``, ``results.md`` (the table) and ``results.png`` (throughput and cost by device)."""
    folder = Path(report_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({"results": rows}, indent=1))
    header = ["entry", "hardware", "source", "config", "samples/s", "tokens/s", "headroom", "$/h", "$/M"]
    lines = ["# autofit results", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    (folder / "results.md").write_text("\n".join(lines) + "\n")
    _chart(rows, folder / "results.png")
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
