"""``autofit schedule add|list``, ``autofit worker`` and ``autofit results``: searches queued in a shared Optuna
storage, run by workers on other machines (docs/design.md, "Scheduling"; :mod:`autofit.schedule`).

Each command's logic is one function here, called by the CLI with the values its options parsed; a database error is
one line, the URL's password hidden (:func:`autofit.tuner.storage.storage_errors`). The :mod:`autofit.schedule`
modules import sqlalchemy: each function imports them when it runs, so ``autofit --help`` does not.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from autofit.machine.device import get_hardware
from autofit.machine.fingerprint import detect_machine, worker_name
from autofit.planning.target import Target, prepare
from autofit.schedule.checks import allowed_hub, check_device, check_nodes, detected_devices, entry_roots
from autofit.tuner.storage import check_url, storage_errors

if TYPE_CHECKING:
    from autofit.schedule.queue import Added


def add_target(target: Target, *, trials: int, storage: str) -> Added:
    """``autofit schedule add``: queue one search of ``target`` (its entry made absolute: workers start elsewhere)
    with at most ``trials`` probes; a search already done for the same model, space, request and machine answers
    with its stored winner at once."""
    from autofit.schedule.submit import absolute_entry, make_request, submit  # sqlalchemy: module docstring

    target = dataclasses.replace(target, entry=absolute_entry(target.entry or ""))
    setup = prepare(target)
    request = make_request(setup.entry_point, setup.hardware, gpus=setup.gpus, nodes=target.nodes,
                           global_batch=target.global_batch, space=setup.space, fixed=setup.fixed, trials=trials,
                           memory_bytes=target.memory_bytes(), recipe=setup.recipe, margin=target.margin)
    with storage_errors(storage):
        return submit(storage, setup.plan(), setup.loaded_workload, request)


def list_searches(storage: str) -> list[dict[str, Any]]:
    """``autofit schedule list``: every search, with its hardware, state, trials, worker and best so far."""
    from autofit.schedule.status import search_summaries  # sqlalchemy: module docstring

    with storage_errors(storage):
        return search_summaries(storage)


def serve(storage: str, *, hardware: str, gpus: int | None, nodes: int, idle_exit_s: float, lease_s: float,
          max_claims: int, entry_root: Sequence[str], allow_hub: Sequence[str] = ()) -> None:
    """``autofit worker``: run the queued searches that match this machine's fingerprint until idle for
    ``idle_exit_s``, loading only entries under ``entry_root`` and, with roots, only the Hub models of ``allow_hub``;
    every value checked first (a wrong URL, a root that is no folder, a preset that is not the
    device here: one line, never a retry)."""
    from autofit.schedule.worker import Worker  # sqlalchemy: module docstring

    check_url(storage)
    roots = entry_roots(entry_root)
    device = get_hardware(hardware)
    check_nodes(device.kind, nodes)  # a worker launches on this machine: no multi-node CUDA search on one node
    check_device(hardware, detected_devices())  # a preset must be the GPU here: else it claims another's searches
    machine = detect_machine(device, gpus)
    with storage_errors(storage):  # what is no outage (a failed statement): one line, not a retry
        Worker(storage, worker_name(), device, machine, nodes=nodes, lease_s=lease_s, idle_exit_s=idle_exit_s,
               max_claims=max_claims, entry_roots=roots, allow_hub=allowed_hub(allow_hub)).serve()


def results(storage: str, *, prices: Sequence[str], entry: str | None,
            report_dir: str | os.PathLike[str] | None) -> list[dict[str, Any]]:
    """``autofit results``: each model's winners across hardware, priced by ``prices`` (``NAME=USD_PER_DEVICE_HOUR``);
    with ``report_dir``, ``results.md``, ``results.json`` and ``results.png`` written there."""
    from autofit.schedule.results import compare, parse_prices, write_results_report  # sqlalchemy: module docstring

    with storage_errors(storage):
        rows = compare(storage, parse_prices(tuple(prices)), entry)
    if report_dir is not None:
        write_results_report(rows, report_dir)
    return rows
