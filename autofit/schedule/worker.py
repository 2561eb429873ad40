"""``autofit worker``: claim queued searches this machine can run, run each, keep the claim alive.

A worker registers its :class:`~autofit.machine.fingerprint.MachineFingerprint`, then loops: claim the
oldest search for its device (:func:`autofit.schedule.queue.claim`), run it with
:func:`autofit.tuner.run_search` on the search's own study, store the winner in the study and mark
the search ``done`` (``nothing-fits``, ``failed``). While it runs, a thread renews the lease; a worker
that lost its lease (it stalled past it and another worker took the search over) stops at the next
progress event instead of probing beside the new holder. It exits after ``idle_exit_s`` with nothing
to claim.

What stops it: SIGTERM or SIGINT (the running probe's process groups killed, the search given back
``queued``, exit 0); a lost lease (the probe stopped at once, nothing stored: :func:`queue.finish` is
conditional on the claim). A database outage (the server down or restarting, a dropped connection:
:func:`autofit.tuner.storage.transient`) gives the search back and claims again after an exponential
backoff; the study's resumption keeps every finished probe. A wrong storage URL fails at once, in one line
(:func:`autofit.tuner.storage.check_url`), as does any other error of the database (a failed statement).

A worker that dies leaves its search ``running`` with a heartbeat that stops; once the lease has run
out another worker claims it and opens the same study: :func:`autofit.tuner.study.read_back` fails the
trial the dead worker left running and hands back every finished probe, so none is repeated.
"""

from __future__ import annotations

import _thread
import contextlib
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.core.errors import AutofitError, NothingFits
from autofit.core.hardware import Hardware
from autofit.core.storage_url import drop_storage_from_environ, redact_url, scrub
from autofit.core.units import finite
from autofit.machine.fingerprint import MachineFingerprint
from autofit.machine.software import detect_software
from autofit.planning.plan import Plan
from autofit.schedule import queue
from autofit.schedule.checks import entry_refusal
from autofit.schedule.request import SearchRequest
from autofit.schedule.store import optuna_storage
from autofit.tuner import SearchSettings, run_search
from autofit.tuner.storage import database_errors, transient
from autofit.tuner.storage import short_error as _short
from autofit.workload.preflight import load_workload_in_time
from autofit.workload.sources import sources_digest, workload_fingerprint

if TYPE_CHECKING:
    from autofit.tuner.records import SearchResult


class LeaseLost(AutofitError):
    """Another worker holds the search now: this one stops probing it."""


class Interrupted(BaseException):
    """Raised in the worker's main thread to unwind a running search: SIGTERM or SIGINT (the worker gives the
    search back and exits 0), or a lease another worker took over. A ``BaseException``, like
    ``KeyboardInterrupt``, so no ``except Exception`` on the way swallows it; the running probe's process
    groups are killed on the way out (:func:`autofit.probe.launch.launch`'s ``finally``), its trial is left
    without a measurement and the next holder probes that config again."""


#: a worker gives up after the database failed every try for this long (then exits 1, its claims given back
#: or left to their leases)
DATABASE_PATIENCE_S = 600.0
#: told to stop, a worker tries to give its search back this long (Kubernetes' grace period is 30 s)
STOPPING_PATIENCE_S = 10.0


def backoff_s(failures: int, base_s: float, cap_s: float = 30.0) -> float:
    """Seconds to wait after ``failures`` database errors in a row: exponential from ``base_s``, capped, with
    jitter (half to all of it) so workers that lost one database do not all come back at the same instant."""
    return min(cap_s, base_s * 2 ** max(0, failures - 1)) * random.uniform(0.5, 1.0)


