"""Shared plumbing of the ``compare_*`` benchmarks (autofit beside the tools people use today).

Each ``compare_*.py`` writes three files under ``benchmarks/results/``: ``<name>.json`` (every row,
the source of the other two), ``<name>.md`` (the markdown table the README quotes) and ``<name>.png``
(the chart). Probe results are cached in JSON by a key, so re-rendering a table costs no probe.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
os.environ.setdefault("DS_ACCELERATOR", "cpu")

MIB = 2**20


def relative_error(predicted: float | None, measured: float) -> float | None:
    """``(predicted - measured) / measured``; None where the tool gave no number."""
    if predicted is None or measured <= 0:
        return None
    return (predicted - measured) / measured


def error_summary(errors: Iterable[float | None]) -> dict[str, Any]:
    """Median and worst absolute error, worst under-prediction, and how many rows had a number."""
    values = [e for e in errors if e is not None]
    if not values:
        return {"n": 0, "median_abs": None, "worst_abs": None, "worst_under": None}
    return {
        "n": len(values),
        "median_abs": statistics.median(abs(e) for e in values),
        "worst_abs": max(abs(e) for e in values),
        "worst_under": min(min(values), 0.0),
    }


def markdown_table(header: list[str], rows: Iterable[list[Any]], right: int = 1) -> str:
    """A markdown table; columns from ``right`` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f}%"


class JsonCache:
    """A dict of JSON-able values kept in one file, written after every ``put`` (a run that is stopped
    keeps what it measured)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}

    def get_or_compute(self, key: str, compute: Callable[[], Any]) -> Any:
        if key not in self.data:
            self.data[key] = compute()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
            tmp.replace(self.path)
        return self.data[key]


def write_results(name: str, rows: Any, markdown: str, figure: Any, out_dir: Path = RESULTS) -> list[Path]:
    """``<name>.json``, ``<name>.md`` and ``<name>.png`` (from a matplotlib figure) in ``out_dir``; prints
    where, then the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md", out_dir / f"{name}.png"]
    paths[0].write_text(json.dumps(rows, indent=1) + "\n")
    paths[1].write_text(markdown.rstrip() + "\n")
    figure.savefig(paths[2], dpi=110, bbox_inches="tight")
    print("\n".join(f"wrote {path}" for path in paths))
    print(markdown)
    return paths


def new_figure(n_axes: int = 1, width: float = 7.0, height: float = 4.0) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, n_axes, figsize=(width * n_axes, height), squeeze=False)
