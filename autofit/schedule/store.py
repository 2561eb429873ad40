"""The scheduler's two tables, next to Optuna's own in the same database.

Optuna's RDB storage (SQLAlchemy) holds each search as a study: its request in the study's user
attributes, every probe a trial. What Optuna has no place for lives in two tables of ours, made
with SQLAlchemy on the same URL:

- ``autofit_searches``: one row per queued search: its cache key, the device it is for, its state
  (``queued``, ``running``, ``done``, ``failed``, ``nothing-fits``), the worker holding it, that
  worker's heartbeat and lease, the machine fingerprint it ran on.
- ``autofit_workers``: one row per worker started: its machine fingerprint and when it was last seen.

Why a table of our own for the claim: Optuna's attribute setters are unconditional writes, so a
claim through them would be a read-then-write race. A claim here is one conditional ``UPDATE``
(:mod:`autofit.schedule.queue`), atomic on PostgreSQL (row lock; a waiting update re-reads the
row it waited for) and on SQLite (one writer at a time).

Times in these tables are the **database's** clock (:func:`server_epoch`), never a client's: a lease
compares the heartbeat the server stamped with the server's now, so workers whose clocks drift apart
agree on whose lease ran out.
"""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import Float
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement

from autofit.tuner.storage import check_url, engine_kwargs, rdb_storage

STATES = ("queued", "running", "done", "failed", "nothing-fits")
FINISHED = ("done", "nothing-fits")


@functools.lru_cache(maxsize=1)
def tables() -> tuple[Any, Any, Any]:
    """``(metadata, searches, workers)``, built on first use (SQLAlchemy is imported lazily, like Optuna)."""
    from sqlalchemy import JSON, Column, Float, Integer, MetaData, String, Table, Text

    metadata = MetaData()
    searches = Table(
        "autofit_searches", metadata,
        Column("id", String(64), primary_key=True),
        Column("study_name", String(128), nullable=False),
        Column("request_key", String(64), nullable=False, index=True),
        Column("workload_fp", String(64), nullable=False),
        Column("request_hash", String(64), nullable=False),
        Column("entry", Text, nullable=False),
        Column("hardware", String(64), nullable=False, index=True),
        Column("gpus", Integer, nullable=False),
        Column("nodes", Integer, nullable=False),
        Column("state", String(16), nullable=False, index=True),
        Column("worker", String(128)),
        Column("machine_key", String(64)),
        Column("machine", JSON),
        Column("heartbeat_s", Float),
        Column("lease_s", Float),
        Column("claims", Integer, nullable=False, default=0),
        Column("token", String(32)),  # a fresh one per claim: heartbeat, finish and release need it
        Column("lost", Integer, default=0),  # claims whose holder vanished (its lease ran out)
        Column("result", JSON),  # the winner, written by the finish that closed the claim
        Column("created_s", Float, nullable=False),
        Column("finished_s", Float),
        Column("message", Text),
    )
    workers = Table(
        "autofit_workers", metadata,
        Column("id", String(128), primary_key=True),
        Column("hardware", String(64), nullable=False, index=True),
        Column("machine_key", String(64), nullable=False),
        Column("machine", JSON, nullable=False),
        Column("started_s", Float, nullable=False),
        Column("seen_s", Float, nullable=False),
        Column("state", String(16), nullable=False),
    )
    return metadata, searches, workers


@functools.lru_cache(maxsize=8)
def engine(url: str) -> Any:
    """A SQLAlchemy engine on ``url`` with the scheduler's tables created (Optuna makes its own on first use),
    with the same settings as Optuna's (:func:`autofit.tuner.storage.engine_kwargs`: ``pool_pre_ping``)."""
    from sqlalchemy import create_engine

    check_url(url)  # a wrong URL: one line now, not a retry
    made = create_engine(url, **engine_kwargs(url))
    metadata, searches, _ = tables()
    metadata.create_all(made)
    _add_missing_columns(made, searches)
    return made


def _add_missing_columns(made: Any, table: Any) -> None:
    """Columns a newer autofit added to a table an older one created (``create_all`` makes no column)."""
    from sqlalchemy import inspect, text

    present = {c["name"] for c in inspect(made).get_columns(table.name)}
    missing = [c for c in table.columns if c.name not in present]
    if missing:
        with made.begin() as conn:
            for column in missing:  # nullable: the code that reads them takes NULL as the default
                conn.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} "
                                  f"{column.type.compile(dialect=made.dialect)}"))


def optuna_storage(url: str) -> Any:
    """Optuna's RDB storage on ``url``, one per process (:func:`autofit.tuner.storage.rdb_storage`)."""
    return rdb_storage(url)


class server_epoch(FunctionElement):  # noqa: N801 (a SQL function, named as one)
    """The database server's clock, seconds since the epoch, as a SQL expression: PostgreSQL's
    ``EXTRACT(EPOCH FROM CURRENT_TIMESTAMP)`` (the transaction's start), SQLite's ``julianday('now')`` (one
    machine: its clock is the only one)."""

    type = Float()
    inherit_cache = True


@compiles(server_epoch)
def _epoch_default(element: Any, compiler: Any, **kw: Any) -> str:
    return "EXTRACT(EPOCH FROM CURRENT_TIMESTAMP)"


@compiles(server_epoch, "sqlite")
def _epoch_sqlite(element: Any, compiler: Any, **kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"
