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
"""

from __future__ import annotations

import functools
from typing import Any

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
    """A SQLAlchemy engine on ``url`` with the scheduler's tables created (Optuna makes its own on first use).

    SQLite waits up to 60 s for another process's write lock instead of failing at once."""
    from sqlalchemy import create_engine

    args = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    made = create_engine(url, **args)
    tables()[0].create_all(made)
    return made


@functools.lru_cache(maxsize=8)
def optuna_storage(url: str) -> Any:
    """Optuna's RDB storage on ``url``, one per process (its engine keeps a pool of connections; SQLite waits
    for locks here too)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
