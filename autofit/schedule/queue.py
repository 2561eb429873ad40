"""The queue: add a search (or find it cached), claim one atomically, keep the claim alive, finish it.

A search is an Optuna study named ``autofit-<id>``; its request is in the study's user attributes
and the worker that runs it calls :func:`autofit.search.run_search` with that study name, so the
study's own resumption (finished probes reused, a dead worker's running trial failed) does the
takeover. The claim, the lease and the state are a row of ``autofit_searches``
(:mod:`autofit.schedule.store`).

**Claim**: one conditional ``UPDATE ... WHERE id = :id AND (state = 'queued' OR the holder's lease
ran out)``; the worker whose update changed a row holds the search. On PostgreSQL two such updates
of one row serialise on its row lock and the second re-checks the ``WHERE`` against the row the first
committed, so it changes nothing; SQLite lets one writer in at a time. No read-then-write race: the
``SELECT`` before only proposes candidates. **Lease**: the holder writes ``heartbeat_s`` every
``lease_s / 3`` seconds; a running search whose ``heartbeat_s + lease_s`` is past is claimable again
(clocks of the workers' machines are assumed in step to well within a lease, as NTP keeps them).

**Cache**: a search's ``request_key`` hashes the workload fingerprint, the device, its count and the
request (:mod:`autofit.schedule.fingerprint`). Adding one whose key is done on the machine fingerprint
of a live worker of that device (:func:`live_machines`: not exited, seen within :data:`LIVE_S`, or holding
a search whose lease runs) returns it (``cached``); a newer driver, CUDA, torch, DeepSpeed, library or
allocator setting on the live workers makes a new search. Workers mark themselves seen at every claim
attempt and every heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from autofit.errors import AutofitError
from autofit.schedule.fingerprint import MachineFingerprint, digest, request_hash
from autofit.schedule.store import FINISHED, engine, optuna_storage, tables
from autofit.storage_url import redact_url, scrub

DEFAULT_LEASE_S = 60.0
REQUEST_ATTR = "request"
PLANNED_ATTR = "planned"
RESULT_ATTR = "result"


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


def request_key(request: dict[str, Any], workload_fp: str) -> str:
    """The cache key less the machine: workload, device, device count and request."""
    return digest([workload_fp, request["hardware"], request["gpus"], request["nodes"], request_hash(request)])[:24]


LIVE_S = 2 * DEFAULT_LEASE_S
"""A worker not seen for this long (and holding no search with a running lease) is not live."""


def live_machines(url: str, hardware: str) -> set[str] | None:
    """The machine keys of the live workers for ``hardware`` (not exited; seen within :data:`LIVE_S` or holding a
    running search whose lease has not run out). With none live, the key of the worker seen last (the best
    knowledge of that device's machines); None when no worker for it has been seen."""
    from sqlalchemy import select

    _, searches, workers = tables()
    now = time.time()
    with engine(url).connect() as conn:
        rows = conn.execute(select(workers.c.id, workers.c.machine_key, workers.c.seen_s, workers.c.state)
                            .where(workers.c.hardware == hardware).order_by(workers.c.seen_s.desc())).all()
        s = searches.c
        leased = {r.worker for r in conn.execute(
            select(s.worker).where((s.state == "running") & (s.heartbeat_s + s.lease_s >= now)))}
    live = {r.machine_key for r in rows if r.state != "exited" and (r.seen_s >= now - LIVE_S or r.id in leased)}
    return live or ({rows[0].machine_key} if rows else None)


def touch_worker(url: str, worker_id: str) -> None:
    """Mark a worker seen now (its liveness for :func:`live_machines`)."""
    from sqlalchemy import update

    _, _, workers = tables()
    with engine(url).begin() as conn:
        conn.execute(update(workers).where(workers.c.id == worker_id).values(seen_s=time.time()))


def add_search(url: str, request: dict[str, Any], workload_fp: str, planned: dict[str, Any] | None = None) -> Added:
    """Queue ``request`` unless the same search is queued, running or done on today's machines."""
    from sqlalchemy.exc import IntegrityError

    key = request_key(request, workload_fp)
    for _ in range(3):  # another process may add the same search at the same moment: look again
        found, n_rows = _lookup(url, key, live_machines(url, request["hardware"]))
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
                return Added(row.id, row.state, True, stored_result(url, row.id)), len(rows)
            except KeyError:  # its study was deleted from the store: not a cached result
                continue
    return None, len(rows)


def _create_study(url: str, search_id: str, request: dict[str, Any], workload_fp: str, planned: dict[str, Any] | None) -> None:
    import optuna

    study = optuna.create_study(storage=optuna_storage(url), study_name=study_name(search_id), direction="maximize",
                                load_if_exists=True)
    for name, value in {REQUEST_ATTR: request, "workload_fp": workload_fp, PLANNED_ATTR: planned}.items():
        study.set_user_attr(name, value)


def _insert(url: str, search_id: str, key: str, request: dict[str, Any], workload_fp: str) -> None:
    _, searches, _ = tables()
    with engine(url).begin() as conn:
        conn.execute(searches.insert().values(
            id=search_id, study_name=study_name(search_id), request_key=key, workload_fp=workload_fp,
            request_hash=request_hash(request), entry=request["entry"], hardware=request["hardware"],
            gpus=request["gpus"], nodes=request["nodes"], state="queued", claims=0, created_s=time.time(),
        ))


def stored_result(url: str, search_id: str) -> dict[str, Any] | None:
    """The winner a worker stored in the study (None while there is none)."""
    summary = study_attrs(url, search_id)
    return summary.get(RESULT_ATTR)


def study_attrs(url: str, search_id: str) -> dict[str, Any]:
    import optuna

    study = optuna.load_study(study_name=study_name(search_id), storage=optuna_storage(url))
    return dict(study.user_attrs)


def register_worker(url: str, worker_id: str, machine: MachineFingerprint) -> None:
    """Record a started worker: its machine fingerprint becomes the one cached results are checked against."""
    _, _, workers = tables()
    now = time.time()
    with engine(url).begin() as conn:  # a worker id seen before (a pid reused, a serve() called again) starts anew
        conn.execute(workers.delete().where(workers.c.id == worker_id))
        conn.execute(workers.insert().values(id=worker_id, hardware=machine.device, machine_key=machine.key(),
                                             machine=machine.to_dict(), started_s=now, seen_s=now, state="idle"))


def set_worker_state(url: str, worker_id: str, state: str) -> None:
    from sqlalchemy import update

    _, _, workers = tables()
    with engine(url).begin() as conn:
        conn.execute(update(workers).where(workers.c.id == worker_id).values(state=state, seen_s=time.time()))


def _claimable(searches: Any, now: float) -> Any:
    from sqlalchemy import and_, or_

    c = searches.c
    return or_(c.state == "queued", and_(c.state == "running", c.heartbeat_s + c.lease_s < now))


def claim(url: str, worker_id: str, machine: MachineFingerprint, nodes: int = 1,
          lease_s: float = DEFAULT_LEASE_S, skip: Collection[str] = ()) -> str | None:
    """Take the oldest queued search for this machine (or one whose holder stopped beating), but none of
    ``skip`` (searches this worker gave back); its id or None."""
    from sqlalchemy import select, update

    _, searches, _ = tables()
    c = searches.c
    now = time.time()
    mine = (c.hardware == machine.device) & (c.gpus <= machine.n_devices) & (c.nodes <= nodes)
    touch_worker(url, worker_id)
    mine = mine & c.id.notin_(list(skip)) if skip else mine
    with engine(url).connect() as conn:
        proposed = [r.id for r in conn.execute(select(c.id).where(mine & _claimable(searches, now)).order_by(c.created_s))]
    for search_id in proposed:
        with engine(url).begin() as conn:
            changed = conn.execute(
                update(searches).where((c.id == search_id) & _claimable(searches, now)).values(
                    state="running", worker=worker_id, heartbeat_s=now, lease_s=lease_s, claims=c.claims + 1,
                    machine_key=machine.key(), machine=machine.to_dict(),
                )
            ).rowcount
        if changed == 1:
            return search_id
    return None


def heartbeat(url: str, search_id: str, worker_id: str) -> bool:
    """Renew the lease; False when this worker no longer holds the search (another took it over)."""
    from sqlalchemy import update

    _, searches, workers = tables()
    c = searches.c
    with engine(url).begin() as conn:
        changed = conn.execute(
            update(searches).where((c.id == search_id) & (c.worker == worker_id) & (c.state == "running"))
            .values(heartbeat_s=time.time())
        ).rowcount
        conn.execute(update(workers).where(workers.c.id == worker_id).values(seen_s=time.time()))
    return changed == 1


def finish(url: str, search_id: str, worker_id: str, state: str, message: str | None = None) -> bool:
    """Close a search this worker holds (``done``, ``failed`` or ``nothing-fits``); False if it no longer holds it."""
    from sqlalchemy import update

    _, searches, _ = tables()
    c = searches.c
    with engine(url).begin() as conn:
        changed = conn.execute(
            update(searches).where((c.id == search_id) & (c.worker == worker_id) & (c.state == "running"))
            .values(state=state, finished_s=time.time(), message=scrub(message, url) if message else message)
        ).rowcount
    return changed == 1


def give_back(url: str, search_id: str, worker_id: str, message: str) -> bool:
    """Put a search this worker holds back in the queue for another worker (the claim not counted), with why;
    False if it no longer holds it."""
    from sqlalchemy import update

    _, searches, _ = tables()
    c = searches.c
    with engine(url).begin() as conn:
        changed = conn.execute(
            update(searches).where((c.id == search_id) & (c.worker == worker_id) & (c.state == "running"))
            .values(state="queued", worker=None, heartbeat_s=None, claims=c.claims - 1,
                    message=scrub(f"given back by {worker_id}: {message}", url))
        ).rowcount
    return changed == 1


def search_rows(url: str) -> list[Any]:
    """Every search row, oldest first."""
    from sqlalchemy import select

    _, searches, _ = tables()
    with engine(url).connect() as conn:
        return list(conn.execute(select(searches).order_by(searches.c.created_s)).all())
