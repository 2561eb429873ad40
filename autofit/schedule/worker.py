"""``autofit worker``: claim queued searches this machine can run, run each, keep the claim alive.

A worker registers its :class:`~autofit.schedule.fingerprint.MachineFingerprint`, then loops: claim the
oldest search for its device (:func:`autofit.schedule.queue.claim`), run it with
:func:`autofit.search.run_search` on the search's own study, store the winner in the study and mark
the search ``done`` (``nothing-fits``, ``failed``). While it runs, a thread renews the lease; a worker
that lost its lease (it stalled past it and another worker took the search over) stops at the next
progress event instead of probing beside the new holder. It exits after ``idle_exit_s`` with nothing
to claim.

A worker that dies leaves its search ``running`` with a heartbeat that stops; once the lease has run
out another worker claims it and opens the same study: :func:`autofit.search.study.read_back` fails the
trial the dead worker left running and hands back every finished probe, so none is repeated.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.errors import AutofitError
from autofit.hardware import Hardware
from autofit.schedule import queue
from autofit.schedule.checks import entry_refusal
from autofit.schedule.fingerprint import MachineFingerprint, workload_fingerprint
from autofit.storage_url import redact_url, scrub

if TYPE_CHECKING:
    from autofit.search.records import SearchResult


class LeaseLost(AutofitError):
    """Another worker holds the search now: this one stops probing it."""


@dataclass
class Worker:
    """One worker process's settings."""

    url: str
    """The shared storage (SQLAlchemy URL)."""
    worker_id: str
    """``host-pid``, unique among the store's workers."""
    hardware: Hardware
    """This machine's device (detected, or the preset named with ``--hardware``)."""
    machine: MachineFingerprint
    """This machine's fingerprint."""
    nodes: int = 1
    """Nodes this worker can launch a probe on."""
    lease_s: float = queue.DEFAULT_LEASE_S
    """Seconds without a heartbeat after which another worker may take a search over."""
    idle_exit_s: float = 60.0
    """Exit after this many seconds with nothing to claim."""
    poll_s: float = 2.0
    """Seconds between claims while idle."""
    prober: Callable[[Any], Any] | None = None
    """``plan -> Prober`` (default: the subprocess probe); a test or a remote executor plugs in here."""
    log: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr, flush=True))
    entry_roots: tuple[Path, ...] | None = None
    """Folders entry points are imported from (:func:`autofit.schedule.checks.entry_roots`); None: any."""
    given_back: set[str] = field(default_factory=set)
    """Searches this worker gave back (an entry it may not or cannot import): not claimed again."""

    def __post_init__(self) -> None:  # every log line without the storage's password
        raw_log = self.log
        self.log = lambda text: raw_log(scrub(text, self.url))

    def serve(self) -> list[str]:
        """Register, then run claimed searches until idle for ``idle_exit_s``; the ids of searches it ran."""
        queue.register_worker(self.url, self.worker_id, self.machine)
        self.log(f"autofit worker {self.worker_id}: {self.machine.device} x{self.machine.n_devices}, "
                 f"machine {self.machine.key()}, store {redact_url(self.url)}")
        ran: list[str] = []
        idle_since = time.monotonic()
        while True:
            search_id = queue.claim(self.url, self.worker_id, self.machine, self.nodes, self.lease_s, self.given_back)
            if search_id is not None:
                ran.append(search_id)
                self.run_one(search_id)
                idle_since = time.monotonic()
                continue
            if time.monotonic() - idle_since >= self.idle_exit_s:
                queue.set_worker_state(self.url, self.worker_id, "exited")
                self.log(f"autofit worker {self.worker_id}: idle {self.idle_exit_s:g} s, exiting")
                return ran
            time.sleep(self.poll_s)

    def run_one(self, search_id: str) -> str:
        """Run one claimed search to its end; the state it was left in."""
        refusal = self._refusal(search_id)
        if refusal is not None:  # checked before importing: another worker may run it, this one will not claim it again
            self.given_back.add(search_id)
            queue.give_back(self.url, search_id, self.worker_id, refusal)
            self.log(f"autofit worker {self.worker_id}: {search_id} given back: {refusal}")
            return "given back"
        queue.set_worker_state(self.url, self.worker_id, "busy")
        self.log(f"autofit worker {self.worker_id}: running {search_id}")
        with Lease(self.url, search_id, self.worker_id, self.lease_s) as lease:
            state, message = self._attempt(search_id, lease)
        if state is not None and not queue.finish(self.url, search_id, self.worker_id, state, message):
            state = None
        self.log(f"autofit worker {self.worker_id}: {search_id} {state or 'taken over'}"
                 + (f": {message}" if message else ""))
        queue.set_worker_state(self.url, self.worker_id, "idle")
        return state or "taken over"

    def _refusal(self, search_id: str) -> str | None:
        """Why this worker gives ``search_id`` back (:func:`autofit.schedule.checks.entry_refusal`), None to run it."""
        try:
            entry = queue.study_attrs(self.url, search_id)[queue.REQUEST_ATTR]["entry"]
        except Exception:  # the study is gone or the store down: the attempt fails it and says why
            return None
        return entry_refusal(entry, self.entry_roots)

    def _progress(self, search_id: str, lease: Lease, event: Any) -> None:
        lease.check(event)
        self.log(f"autofit worker {self.worker_id}: {search_id} trial {event.n_done}/{event.trials} {event.text}")

    def _attempt(self, search_id: str, lease: Lease) -> tuple[str | None, str | None]:
        """``(state, message)``; state None when the lease was lost."""
        from autofit.search import SearchSettings, run_search

        try:
            attrs = queue.study_attrs(self.url, search_id)
            plan = plan_for(attrs, self.hardware)
            settings = SearchSettings(trials=int(attrs[queue.REQUEST_ATTR]["trials"]))
            with tempfile.TemporaryDirectory(prefix="autofit-worker-") as tmp:
                result = run_search(plan, settings, out_path=Path(tmp) / "ds_config.json", storage=self.url,
                                    study_name=queue.study_name(search_id),
                                    prober=self.prober(plan) if self.prober else None,
                                    on_event=lambda event: self._progress(search_id, lease, event))
        except LeaseLost:
            return None, None
        except AutofitError as exc:
            state = "nothing-fits" if str(exc).startswith("nothing fits") else "failed"
            return state, scrub(str(exc), self.url)
        except Exception as exc:  # the user's model or the environment: the search fails, the worker goes on
            return "failed", scrub(f"{type(exc).__name__}: {exc}", self.url)
        store_winner(self.url, search_id, result, self.machine, plan)
        return "done", None