@dataclass
class Worker:
    """One worker process's settings."""

    url: str
    """The shared storage (SQLAlchemy URL)."""
    worker_id: str
    """``host-pid-random``, unique among the store's workers."""
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
    """Seconds between claims while idle (and the first wait after a database error)."""
    max_claims: int = queue.DEFAULT_MAX_CLAIMS
    """A search whose holders vanished this many times (a probe that kills its worker) ends ``failed``."""
    prober: Callable[[Any], Any] | None = None
    """``plan -> Prober`` (default: the subprocess probe); a test or a remote executor plugs in here."""
    log: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr, flush=True))
    entry_roots: tuple[Path, ...] | None = None
    """Folders entry points are imported from (:func:`autofit.schedule.checks.entry_roots`); None: any."""
    allow_hub: tuple[str, ...] | None = None
    """Hub repositories this worker loads while it has entry roots (:func:`autofit.schedule.checks.allowed_hub`);
    None: those of ``AUTOFIT_ALLOW_HUB``."""
    given_back: set[str] = field(default_factory=set)
    """Searches this worker gave back (an entry it may not or cannot import): not claimed again."""
    stopping: str | None = field(default=None, init=False)
    """The signal that told this worker to stop (None while it runs)."""
    _in_search: bool = field(default=False, init=False)
    _lease: Lease | None = field(default=None, init=False)

    def __post_init__(self) -> None:  # every log line without the storage's password
        finite("lease_s", self.lease_s, 1.0)  # NaN would renew a lease never, or an idle worker never exit
        finite("idle_exit_s", self.idle_exit_s, 0.0)
        raw_log = self.log
        self.log = lambda text: raw_log(scrub(text, self.url))

    def serve(self) -> list[str]:
        """Register, then run claimed searches until idle for ``idle_exit_s`` or told to stop (SIGTERM, SIGINT:
        the running search is given back); the ids of searches it ran."""
        drop_storage_from_environ()  # the URL is held: queued entries' code never reads it
        with self._signals():
            self._with_database(lambda: queue.register_worker(self.url, self.worker_id, self.machine), "registering")
            self.log(f"autofit worker {self.worker_id}: {self.machine.device} x{self.machine.n_devices}, "
                     f"machine {self.machine.key()}, store {redact(self.url)}")
            ran: list[str] = []
            idle_since = time.monotonic()
            while self.stopping is None:
                held = self._with_database(lambda: queue.claim(self.url, self.worker_id, self.machine, self.nodes,
                                                               self.lease_s, self.max_claims,
                                                               self.given_back), "claiming")
                if held is not None:
                    ran.append(held.id)
                    if self.run_one(held) == "database error":
                        self._pause(backoff_s(1, self.poll_s))
                    idle_since = time.monotonic()
                    continue
                if time.monotonic() - idle_since >= self.idle_exit_s:
                    break
                self._pause(self.poll_s)
            why = f"{self.stopping}, exiting" if self.stopping else f"idle {self.idle_exit_s:g} s, exiting"
            self._quietly(lambda: queue.set_worker_state(self.url, self.worker_id, "exited"))
            self.log(f"autofit worker {self.worker_id}: {why}")
            return ran

    def run_one(self, held: queue.Claim) -> str:
        """Run one claimed search to its end; what became of it (a state, ``taken over``, ``given back`` or
        ``database error``: given back too, resumed by the next claim). An :class:`AutofitError` when the lease
        could not be renewed for a reason other than the database being down (a bug): the search is stopped and
        left to its lease, and the worker stops too rather than abandon every search it claims."""
        try:
            refusal = self._refusal(held.id)
        except database_errors() as exc:  # not known to be allowed: not imported, given back, claimed again later
            if not transient(exc):
                raise
            self.log(f"autofit worker {self.worker_id}: {held.id}: database error ({_short(exc)}); giving it back")
            self._with_database(lambda: queue.release(self.url, held, None), "giving the search back",
                                patience_s=self.lease_s)
            return "database error"
        if refusal is not None:  # checked before importing: another worker may run it, this one will not claim it again
            self.given_back.add(held.id)
            self._with_database(lambda: queue.give_back(self.url, held, refusal), "giving the search back",
                                patience_s=self.lease_s)
            self.log(f"autofit worker {self.worker_id}: {held.id} given back: {refusal}")
            return "given back"
        self._quietly(lambda: queue.set_worker_state(self.url, self.worker_id, "busy"))
        self.log(f"autofit worker {self.worker_id}: running {held.id}")
        with Lease(self.url, held, self.lease_s, on_lost=self._lease_lost, log=self.log) as lease:
            self._lease = lease
            try:
                state, message, winner = self._attempt(held.id, lease)
            finally:
                self._lease = None
        if lease.failure is not None:
            raise AutofitError(f"worker {self.worker_id}: the lease of {held.id} could not be renewed "
                               f"({lease.failure}); its search was stopped and is left to its lease")
        if state in ("given back", "database error"):
            given = self._with_database(lambda: queue.release(self.url, held, message), "giving the search back",
                                        patience_s=self.lease_s)
            outcome = state if given else "taken over"
        elif state is None:
            outcome = "taken over"
        else:
            closed = self._with_database(lambda: queue.finish(self.url, held, state, message, winner),
                                         "finishing the search", patience_s=self.lease_s)
            if closed and winner is not None:  # the study's copy, for readers of the study (schedule list, results)
                self._quietly(lambda: store_winner(self.url, held.id, winner))
            outcome = state if closed else "taken over"
        self.log(f"autofit worker {self.worker_id}: {held.id} {outcome}" + (f": {message}" if message else ""))
        self._quietly(lambda: queue.set_worker_state(self.url, self.worker_id, "idle"))
        return outcome

    def _refusal(self, search_id: str) -> str | None:
        """Why this worker gives ``search_id`` back (:func:`autofit.schedule.checks.entry_refusal`), None to run it.
        A database error is raised (the search is given back, not run unchecked); any other error too."""
        try:
            entry = queue.queued_request(queue.study_attrs(self.url, search_id)).entry
        except (KeyError, AutofitError):  # the study or its request gone or malformed: the attempt reads the same
            return None  # attributes, fails the search and says why, before it imports anything
        return entry_refusal(entry, self.entry_roots, self.allow_hub)

    def _progress(self, search_id: str, lease: Lease, event: Any) -> None:
        lease.check(event)
        self.log(f"autofit worker {self.worker_id}: {search_id} trial {event.n_done}/{event.trials} {event.text}")

    def _attempt(self, search_id: str, lease: Lease) -> tuple[str | None, str | None, dict[str, Any] | None]:
        """``(state, message, winner)``; state None when the lease was lost, ``given back`` when told to stop,
        ``database error`` when the store failed (the search resumes in its study at the next claim).

        :class:`Interrupted` is caught out here, around :meth:`_search` and its handlers: a worker resumed after a
        stall meets a failed statement (the server ended its session meanwhile) and a lost lease at once, and the
        lease thread's interrupt may land while :meth:`_search` still handles the database error. It is raised
        once a search (the signal handlers clear ``_in_search`` before raising it)."""
        try:
            self._in_search = True
            return self._search(search_id, lease)
        except Interrupted:
            return (None, None, None) if self.stopping is None else ("given back", None, None)
        finally:
            self._in_search = False

    def _search(self, search_id: str, lease: Lease) -> tuple[str | None, str | None, dict[str, Any] | None]:
        """:meth:`_attempt`'s search, every error but :class:`Interrupted` turned into its outcome."""
        try:
            if self.stopping is not None:
                raise Interrupted(self.stopping)
            attrs = queue.study_attrs(self.url, search_id)
            request = queue.queued_request(attrs)
            plan = plan_for(request, attrs.get(queue.WORKLOAD_FP_ATTR), self.hardware)
            settings = SearchSettings(trials=request.trials, margin=plan.margin)
            result = run_search(plan, settings, storage=self.url, study_name=queue.study_name(search_id),
                                prober=self.prober(plan) if self.prober else None,
                                on_event=lambda event: self._progress(search_id, lease, event))
            self._in_search = False
        except LeaseLost:
            return None, None, None
        except database_errors() as exc:
            if not transient(exc):  # Optuna's wrapper of a failed statement: no outage to wait out
                return "failed", scrub(_short(exc), self.url), None
            self.log(f"autofit worker {self.worker_id}: {search_id}: database error ({_short(exc)}); giving it back")
            return "database error", None, None
        except NothingFits as exc:
            return "nothing-fits", scrub(str(exc), self.url), None
        except AutofitError as exc:
            return "failed", scrub(str(exc), self.url), None
        except Exception as exc:  # the user's model or the environment: the search fails, the worker goes on
            return "failed", scrub(f"{type(exc).__name__}: {exc}", self.url), None
        return "done", None, winner_record(result, self.machine, plan)

    # -- stopping: SIGTERM, SIGINT, a lost lease

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT stop the worker (handlers installed explicitly: as PID 1 in a container SIGTERM has
        no default action); SIGUSR1 is how the lease thread interrupts a search it lost. Only the main thread
        can install handlers: a worker served from another thread stops at its next probe instead."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        wanted = {signal.SIGTERM: self._on_stop, signal.SIGINT: self._on_stop, signal.SIGUSR1: self._on_lease_lost}
        before = {signum: signal.signal(signum, handler) for signum, handler in wanted.items()}
        try:
            yield
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)

    def _on_stop(self, signum: int, frame: Any) -> None:
        first = self.stopping is None
        self.stopping = signal.Signals(signum).name
        if first and self._in_search:
            self._in_search = False  # raised once: the unwinding (killing the probe) is not interrupted again
            raise Interrupted(self.stopping)

    def _on_lease_lost(self, signum: int, frame: Any) -> None:
        if self._in_search and self._lease is not None and self._lease.lost:
            self._in_search = False
            raise Interrupted("lease lost")

    def _lease_lost(self) -> None:
        """From the lease thread: stop the probe now, not at the next one (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            _thread.interrupt_main(signal.SIGUSR1)

    def _pause(self, seconds: float) -> None:
        """Sleep, waking early when told to stop."""
        end = time.monotonic() + seconds
        while self.stopping is None and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.2))

    # -- the database failing

    def _with_database(self, call: Callable[[], Any], what: str, patience_s: float = DATABASE_PATIENCE_S) -> Any:
        """``call()``, tried again with exponential backoff while the database fails; after ``patience_s`` of
        failures an :class:`AutofitError` (the URL redacted). Told to stop meanwhile: None. Only a transient error
        (:func:`autofit.tuner.storage.transient`: the server down or restarting, a dropped connection) is tried
        again, a database unreachable at the worker's start included (it may be starting beside the worker); a
        wrong URL (:func:`autofit.tuner.storage.check_url`) or a failed statement is raised at once."""
        started, failures = time.monotonic(), 0
        while True:
            try:
                return call()
            except database_errors() as exc:
                if not transient(exc):
                    raise
                failures += 1
                if time.monotonic() - started > patience_s:
                    raise AutofitError(f"the database at {redact(self.url)} failed for {patience_s:g} s while "
                                       f"{what}: {_short(exc)}") from None
                if self.stopping is not None and what == "claiming":
                    return None
                if self.stopping is not None:  # on the way out (a grace period runs): a few seconds more at most
                    patience_s = min(patience_s, STOPPING_PATIENCE_S)
                delay = backoff_s(failures, min(self.poll_s, 1.0))
                self.log(f"autofit worker {self.worker_id}: database error while {what} ({_short(exc)}); "
                         f"trying again in {delay:.1f} s")
                if self.stopping is None:
                    self._pause(delay)
                else:
                    time.sleep(delay)

    def _quietly(self, call: Callable[[], Any]) -> None:
        """A bookkeeping write (the worker's state) that may fail with the database down without stopping anything
        (any other error is raised)."""
        try:
            call()
        except database_errors() as exc:
            if not transient(exc):
                raise
            self.log(f"autofit worker {self.worker_id}: database error ({_short(exc)}); carrying on")


def plan_for(request: SearchRequest, workload_fp: str | None, hardware: Hardware) -> Plan:
    """The search's :class:`~autofit.planning.plan.Plan` on this worker's device, judged by this worker's own software
    (it probes here; docs/design.md, "The target's software"); the workload must be the one queued (``workload_fp``:
    its fingerprint at ``schedule add``)."""

    if request.sources is not None and sources_digest(request.entry) != request.sources:
        raise AutofitError(f"{request.entry} is not the workload that was queued (its source files changed since "
                           "`schedule add`; nothing of it was run); add the search again")
    workload = load_workload_in_time(request.entry)
    if workload_fingerprint(request.entry, workload) != workload_fp:
        raise AutofitError(f"{request.entry} is not the workload that was queued (its file or model changed); "
                           "add the search again")
    if request.memory_bytes is not None:
        hardware = hardware.with_memory(request.memory_bytes)
    hardware = replace(hardware, devices_per_node=request.gpus)  # as schedule add planned it (target.py)
    return Plan.make(request.entry, workload, hardware, request.search_space(),
                     world_size=request.gpus * request.nodes, global_batch=request.global_batch, fixed=request.fixed,
                     software=detect_software(), recipe=request.recipe, margin=request.margin)


def winner_record(result: SearchResult, machine: MachineFingerprint, plan: Any) -> dict[str, Any]:
    """The winner as stored: what ``schedule add`` returns cached, ``results`` compares."""
    return {
        "best": {"config": result.config.to_dict(), "measured": result.measured.to_json(),
                 "predicted": result.predicted.to_json()},
        "deepspeed": result.deepspeed,
        "hardware": plan.hardware.name,
        "memory_bytes": plan.hardware.memory_bytes,
        "world_size": result.world_size,
        "machine": machine.to_dict(),
        "n_probes": result.n_probes,
        "stop_reason": result.stop_reason,
    }


def store_winner(url: str, search_id: str, winner: dict[str, Any]) -> None:
    """The winner in the study's user attributes too, once :func:`autofit.schedule.queue.finish` (conditional on
    the claim) has stored it in the search's row: only the holder that closed the search gets here."""
    import optuna


    study = optuna.load_study(study_name=queue.study_name(search_id), storage=optuna_storage(url))
    study.set_user_attr(queue.RESULT_ATTR, winner)


