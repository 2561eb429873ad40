"""Optuna's storage on a URL, with the engine settings that survive a database restart.

One place for the SQLAlchemy engine settings of every connection autofit makes to a store: Optuna's
:class:`optuna.storages.RDBStorage` (``autofit run --storage``, a worker's search) and the scheduler's
own tables (:mod:`autofit.schedule.store`) use the same ones.

- PostgreSQL (and any server): ``pool_pre_ping`` tests a pooled connection before handing it out, so a
  connection the server dropped (a restart, a failover, an idle timeout) is replaced instead of failing
  the next query (SQLAlchemy, "Dealing with Disconnects": ``sqlalchemy/engine/create.py``,
  ``pool_pre_ping``); ``pool_recycle`` replaces connections older than five minutes, before a proxy or
  firewall drops them silently.
- PostgreSQL: the server ends a session that sits idle inside a transaction for :data:`IDLE_IN_TRANSACTION_S`
  (``idle_in_transaction_session_timeout``, set on each connection through libpq's ``options``), which frees its
  row locks. A client stopped in the middle of a transaction (``SIGSTOP``, a paused VM, a swapping host) otherwise
  holds them for as long as it is stopped, and whoever touches those rows waits as long: measured, a worker taking
  over a stalled one's search waited on Optuna's ``SELECT ... FOR UPDATE`` of the trial the stalled one was writing
  its parameters to (a claim would wait the same way on a search row whose heartbeat a stopped worker was
  writing). The server rolls the ended session's transaction back; the stopped client's next statement fails as on
  a dropped connection (:func:`transient`).
- SQLite: wait up to 60 s for another process's write lock instead of failing at once.

What is worth trying again: :func:`check_url` refuses, in one line and before any connection, a URL no
database could ever answer (unparsable, an unknown dialect or driver, a driver not installed, a SQLite file
in a folder that does not exist); of the :func:`database_errors`, :func:`transient` says which a retry can cure
(the server down or restarting, a connection dropped or ended by the server, a full pool), never a wrong URL or a
wrong statement.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autofit.core.errors import AutofitError
from autofit.core.storage_url import redact_url, scrub


def check_url(url: str) -> None:
    """An :class:`AutofitError` (one line, the URL redacted) for a storage URL no retry could make work: one
    SQLAlchemy cannot parse (``make_url``: ``ArgumentError``), an unknown dialect or driver (``get_dialect``:
    ``NoSuchModuleError``), a driver that is not installed (the dialect's ``import_dbapi``), a SQLite file whose
    folder does not exist (SQLite creates the file, never its folder). Connects to nothing."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    shown = redact_url(url)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError, TypeError):
        raise AutofitError(f"storage {shown!r} is not a database URL (sqlite:///FILE, "
                           "postgresql://USER@HOST:PORT/DB)") from None
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:  # an ArgumentError too
        raise AutofitError(f"storage {shown}: SQLAlchemy has no database dialect or driver "
                           f"{parsed.drivername!r}") from None
    try:
        if hasattr(dialect, "import_dbapi"):  # SQLAlchemy 2's name for it
            dialect.import_dbapi()
    except ImportError as exc:
        raise AutofitError(f"storage {shown}: its driver is not installed ({exc})") from None
    database = parsed.database or ""
    if parsed.get_backend_name() == "sqlite" and database not in ("", ":memory:") and not database.startswith("file:"):
        folder = Path(database).parent
        if not folder.is_dir():
            raise AutofitError(f"storage {shown}: no folder {folder} for the SQLite file (SQLite creates the file, "
                               "not its folder)")


#: seconds a PostgreSQL session may sit idle inside a transaction before the server ends it (the module's docstring).
#: An autofit or Optuna transaction runs its statements back to back and never waits on a probe or on user code, so
#: only a stopped client sits there that long; one stopped for the default lease (60 s:
#: ``autofit.schedule.queue.DEFAULT_LEASE_S``) has lost its search anyway, and a live one slowed down by a loaded host
#: keeps its session. A URL's own ``?options=-c idle_in_transaction_session_timeout=MS`` wins (0: never).
IDLE_IN_TRANSACTION_S = 60.0

#: the PostgreSQL drivers that take libpq's ``options`` connection parameter
LIBPQ_DRIVERS = ("psycopg", "psycopg2")


def engine_kwargs(url: str) -> dict[str, Any]:
    """``create_engine`` keyword arguments for ``url``."""
    from sqlalchemy.engine import make_url

    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60}}
    kwargs: dict[str, Any] = {"pool_pre_ping": True, "pool_recycle": 300}
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in LIBPQ_DRIVERS:
        ours = f"-c idle_in_transaction_session_timeout={round(IDLE_IN_TRANSACTION_S * 1000)}"
        theirs = parsed.query.get("options")  # connect_args replace the URL's own: joined, theirs last (they win)
        kwargs["connect_args"] = {"options": f"{ours} {theirs}" if isinstance(theirs, str) else ours}
    return kwargs


