"""The queue: add a search (or find it cached), claim one atomically, keep the claim alive, finish it.

A search is an Optuna study named ``autofit-<id>``; its request is in the study's user attributes
and the worker that runs it calls :func:`autofit.tuner.run_search` with that study name, so the
study's own resumption (finished probes reused, a dead worker's running trial failed) does the
takeover. The claim, the lease and the state are a row of ``autofit_searches``
(:mod:`autofit.schedule.store`).

**Claim**: one conditional ``UPDATE ... WHERE id = :id AND (state = 'queued' OR the holder's lease
ran out)``; the worker whose update changed a row holds the search. On PostgreSQL two such updates
of one row serialise on its row lock and the second re-checks the ``WHERE`` against the row the first
committed, so it changes nothing; SQLite lets one writer in at a time. No read-then-write race: the
``SELECT`` before only proposes candidates. Each claim gets a fresh ``token``; heartbeat, finish and
release are conditional on it (``UPDATE ... WHERE worker = me AND token = mine``), so a worker that lost
its claim changes nothing. **Lease**: the holder stamps ``heartbeat_s`` every ``lease_s / 3`` seconds
with the database's clock; a running search whose ``heartbeat_s + lease_s`` is before the database's now
is claimable again (no client's clock is read). **Cap**: a search whose holders vanished
``max_claims`` times (each lease ran out) ends ``failed`` instead of being claimed again.

**Cache**: a search's ``request_key`` hashes the workload fingerprint, the device, its count and the
request (:mod:`autofit.machine.fingerprint`). Adding one whose key is done on the machine fingerprint
of a live worker of that device (:func:`live_machines`: not exited, seen within :data:`LIVE_S`, or holding
a search whose lease runs) returns it (``cached``); a newer driver, CUDA, torch, DeepSpeed, library or
allocator setting on the live workers makes a new search. Workers mark themselves seen at every claim
attempt and every heartbeat.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func

from autofit.core.errors import AutofitError
from autofit.core.hashing import digest
from autofit.core.storage_url import redact_url, scrub
from autofit.machine.fingerprint import MachineFingerprint
from autofit.schedule.request import SearchRequest
from autofit.schedule.store import FINISHED, engine, optuna_storage, server_epoch, tables
from autofit.workload.sources import request_hash

DEFAULT_LEASE_S = 60.0
DEFAULT_MAX_CLAIMS = 3
#: the study's user attributes a queued search keeps: its request (:meth:`SearchRequest.to_dict`), the workload's
#: fingerprint at ``schedule add``, the cost model's planned winner (:func:`autofit.schedule.submit.planned`) and the
#: winner a worker stored (:func:`autofit.schedule.worker.winner_record`)
REQUEST_ATTR = "request"
WORKLOAD_FP_ATTR = "workload_fp"
PLANNED_ATTR = "planned"
RESULT_ATTR = "result"


@dataclass(frozen=True)
class Claim:
    """A worker's hold on a search: the row is its own while ``worker`` and ``token`` (fresh each claim) match."""

    id: str
    worker: str
    token: str