def plan_for(attrs: dict[str, Any], hardware: Hardware) -> Any:
    """The search's :class:`~autofit.plan.Plan` on this worker's device; the workload must be the one queued."""
    from autofit.plan import Plan
    from autofit.recipe import Recipe
    from autofit.space import space_from_dict
    from autofit.workload import load_workload

    request = attrs[queue.REQUEST_ATTR]
    workload = load_workload(request["entry"])
    if workload_fingerprint(request["entry"], workload) != attrs.get("workload_fp"):
        raise AutofitError(f"{request['entry']} is not the workload that was queued (its file or model changed); "
                           "add the search again")
    if request.get("memory_bytes") is not None:
        hardware = hardware.with_memory(int(request["memory_bytes"]))
    hardware = replace(hardware, devices_per_node=request["gpus"])  # as schedule add planned it (target.py)
    space = space_from_dict(request["space"], name=request["space_name"])
    return Plan.make(request["entry"], workload, hardware, space, world_size=request["gpus"] * request["nodes"],
                     global_batch=request["global_batch"], fixed=request["fixed"],
                     recipe=Recipe.from_dict(request["recipe"]) if request.get("recipe") else None)


def store_winner(url: str, search_id: str, result: SearchResult, machine: MachineFingerprint, plan: Any) -> None:
    """Keep the winner in the study's user attributes: what ``schedule add`` returns cached, ``results`` compares."""
    import optuna

    from autofit.schedule.store import optuna_storage

    study = optuna.load_study(study_name=queue.study_name(search_id), storage=optuna_storage(url))
    study.set_user_attr(queue.RESULT_ATTR, {
        "best": {"config": result.config.to_dict(), "measured": result.measured.to_json(), "predicted": result.predicted},
        "deepspeed": result.deepspeed,
        "hardware": plan.hardware.name,
        "memory_bytes": plan.hardware.memory_bytes,
        "world_size": result.world_size,
        "machine": machine.to_dict(),
        "n_probes": result.n_probes,
        "stop_reason": result.stop_reason,
    })


class Lease:
    """A thread renewing a search's heartbeat every ``lease_s / 3`` seconds while the worker runs it."""

    def __init__(self, url: str, search_id: str, worker_id: str, lease_s: float) -> None:
        self.url, self.search_id, self.worker_id, self.lease_s = url, search_id, worker_id, lease_s
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease-{search_id}", daemon=True)

    def __enter__(self) -> Lease:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if not queue.heartbeat(self.url, self.search_id, self.worker_id):
                    self.lost = True
                    return
            except Exception:  # a dropped connection: try again next beat, the lease has slack for two misses
                continue

    def check(self, event: Any) -> None:
        """The search's ``on_event``: stop a search whose lease another worker has taken."""
        if self.lost:
            raise LeaseLost(f"search {self.search_id} was taken over by another worker")


redact = redact_url  # the name this module had for it