class Lease:
    """A thread renewing a search's heartbeat every ``lease_s / 3`` seconds while the worker runs it; when the
    claim is gone (another worker took it over) it calls ``on_lost`` (the worker stops the probe).

    Only a transient database error (:func:`autofit.tuner.storage.transient`) is waited out, a beat missed (the
    lease has slack for two); any other error (a bug, a schema this autofit does not know) stops the lease as if
    it were lost, ``failure`` saying why: a lease that quietly stopped renewing would run out under a search
    still probing, and another worker would take it over and probe beside this one."""

    def __init__(self, url: str, held: queue.Claim, lease_s: float, on_lost: Callable[[], None] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.url, self.held, self.lease_s, self.on_lost, self.log = url, held, lease_s, on_lost, log
        self.lost = False
        self.failure: str | None = None
        """Why the heartbeat stopped other than a lost claim (an error that is no database outage), else None."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease-{held.id}", daemon=True)

    def __enter__(self) -> Lease:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                held = queue.heartbeat(self.url, self.held)
            except Exception as exc:
                if transient(exc):  # a dropped connection: try again next beat, the lease has slack for two misses
                    continue
                self.failure = _short(exc)
                if self.log is not None:
                    self.log(f"autofit worker: {self.held.id}: the heartbeat failed ({self.failure}); stopping the search")
                held = False
            if not held:
                self.lost = True
                if self.on_lost is not None and not self._stop.is_set():
                    self.on_lost()
                return

    def check(self, event: Any) -> None:
        """The search's ``on_event``: stop a search whose lease another worker has taken."""
        if self.lost:
            raise LeaseLost(f"search {self.held.id} was taken over by another worker")


redact = redact_url  # the name this module had for it