@dataclass(frozen=True)
class Added:
    """What ``autofit schedule add`` answers."""

    id: str
    state: str
    cached: bool
    result: dict[str, Any] | None = None
    """The stored winner of a cached search (None otherwise)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "state": self.state, "cached": self.cached}
        return out | ({"best": self.result.get("best")} if self.result else {})


def study_name(search_id: str) -> str:
    return f"autofit-{search_id}"


def request_key(request: SearchRequest, workload_fp: str) -> str:
    """The cache key less the machine: workload, device, device count and request."""
    return digest([workload_fp, request.hardware, request.gpus, request.nodes, request_hash(request.to_dict())])[:24]


LIVE_S = 2 * DEFAULT_LEASE_S
"""A worker not seen for this long (and holding no search with a running lease) is not live."""


def live_machines(url: str, hardware: str) -> set[str] | None:
    """The machine keys of the live workers for ``hardware`` (not exited; seen within :data:`LIVE_S` or holding a
    running search whose lease has not run out). With none live, the key of the worker seen last (the best
    knowledge of that device's machines); None when no worker for it has been seen."""
    from sqlalchemy import select

    _, searches, workers = tables()
    w = workers.c
    with engine(url).connect() as conn:  # the database's clock, as for leases (store.server_epoch)
        rows = conn.execute(select(w.id, w.machine_key, w.state, (w.seen_s >= server_epoch() - LIVE_S).label("recent"))
                            .where(w.hardware == hardware).order_by(w.seen_s.desc())).all()
        s = searches.c
        leased = {r.worker for r in conn.execute(
            select(s.worker).where((s.state == "running") & (s.heartbeat_s + s.lease_s >= server_epoch())))}
    live = {r.machine_key for r in rows if r.state != "exited" and (r.recent or r.id in leased)}
    return live or ({rows[0].machine_key} if rows else None)


def touch_worker(url: str, worker_id: str) -> None:
    """Mark a worker seen now (its liveness for :func:`live_machines`)."""
    from sqlalchemy import update

    _, _, workers = tables()
    with engine(url).begin() as conn:
        conn.execute(update(workers).where(workers.c.id == worker_id).values(seen_s=server_epoch()))


def add_search(url: str, request: SearchRequest, workload_fp: str, planned: dict[str, Any] | None = None) -> Added:
    """Queue ``request`` unless the same search is queued, running or done on today's machines."""
    from sqlalchemy.exc import IntegrityError

    key = request_key(request, workload_fp)
    for _ in range(3):  # another process may add the same search at the same moment: look again
        found, n_rows = _lookup(url, key, live_machines(url, request.hardware))
        if found is not None:
            return found
        search_id = f"{key[:12]}-{n_rows}"
        _create_study(url, search_id, request, workload_fp, planned)
        try:
            _insert(url, search_id, key, request, workload_fp)
        except IntegrityError:
            continue
        return Added(search_id, "queued", False)
    raise AutofitError(f"could not add the search to {redact_url(url)}: other processes kept adding it")


def _lookup(url: str, key: str, machine_keys: set[str] | None) -> tuple[Added | None, int]:
    """A queued or running search of ``key``, else one finished on one of ``machine_keys`` (None: any); and how
    many rows ``key`` has."""
    from sqlalchemy import select

    _, searches, _ = tables()
    with engine(url).connect() as conn:
        rows = conn.execute(select(searches).where(searches.c.request_key == key).order_by(searches.c.created_s.desc())).all()
    for row in rows:
        if row.state in ("queued", "running"):
            return Added(row.id, row.state, False), len(rows)
    for row in rows:
        if row.state in FINISHED and (machine_keys is None or row.machine_key in machine_keys):
            try:
                study_attrs(url, row.id)  # the row keeps the winner, but a study deleted from the store is no cache
                return Added(row.id, row.state, True, stored_result(url, row.id)), len(rows)
            except KeyError:
                continue
    for row in rows:  # a failed search added again resumes in its own study: no finished probe runs again
        if row.state == "failed" and _requeue(url, row.id):
            return Added(row.id, "queued", False), len(rows)
    return None, len(rows)


def _requeue(url: str, search_id: str) -> bool:
    """A failed search queued again, its count of vanished holders reset (someone chose to retry it)."""
    from sqlalchemy import update

    _, searches, _ = tables()
    c = searches.c
    with engine(url).begin() as conn:
        return conn.execute(update(searches).where((c.id == search_id) & (c.state == "failed")).values(
            state="queued", worker=None, token=None, heartbeat_s=None, lost=0, message=None, finished_s=None,
        )).rowcount == 1


def _create_study(url: str, search_id: str, request: SearchRequest, workload_fp: str, planned: dict[str, Any] | None) -> None:
    import optuna

    study = optuna.create_study(storage=optuna_storage(url), study_name=study_name(search_id), direction="maximize",
                                load_if_exists=True)
    for name, value in {REQUEST_ATTR: request.to_dict(), WORKLOAD_FP_ATTR: workload_fp, PLANNED_ATTR: planned}.items():
        study.set_user_attr(name, value)


def _insert(url: str, search_id: str, key: str, request: SearchRequest, workload_fp: str) -> None:
    _, searches, _ = tables()
    with engine(url).begin() as conn:
        conn.execute(searches.insert().values(
            id=search_id, study_name=study_name(search_id), request_key=key, workload_fp=workload_fp,
            request_hash=request_hash(request.to_dict()), entry=request.entry, hardware=request.hardware,
            gpus=request.gpus, nodes=request.nodes, state="queued", claims=0, lost=0, created_s=server_epoch(),
        ))


def stored_result(url: str, search_id: str) -> dict[str, Any] | None:
    """The winner the worker that finished the search stored (None while there is none): in its row, written by
    :func:`finish`; a row an older autofit finished has it in the study only."""
    from sqlalchemy import select

    _, searches, _ = tables()
    with engine(url).connect() as conn:
        row = conn.execute(select(searches.c.result).where(searches.c.id == search_id)).first()
    if row is not None and row.result is not None:
        return dict(row.result)
    return study_attrs(url, search_id).get(RESULT_ATTR)


def study_attrs(url: str, search_id: str) -> dict[str, Any]:
    import optuna

    study = optuna.load_study(study_name=study_name(search_id), storage=optuna_storage(url))
    return dict(study.user_attrs)


def queued_request(attrs: dict[str, Any]) -> SearchRequest:
    """The request a search's study attributes (:func:`study_attrs`) keep; an :class:`AutofitError` where it is
    missing or malformed."""
    if REQUEST_ATTR not in attrs:
        raise AutofitError("the search's study has no request")
    return SearchRequest.from_dict(attrs[REQUEST_ATTR])


def register_worker(url: str, worker_id: str, machine: MachineFingerprint) -> None:
    """Record a started worker: its machine fingerprint becomes the one cached results are checked against."""
    _, _, workers = tables()
    now = server_epoch()
    with engine(url).begin() as conn:  # a worker id seen before (a pid reused, a serve() called again) starts anew
        conn.execute(workers.delete().where(workers.c.id == worker_id))
        conn.execute(workers.insert().values(id=worker_id, hardware=machine.device, machine_key=machine.key(),
                                             machine=machine.to_dict(), started_s=now, seen_s=now, state="idle"))


def set_worker_state(url: str, worker_id: str, state: str) -> None:
    from sqlalchemy import update

    _, _, workers = tables()
    with engine(url).begin() as conn:
        conn.execute(update(workers).where(workers.c.id == worker_id).values(state=state, seen_s=server_epoch()))


def _expired(c: Any) -> Any:
    """A running search whose holder's lease ran out, on the database's clock."""
    return (c.state == "running") & (c.heartbeat_s + c.lease_s < server_epoch())


def _claimable(c: Any, max_claims: int) -> Any:
    """Queued, or running with a lease that ran out and fewer than ``max_claims`` holders lost to it."""
    return (c.state == "queued") | (_expired(c) & (func.coalesce(c.lost, 0) + 1 < max_claims))


def claim(url: str, worker_id: str, machine: MachineFingerprint, nodes: int = 1,
          lease_s: float = DEFAULT_LEASE_S, max_claims: int = DEFAULT_MAX_CLAIMS,
          skip: Collection[str] = ()) -> Claim | None:
    """Take the oldest queued search for this machine (or one whose holder stopped beating), but none of
    ``skip`` (searches this worker gave back); the claim or None.

    A search whose ``max_claims``-th holder vanished too (each lease ran out: a probe that kills its worker,
    a host out of memory) is not claimed again: it ends ``failed`` with the reason."""
    from sqlalchemy import case, select, update

    _, searches, _ = tables()
    c = searches.c
    mine = (c.hardware == machine.device) & (c.gpus <= machine.n_devices) & (c.nodes <= nodes)
    lost = func.coalesce(c.lost, 0)
    with engine(url).begin() as conn:
        conn.execute(update(searches).where(mine & _expired(c) & (lost + 1 >= max_claims)).values(
            state="failed", lost=lost + 1, worker=None, token=None, finished_s=server_epoch(),
            message=f"given up after {max_claims} claims whose worker vanished without finishing it (its lease ran "
                    "out): a probe may be killing the worker (host out of memory?); add it again to retry"))
    touch_worker(url, worker_id)
    mine = mine & c.id.notin_(list(skip)) if skip else mine
    with engine(url).connect() as conn:
        proposed = [r.id for r in conn.execute(select(c.id).where(mine & _claimable(c, max_claims)).order_by(c.created_s))]
    for search_id in proposed:
        token = uuid.uuid4().hex
        with engine(url).begin() as conn:
            changed = conn.execute(
                update(searches).where((c.id == search_id) & _claimable(c, max_claims)).values(
                    state="running", worker=worker_id, token=token, heartbeat_s=server_epoch(), lease_s=lease_s,
                    claims=c.claims + 1, lost=case((c.state == "running", lost + 1), else_=lost),
                    machine_key=machine.key(), machine=machine.to_dict(),
                )
            ).rowcount
        if changed == 1:
            return Claim(search_id, worker_id, token)
    return None


def _held(c: Any, held: Claim) -> Any:
    return (c.id == held.id) & (c.token == held.token) & (c.worker == held.worker)


def heartbeat(url: str, held: Claim) -> bool:
    """Renew the lease; False when this claim no longer holds the search (another worker took it over)."""
    from sqlalchemy import update

    _, searches, workers = tables()
    c = searches.c
    with engine(url).begin() as conn:
        changed = conn.execute(
            update(searches).where(_held(c, held) & (c.state == "running")).values(heartbeat_s=server_epoch())
        ).rowcount
        conn.execute(update(workers).where(workers.c.id == held.worker).values(seen_s=server_epoch()))
    return changed == 1


def finish(url: str, held: Claim, state: str, message: str | None = None,
           result: dict[str, Any] | None = None) -> bool:
    """Close a search this claim holds (``done``, ``failed`` or ``nothing-fits``) and keep its winner ``result``,
    in one conditional ``UPDATE``: False (and nothing written) when the claim no longer holds it, so a worker
    that lost its lease never overwrites the new holder's result. Done again after a dropped reply, it is True."""
    from sqlalchemy import update

    _, searches, _ = tables()
    c = searches.c
    with engine(url).begin() as conn:
        changed = conn.execute(
            update(searches).where(_held(c, held) & c.state.in_(("running", state)))
            .values(state=state, finished_s=server_epoch(), message=scrub(message, url) if message else message,
                    result=result)
        ).rowcount
    return changed == 1


def release(url: str, held: Claim, message: str | None = None, counted: bool = True) -> bool:
    """Give a claimed search back (``queued``, no holder): a worker told to stop, or one the database failed;
    the next claim resumes its study. ``counted=False``: the claim is taken back from the search's count too (a
    worker that may not or cannot import its entry: :func:`give_back`). False when the claim no longer held it."""
    from sqlalchemy import update

    _, searches, _ = tables()
    c = searches.c
    with engine(url).begin() as conn:
        changed = conn.execute(
            update(searches).where(_held(c, held) & (c.state == "running"))
            .values(state="queued", worker=None, token=None, heartbeat_s=None,
                    claims=c.claims if counted else c.claims - 1,
                    message=scrub(message, url) if message else message)
        ).rowcount
    return changed == 1


def give_back(url: str, held: Claim, why: str) -> bool:
    """Put a search this worker holds back in the queue for another worker, the claim not counted, with why."""
    return release(url, held, f"given back by {held.worker}: {why}", counted=False)


def search_rows(url: str) -> list[Any]:
    """Every search row, oldest first."""
    from sqlalchemy import select

    _, searches, _ = tables()
    with engine(url).connect() as conn:
        return list(conn.execute(select(searches).order_by(searches.c.created_s)).all())
