"""A storage URL that no retry can make work fails at once in one line; only an outage is waited out (a real
SQLite file, a real PostgreSQL server); a lease whose heartbeat fails for any other reason stops its search."""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from click.testing import CliRunner
from pgserver import Server
from queue_helpers import model_worker, queue_tiny
from sqlalchemy import create_engine, text
from sqlalchemy.exc import SQLAlchemyError

from autofit.cli import main
from autofit.core.errors import AutofitError
from autofit.machine.device import get_hardware
from autofit.machine.fingerprint import detect_machine
from autofit.schedule import queue
from autofit.schedule.store import engine
from autofit.schedule.worker import Lease
from autofit.tuner.storage import check_url, engine_kwargs, transient

SECRET = "s3cr3t-pw"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens on it once the socket is closed


@pytest.mark.parametrize(("url", "says"), [
    ("garbage", "is not a database URL"),
    ("nosuchdb://host/db", "no database dialect or driver 'nosuchdb'"),
    ("postgresql+nodriver://host/db", "no database dialect or driver 'postgresql+nodriver'"),
    (f"mysql://me:{SECRET}@host/db", "its driver is not installed"),
    ("sqlite:////nonexistent_dir_zz/q.db", "no folder /nonexistent_dir_zz for the SQLite file"),
])
def test_a_url_no_database_could_answer_is_one_line_without_its_password(url: str, says: str) -> None:
    with pytest.raises(AutofitError) as raised:
        check_url(url)
    assert says in str(raised.value) and "\n" not in str(raised.value) and SECRET not in str(raised.value)


def test_urls_a_database_can_answer_pass(tmp_path: Path) -> None:
    for url in (f"sqlite:///{tmp_path / 'q.db'}", "sqlite://", "sqlite:///:memory:",
                f"postgresql://me:{SECRET}@127.0.0.1:{_closed_port()}/db"):  # unreachable now: an outage, not a typo
        check_url(url)


@pytest.mark.parametrize("command", [
    ["worker", "--hardware", "cpu", "--idle-exit", "0"],
    ["schedule", "list"],
    ["results"],
])
@pytest.mark.parametrize("url", ["garbage", "sqlite:////nonexistent_dir_zz/q.db"])
def test_commands_reading_the_store_refuse_a_wrong_url_at_once_in_one_line(command: list[str], url: str) -> None:
    started = time.monotonic()
    done = CliRunner().invoke(main, [*command, "--storage", url])
    assert done.exit_code == 1 and time.monotonic() - started < 10  # not one retry (a worker's first waits ~1 s)
    assert done.output.startswith("autofit: error: storage ") and len(done.output.strip().splitlines()) == 1
    assert "trying again" not in done.output


@pytest.mark.parametrize("command", [["schedule", "list"], ["results"]])
def test_an_unreachable_server_is_one_line_without_the_password(command: list[str]) -> None:
    url = f"postgresql://me:{SECRET}@127.0.0.1:{_closed_port()}/db"
    done = CliRunner().invoke(main, [*command, "--storage", url])
    assert done.exit_code == 1
    assert len(done.output.strip().splitlines()) == 1, done.output
    assert "the database at postgresql://me:***@127.0.0.1" in done.output and "OperationalError" in done.output
    assert SECRET not in done.output


def _raised(call) -> BaseException:  # noqa: ANN001
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 (the error itself is what is examined)
        return exc
    raise AssertionError("no error")


def _wrapped(exc: BaseException) -> optuna.exceptions.StorageInternalError:
    """As Optuna raises it (``optuna/storages/_rdb/storage.py``, ``_create_scoped_session``)."""
    try:
        raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from exc
    except optuna.exceptions.StorageInternalError as wrapped:
        return wrapped