@functools.lru_cache(maxsize=8)
def rdb_storage(url: str) -> Any:
    """Optuna's RDB storage on ``url``, one per process (its engine keeps a pool of connections)."""
    import optuna

    check_url(url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url))


def database_errors() -> tuple[type[BaseException], ...]:
    """What a store raises when the database fails, among which :func:`transient` finds those trying again can
    cure: any error of the driver (SQLAlchemy's ``DBAPIError``: ``OperationalError`` for the server down,
    restarting or refusing connections, ``InterfaceError``, and any other class on a connection the server ended),
    ``DisconnectionError``, pool ``TimeoutError``, ``PendingRollbackError`` (``sqlalchemy/exc.py``), and Optuna's
    ``StorageInternalError``, its wrapper of any SQLAlchemy error (``optuna/storages/_rdb/storage.py``,
    ``_create_scoped_session``). Not an unparsable URL or a missing driver (``ArgumentError``,
    ``NoSuchModuleError``): those are wrong settings and fail at once, as does a failed statement
    (``ProgrammingError``, ...: not :func:`transient`)."""
    import optuna
    from sqlalchemy.exc import DBAPIError, DisconnectionError, PendingRollbackError, TimeoutError

    return (DBAPIError, DisconnectionError, TimeoutError, PendingRollbackError, optuna.exceptions.StorageInternalError)


def transient(exc: BaseException) -> bool:
    """Whether trying ``exc``'s call again can cure it: the database down or restarting, a connection dropped or
    ended by the server (SQLAlchemy's ``connection_invalidated``, whatever the error's class: PostgreSQL's
    idle-in-transaction timeout is an ``InternalError``), a full pool. Looks through Optuna's
    ``StorageInternalError`` to the SQLAlchemy error it wraps (a ``ProgrammingError`` under it is no outage), and
    for SQLite at its result code (:data:`SQLITE_TRANSIENT`).

    A ``PendingRollbackError`` of a connection lost inside a transaction (SQLAlchemy's code ``8s2b``) is one too:
    Optuna's ``_get_trials`` takes any ``OperationalError`` of its query for too many variables and queries again
    on the same, now invalidated, connection, which raises it; its ``_create_scoped_session`` rolls the session
    back before the error leaves Optuna, so the next call starts on a fresh connection."""
    import optuna
    from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError, PendingRollbackError, TimeoutError

    if isinstance(exc, optuna.exceptions.StorageInternalError):
        return exc.__cause__ is None or transient(exc.__cause__)
    if getattr(exc, "connection_invalidated", False):  # the dialect's is_disconnect: the connection is gone
        return True
    if isinstance(exc, PendingRollbackError):
        return getattr(exc, "code", None) == "8s2b"  # not a Session's failed flush (7s2a): a bug, not an outage
    if not isinstance(exc, (OperationalError, InterfaceError, DisconnectionError, TimeoutError)):
        return False
    name = getattr(getattr(exc, "orig", None), "sqlite_errorname", None)  # sqlite3 says which (Python >= 3.11)
    return name is None or name.startswith(SQLITE_TRANSIENT)


#: the SQLite result codes a retry can cure (https://www.sqlite.org/rescode.html): another writer's lock, an I/O
#: error of a network file system; not SQLITE_ERROR (a missing table or column: sqlite3 raises OperationalError for
#: it) nor SQLITE_CANTOPEN (a folder missing or not writable)
SQLITE_TRANSIENT = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_IOERR", "SQLITE_PROTOCOL")


def short_error(exc: BaseException) -> str:
    """An exception's class and first line (a driver's message runs over several, with a link to SQLAlchemy's
    help); for Optuna's ``StorageInternalError``, whose text blames invalid data whatever happened, its cause's."""
    if exc.__cause__ is not None and type(exc).__name__ == "StorageInternalError":
        exc = exc.__cause__
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:200]}"


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Any database error inside (SQLAlchemy's, Optuna's storage's) as one :class:`AutofitError` line naming the
    store, its password hidden: what a command reading the store (``schedule list``, ``results``) says."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except (SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
        raise AutofitError(scrub(f"the database at {redact_url(url)} failed: {short_error(exc)}", url)) from exc
