"""``autofit schedule list``: every search with its state, trials, worker and best so far.

Read only: trials are read from each study as stored (a running trial of a live worker is left as it
is; only a worker that resumes a study closes what a dead one left open).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from autofit.core.config import Config
from autofit.core.storage_url import scrub
from autofit.core.units import format_bytes
from autofit.probe.result import ProbeResult
from autofit.schedule import queue
from autofit.schedule.store import optuna_storage
from autofit.tuner.study import MEASURED_ATTR, PHASE_ATTR, WITHIN_MARGIN_ATTR


def best_so_far(trials: list[Any]) -> dict[str, Any] | None:
    """The fastest probe measured within the margin: ``{"config", "samples_per_s", "peak_bytes", "tokens_per_s"}``."""
    good = [ProbeResult.from_json(t.user_attrs[MEASURED_ATTR]) for t in trials
            if t.user_attrs.get(WITHIN_MARGIN_ATTR) and MEASURED_ATTR in t.user_attrs]
    return summary(max(good, key=lambda m: m.samples_per_s)) if good else None


def summary(measured: ProbeResult) -> dict[str, Any]:
    """A search's best, as ``schedule list`` shows it."""
    return {"config": measured.config.to_dict(), "samples_per_s": measured.samples_per_s,
            "tokens_per_s": measured.tokens_per_s, "peak_bytes": measured.peak_bytes}


def search_summaries(url: str) -> list[dict[str, Any]]:
    """``schedule list --json``'s ``searches``: one dict per search, oldest first."""
    import optuna

    storage = optuna_storage(url)
    out = []
    for row in queue.search_rows(url):
        try:
            study = optuna.load_study(study_name=row.study_name, storage=storage)
        except KeyError:  # the study was deleted from the store: this row says so, the others are listed
            out.append({"id": row.id, "entry": row.entry, "hardware": row.hardware, "gpus": row.gpus,
                        "nodes": row.nodes, "state": "missing", "trials": 0, "probes": 0, "worker": row.worker,
                        "claims": row.claims, "best": None,
                        "message": f"study {row.study_name} is missing from the store (the queue says {row.state})"})
            continue
        trials = study.get_trials(deepcopy=False)
        searched = sum(1 for t in trials if MEASURED_ATTR in t.user_attrs and t.user_attrs.get(PHASE_ATTR) == "search")
        result = study.user_attrs.get(queue.RESULT_ATTR)
        best = best_so_far(trials)
        if result is not None:
            best = summary(ProbeResult.from_json(result["best"]["measured"]))
        out.append({
            "id": row.id, "entry": row.entry, "hardware": row.hardware, "gpus": row.gpus, "nodes": row.nodes,
            "state": row.state, "trials": searched, "probes": sum(1 for t in trials if MEASURED_ATTR in t.user_attrs),
            "worker": row.worker, "claims": row.claims, "best": best,
            "message": scrub(row.message, url) if row.message else row.message,
        })
    return out


def print_searches(searches: list[dict[str, Any]]) -> None:
    """A rich table of :func:`search_summaries` on stdout."""


    table = Table(title="autofit searches")
    for column in ("id", "entry", "hardware", "state", "trials", "worker", "best"):
        table.add_column(column)
    for s in searches:
        best = s["best"]
        text = "-" if best is None else (
            f"{_label(best['config'])}: {best['samples_per_s']:.3g} samples/s, {format_bytes(int(best['peak_bytes'] or 0))}"
        )
        table.add_row(s["id"], s["entry"].rsplit("/", 1)[-1], f"{s['hardware']} x{s['gpus'] * s['nodes']}", s["state"],
                      str(s["trials"]), s["worker"] or "-", text)
    Console().print(table)


def _label(config: dict[str, Any]) -> str:

    return Config.from_dict(config).label()
