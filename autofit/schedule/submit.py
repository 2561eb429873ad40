"""``autofit schedule add``: make a search's request from the command's options and queue it.

The workload is loaded and traced here, on the machine that adds the search: its fingerprint goes into
the cache key, and the cost model's best candidate for the named device is kept as the plan
(``autofit results`` shows it for devices no worker has run yet). Workers load the entry again where
they run, so it must be importable there (a path on a shared file system, or an installed package).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autofit.core.hardware import Hardware
from autofit.core.recipe import Recipe
from autofit.core.space import SearchSpace
from autofit.cost_model.budget import DEFAULT_MARGIN, check_margin
from autofit.machine.fingerprint import check_device_name, device_name
from autofit.planning.estimate import estimate
from autofit.schedule import queue
from autofit.schedule.request import SearchRequest
from autofit.workload.hf import HfEntry, is_hf_entry
from autofit.workload.sources import sources_digest, workload_fingerprint


def absolute_entry(entry: str) -> str:
    """``path.py:fn`` with the path made absolute (workers start elsewhere), an ``hf:`` entry's local folder too;
    ``package.module:fn`` and a Hub name as they are."""

    if is_hf_entry(entry):
        return HfEntry.parse(entry).absolute().to_entry()
    target, sep, attr = entry.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target):
        return f"{Path(target).resolve()}:{attr}"
    return entry


def make_request(entry: str, hardware: Hardware, *, gpus: int, nodes: int, global_batch: int | None,
                 space: SearchSpace, fixed: dict[str, Any], trials: int, memory_bytes: int | None,
                 recipe: Recipe | None = None, margin: float = DEFAULT_MARGIN) -> SearchRequest:
    """The study's ``request``: all a worker needs to plan the search again (``recipe``: the user's; None: the worker's
    device default, :func:`autofit.planning.plan.default_recipe`; ``margin``: what the worker's search judges fits by,
    as the preview here did)."""
    return SearchRequest(
        entry=entry, hardware=check_device_name(device_name(hardware)), gpus=gpus, nodes=nodes,
        global_batch=global_batch, space=space.to_dict(), space_name=space.name,
        fixed={k: fixed[k] for k in sorted(fixed)}, trials=trials, memory_bytes=memory_bytes,
        margin=check_margin(margin), recipe=recipe,
        sources=sources_digest(entry),  # compared by a worker before it imports the entry
    )


def planned(plan: Any) -> dict[str, Any] | None:
    """The cost model's fastest candidate predicted to fit (prior coefficients; within the plan's usable budget, as
    the worker's search judges it), None when none does."""

    fitting = estimate(plan).fitting
    if not fitting:
        return None
    best = fitting[0]
    return {"config": best.config.to_dict(), "predicted": best.prediction.to_dict(), "memory_bytes": plan.hardware.memory_bytes,
            "margin": plan.margin, "usable_bytes": plan.usable_bytes}


def submit(url: str, plan: Any, workload: Any, request: SearchRequest) -> queue.Added:
    """Queue ``request`` (or return the same search queued, running or finished: ``cached``)."""
    return queue.add_search(url, request, workload_fingerprint(request.entry, workload), planned(plan))
