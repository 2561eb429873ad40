"""Optuna's storage on a URL, with the engine settings that survive a database restart.

One place for the SQLAlchemy engine settings of every connection autofit makes to a store: Optuna's
:class:`optuna.storages.RDBStorage` (``autofit run --storage``, a worker's search) and the scheduler's
own tables (:mod:`autofit.schedule.store`) use the same ones.

- PostgreSQL (and any server): ``pool_pre_ping`` tests a pooled connection before handing it out, so a
  connection the server dropped (a restart, a failover, an idle timeout) is replaced instead of failing
  the next query (SQLAlchemy, "Dealing with Disconnects": ``sqlalchemy/engine/create.py``,
  ``pool_pre_ping``); ``pool_recycle`` replaces connections older than five minutes, before a proxy or
  firewall drops them silently.
- SQLite: wait up to 60 s for another process's write lock instead of failing at once.
"""

from __future__ import annotations

import functools
from typing import Any


def engine_kwargs(url: str) -> dict[str, Any]:
    """``create_engine`` keyword arguments for ``url``."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60}}
    return {"pool_pre_ping": True, "pool_recycle": 300}


@functools.lru_cache(maxsize=8)
def rdb_storage(url: str) -> Any:
    """Optuna's RDB storage on ``url``, one per process (its engine keeps a pool of connections)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url))


def database_errors() -> tuple[type[BaseException], ...]:
    """What a store raises when the database is unreachable or failed a statement (not a wrong request):
    SQLAlchemy's errors and Optuna's wrapper of them (``optuna/storages/_rdb/storage.py``,
    ``_create_scoped_session``)."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    return (SQLAlchemyError, optuna.exceptions.StorageInternalError)