def test_only_an_outage_is_transient_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    holder = sqlite3.connect(tmp_path / "q.db", isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")  # another process's write lock: no reader gets in
    locked = _raised(lambda: create_engine(url, connect_args={"timeout": 0}).connect().execute(text("SELECT * FROM t")))
    holder.execute("ROLLBACK")
    missing = _raised(lambda: create_engine(url).connect().execute(text("SELECT * FROM no_such_table")))
    assert isinstance(locked, SQLAlchemyError) and isinstance(missing, SQLAlchemyError)
    assert transient(locked) and transient(_wrapped(locked))
    assert not transient(missing) and not transient(_wrapped(missing))  # sqlite3 calls it OperationalError too
    assert not transient(TypeError("a bug"))


def test_only_an_outage_is_transient_postgresql(pg_url: str) -> None:
    down = _raised(lambda: create_engine(pg_url.rsplit(":", 1)[0] + f":{_closed_port()}/db").connect())
    wrong = _raised(lambda: create_engine(pg_url).connect().execute(text("SELECT * FROM no_such_table")))
    assert transient(down) and transient(_wrapped(down))
    assert not transient(wrong) and not transient(_wrapped(wrong))  # ProgrammingError


def test_postgresql_ends_sessions_idle_in_a_transaction_unless_the_url_says_otherwise(pg_url: str) -> None:
    def setting(url: str) -> str:
        with create_engine(url, **engine_kwargs(url)).connect() as conn:
            return str(conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar())

    assert setting(pg_url) == "1min"  # IDLE_IN_TRANSACTION_S
    assert setting(pg_url + "?options=-c%20idle_in_transaction_session_timeout%3D0") == "0"  # the URL's own wins
    assert "connect_args" not in engine_kwargs("postgresql+pg8000://u@h/db")  # no libpq: no ``options``


def test_a_connection_lost_inside_optunas_read_of_trials_is_transient_and_the_storage_recovers(pg_url: str) -> None:
    """Optuna's ``_get_trials`` takes any ``OperationalError`` of its query for too many variables and queries again in
    the same transaction, on the connection the server dropped: SQLAlchemy's ``PendingRollbackError`` (code ``8s2b``),
    what a database restart in the middle of a search can raise (seen ending a search of the restart test
    ``failed``). A dropped connection, so transient; Optuna rolled the session back, so the next read works."""
    from optuna.study import StudyDirection
    from sqlalchemy import event
    from sqlalchemy.exc import PendingRollbackError

    mine = optuna.storages.RDBStorage(pg_url, engine_kwargs=engine_kwargs(pg_url))
    study_id = mine.create_new_study([StudyDirection.MAXIMIZE], "s")
    mine.create_new_trial(study_id)
    killed: list[int] = []

    def drop_connection(conn: Any, cursor: Any, statement: str, *args: Any) -> None:  # the server restarting, for one
        if statement.startswith("SELECT trials.") and not killed:
            killed.append(conn.connection.dbapi_connection.info.backend_pid)
            # each statement its own transaction: a transaction reads pg_stat_activity once and keeps that snapshot,
            # so a backend still exiting at the first look would be seen alive for ever (a slow host's hang)
            with create_engine(pg_url, isolation_level="AUTOCOMMIT").connect() as admin:
                admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": killed[0]})
                deadline = time.monotonic() + 60
                while admin.execute(text("SELECT 1 FROM pg_stat_activity WHERE pid = :pid"), {"pid": killed[0]}).first():
                    assert time.monotonic() < deadline, f"backend {killed[0]} still alive 60 s after its termination"
                    time.sleep(0.05)

    event.listen(mine.engine, "before_cursor_execute", drop_connection)
    error = _raised(lambda: mine.get_all_trials(study_id))
    assert killed and isinstance(error.__cause__, PendingRollbackError), repr(error.__cause__)
    assert transient(error) and transient(error.__cause__)
    assert [t.number for t in mine.get_all_trials(study_id)] == [0]
    assert not transient(PendingRollbackError("This Session's transaction has been rolled back", code="7s2a"))


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.mark.slow
def test_a_heartbeat_that_fails_with_no_outage_stops_the_search_loudly(url: str) -> None:
    queue_tiny(url)
    held = queue.claim(url, "w", detect_machine(get_hardware("cpu")), lease_s=0.3)
    assert held is not None
    lost, logged = threading.Event(), []
    with Lease(url, held, 0.3, on_lost=lost.set, log=logged.append) as lease:
        with engine(url).begin() as conn:  # a schema this autofit does not know: the heartbeat's UPDATE fails
            conn.execute(text("ALTER TABLE autofit_searches DROP COLUMN heartbeat_s"))
        assert lost.wait(10)  # before the lease ran out, not silently after it
    assert lease.lost and "heartbeat_s" in lease.failure
    assert len(logged) == 1 and "the heartbeat failed" in logged[0] and "stopping the search" in logged[0]


@pytest.mark.slow
def test_a_search_whose_entry_check_meets_an_outage_is_given_back_not_run(postgres_server: Server, pg_url: str,
                                                                         tmp_path: Path) -> None:
    added = queue_tiny(pg_url)
    worker = model_worker(pg_url, "w")
    logged: list[str] = []
    worker.log = logged.append
    worker.entry_roots = (tmp_path,)  # the tiny model lies elsewhere: a check that runs would give it back
    held = queue.claim(pg_url, "w", worker.machine)
    assert held is not None
    postgres_server.down()
    threading.Timer(2.0, postgres_server.up).start()
    assert worker.run_one(held) == "database error"  # released once the server was back
    assert not any("running" in line for line in logged), logged  # never ran unchecked
    assert added.id not in worker.given_back  # the check was not made: it may claim it again
    assert [r.state for r in queue.search_rows(pg_url)] == ["queued"]
