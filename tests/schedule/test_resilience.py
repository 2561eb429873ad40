"""The queue when things go wrong, on a real PostgreSQL server (and SQLite where the machine does not matter): the
database restarted mid-search, a worker told to stop, a lease lost, a search that kills its workers, clocks apart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pgserver import Server
from queue_helpers import model_worker, queue_tiny

from autofit.machine.device import get_hardware
from autofit.machine.fingerprint import detect_machine, worker_name
from autofit.schedule import queue
from autofit.schedule.request import SearchRequest
from autofit.schedule.store import optuna_storage
from autofit.schedule.worker import Worker
from autofit.tuner.study import CONFIG_ATTR, MEASURED_ATTR, PHASE_ATTR

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu")
#: a search no worker runs here (its entry is never imported): what the queue's own bookkeeping is tested with
_REQUEST = SearchRequest(entry="m.py:f", hardware="cpu", gpus=1, nodes=1, global_batch=8, space={}, space_name="s",
                         fixed={}, trials=2)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


def _machine() -> Any:
    return detect_machine(get_hardware("cpu"))


def _sleepy(url: str, name: str, sleep_s: float, lease_s: float, idle_exit_s: float) -> subprocess.Popen:
    """A worker process (:mod:`sleepy_worker`: the product's loop, probes that take ``sleep_s``)."""
    return subprocess.Popen([sys.executable, str(HERE / "sleepy_worker.py"), url, name, str(sleep_s), str(lease_s),
                             str(idle_exit_s)], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _trials(url: str, search_id: str) -> list[Any]:
    import optuna

    return optuna.load_study(study_name=queue.study_name(search_id), storage=optuna_storage(url)).get_trials(deepcopy=False)


def _searched(trials: list[Any]) -> list[str]:
    """The configs the search measured, one entry per probe (verification probes aside)."""
    return [json.dumps(t.user_attrs[CONFIG_ATTR], sort_keys=True) for t in trials
            if MEASURED_ATTR in t.user_attrs and t.user_attrs[PHASE_ATTR] == "search"]


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Each worker's stderr once it exited 0."""
    logs = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, err[-3000:]
            logs.append(err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return logs


@pytest.mark.slow
def test_a_database_restart_mid_search_leaves_every_search_done_without_probing_a_config_twice(
        postgres_server: Server, pg_url: str) -> None:
    ids = [queue_tiny(pg_url, micro_batches=(1, 2, 4, 8), global_batch=b, trials=4).id for b in (16, 32, 48)]
    workers = [_sleepy(pg_url, f"w{i}", sleep_s=1.0, lease_s=6.0, idle_exit_s=8.0) for i in range(2)]
    _wait(lambda: sum(len(_searched(_trials(pg_url, i))) for i in ids) >= 2, 120, "two probes")
    postgres_server.restart(down_s=3.0)  # every connection dropped in the middle of the workers' probes
    logs = _finish(workers, 300)
    assert any("database error" in log for log in logs)  # the restart reached the workers
    rows = {r.id: r for r in queue.search_rows(pg_url)}
    assert {rows[i].state for i in ids} == {"done"}, [(rows[i].state, rows[i].message) for i in ids]
    for search_id in ids:
        searched = _searched(_trials(pg_url, search_id))
        assert len(searched) == len(set(searched)) >= 1, searched
        assert queue.stored_result(pg_url, search_id)["best"]["measured"]["status"] == "ok"


@pytest.mark.slow
def test_an_idle_worker_rides_out_a_database_that_is_down(postgres_server: Server, pg_url: str) -> None:
    logged: list[str] = []
    device = get_hardware("cpu")
    worker = Worker(pg_url, "patient", device, detect_machine(device), idle_exit_s=1.0, poll_s=0.1, log=logged.append)
    postgres_server.down()
    threading.Timer(2.0, postgres_server.up).start()
    assert worker.serve() == []  # no exception: it retried until the server came back, then idled out
    assert any("database error while registering" in line for line in logged)
    assert [r.state for r in queue.search_rows(pg_url)] == []


def _probe_pids(worker: int) -> tuple[list[int], list[int]]:
    """The probe's processes under a worker process: its ranks (started fresh, ``autofit.probe.rank.worker``, or
    forked by the search's warm parent, ``autofit.probe.rank.zygote``) and every process it started."""
    import psutil

    try:
        descendants = psutil.Process(worker).children(recursive=True)
    except psutil.NoSuchProcess:
        return [], []
    ranks, every = [], []
    for process in descendants:
        try:
            command = " ".join(process.cmdline())
            parent = " ".join(psutil.Process(process.ppid()).cmdline())
        except psutil.Error:
            continue
        every.append(process.pid)
        if "autofit.probe.rank.worker" in command or "autofit.probe.rank.zygote" in parent:
            ranks.append(process.pid)
    return ranks, every


@pytest.mark.slow
def test_sigterm_stops_the_probe_gives_the_search_back_and_exits_zero(pg_url: str) -> None:
    search_id = queue_tiny(pg_url, trials=3).id
    proc = subprocess.Popen(
        [sys.executable, "-c", "from autofit.cli import main; main()", "worker", "--storage", pg_url, "--hardware",
         "cpu", "--lease", "60", "--idle-exit", "60"],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait(lambda: proc.poll() is None and bool(_probe_pids(proc.pid)[0]), 600, "a probe to start")
        _, started = _probe_pids(proc.pid)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # the worker alone, as Kubernetes and docker stop signal PID 1
        _, err = proc.communicate(timeout=60)
        row = queue.search_rows(pg_url)[0]
        elapsed = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert (row.state, row.worker) == ("queued", None) and elapsed < 15, (row.state, elapsed)
    assert "SIGTERM, exiting" in err
    assert not any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                   for pid in started)  # the probe's processes are gone, its warm parent too
    # given back, not lost: the next worker resumes the same study and finishes it
    assert model_worker(pg_url, "next").serve() == [search_id]
    assert [(r.state, r.claims) for r in queue.search_rows(pg_url)] == [("done", 2)]


def test_a_late_finish_of_a_lost_lease_is_refused_and_the_new_holders_winner_stays(url: str) -> None:
    search_id = queue.add_search(url, _REQUEST, "wfp").id
    first = queue.claim(url, "first", _machine(), lease_s=0.5)
    assert first is not None
    time.sleep(0.8)  # first stalls past its lease
    second = queue.claim(url, "second", _machine(), lease_s=30.0)
    assert second is not None and second.id == search_id and second.token != first.token
    assert queue.finish(url, second, "done", result={"best": "second's"})
    assert not queue.finish(url, first, "done", result={"best": "first's"})  # too late: refused
    assert not queue.finish(url, first, "failed", "first gave up")
    assert not queue.release(url, first)
    row = queue.search_rows(url)[0]
    assert (row.state, row.worker, row.message) == ("done", "second", None)
    assert queue.stored_result(url, search_id) == {"best": "second's"}
    # the same worker id claiming again gets a new token: the old claim stays dead
    assert not queue.heartbeat(url, queue.Claim(search_id, "second", first.token))


@pytest.mark.slow
def test_a_stalled_worker_that_lost_its_lease_stops_and_leaves_the_new_winner(pg_url: str) -> None:
    search_id = queue_tiny(pg_url, micro_batches=(1, 2, 4, 8), trials=4).id
    stalled = _sleepy(pg_url, "stalled", sleep_s=2.0, lease_s=2.0, idle_exit_s=0.0)
    try:
        _wait(lambda: any(t.state.name == "RUNNING" for t in _trials(pg_url, search_id)), 120, "a probe")
        os.killpg(stalled.pid, signal.SIGSTOP)  # a stall past its lease (a swapping host, a paused VM)
        time.sleep(2.5)
        assert model_worker(pg_url, "rescuer").serve() == [search_id]
        winner = queue.stored_result(pg_url, search_id)
        os.killpg(stalled.pid, signal.SIGCONT)
        _, err = stalled.communicate(timeout=60)
    finally:
        if stalled.poll() is None:
            os.killpg(stalled.pid, signal.SIGKILL)
    assert stalled.returncode == 0, err[-3000:]
    assert f"{search_id} taken over" in err
    row = queue.search_rows(pg_url)[0]
    assert (row.state, row.worker) == ("done", "rescuer")
    assert queue.stored_result(pg_url, search_id) == winner
    assert _study_attr_winner(pg_url, search_id) == winner


def _study_attr_winner(url: str, search_id: str) -> Any:
    return queue.study_attrs(url, search_id).get(queue.RESULT_ATTR)


@pytest.mark.slow
def test_a_search_whose_workers_keep_vanishing_ends_failed_and_added_again_resumes_its_study(url: str) -> None:
    first = queue_tiny(url)
    for n in range(3):  # three workers claim it and vanish (their leases run out)
        held = queue.claim(url, f"doomed{n}", _machine(), lease_s=0.3, max_claims=3)
        assert held is not None and held.id == first.id
        time.sleep(0.5)
    assert queue.claim(url, "fourth", _machine(), max_claims=3) is None
    row = queue.search_rows(url)[0]
    assert (row.state, row.claims, row.worker) == ("failed", 3, None)
    assert "given up after 3 claims" in row.message
    again = queue_tiny(url)  # someone adds it again: the same search, its own study, queued
    assert (again.id, again.state, again.cached) == (first.id, "queued", False)
    assert model_worker(url, "healthy").serve() == [first.id]
    import optuna

    assert optuna.get_all_study_names(optuna_storage(url)) == [queue.study_name(first.id)]
    assert queue.search_rows(url)[0].state == "done"


def test_leases_follow_the_database_clock_not_the_clients(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    search_id = queue.add_search(url, _REQUEST, "wfp").id
    held = queue.claim(url, "a", _machine(), lease_s=60.0)
    assert held is not None and held.id == search_id
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # a worker whose clock runs an hour ahead
    assert queue.claim(url, "b", _machine(), lease_s=60.0) is None  # a's lease holds: the database says so
    assert queue.heartbeat(url, held)
    row = queue.search_rows(url)[0]
    assert abs(row.heartbeat_s - real()) < 60  # stamped with the server's clock (the same machine here)


def test_worker_ids_are_unique_where_host_and_pid_repeat() -> None:
    ids = {worker_name() for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith(f"{os.uname().nodename}-{os.getpid()}-") for i in ids)


@pytest.mark.slow
def test_a_lease_lost_while_the_search_handles_a_database_error_is_a_takeover(sqlite_url: str) -> None:
    """A stalled worker resumed (``SIGCONT``) meets two things at once: its statement fails (the server ended its
    session meanwhile) and its heartbeat finds the search taken, whose interrupt (``SIGUSR1``) may land while the main
    thread is still handling the database error. It is a takeover, not an ``Interrupted`` out of the worker."""
    from sqlalchemy.exc import OperationalError

    search_id = queue_tiny(sqlite_url).id
    worker = model_worker(sqlite_url, "w")

    def dropped(plan: Any) -> Any:
        def probe(config: Any, steps: int, timeout_s: float) -> Any:
            raise OperationalError("INSERT INTO trial_params ...", {}, Exception("server closed the connection"))
        return probe

    def log(text: str) -> None:  # called inside the worker's handler of the database error: the interrupt lands there
        if "database error" in text and worker._lease is not None:
            worker._lease.lost = True
            worker._on_lease_lost(signal.SIGUSR1, None)

    worker.prober, worker.log = dropped, log
    held = queue.claim(sqlite_url, "w", worker.machine)
    assert held is not None and held.id == search_id
    assert worker.run_one(held) == "taken over"


def _stop_after(storage: Any, statement: str, resume: threading.Event) -> threading.Event:
    """Stop the calling thread (as ``SIGSTOP`` would stop its process) right after ``storage``'s engine ran a
    statement starting with ``statement``, until ``resume``; set once it is stopped. The transaction is open, its row
    locks held, and the server sees the session idle inside it."""
    from sqlalchemy import event

    stopped = threading.Event()

    def after(conn: Any, cursor: Any, sql: str, *args: Any) -> None:
        if sql.lstrip().startswith(statement) and not resume.is_set():
            stopped.set()
            resume.wait(60)

    event.listen(storage.engine, "after_cursor_execute", after)
    return stopped


def test_a_client_stopped_inside_a_transaction_frees_its_locks_and_recovers(pg_url: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker stopped inside Optuna's transaction that writes a trial's parameter, after its ``INSERT INTO
    trial_params`` (whose foreign key locks the trial's row, ``FOR KEY SHARE``): the server ends its session once it
    has sat idle for ``IDLE_IN_TRANSACTION_S``, so another worker's ``FOR UPDATE`` of that trial (a rescuer failing
    it) gets the lock instead of waiting for as long as the first is stopped; the stopped one's statement then fails
    as on a dropped connection, and its storage works again (its session rolled back)."""
    import optuna
    from sqlalchemy import create_engine, text

    from autofit.tuner import storage

    monkeypatch.setattr(storage, "IDLE_IN_TRANSACTION_S", 1.0)
    mine = optuna.storages.RDBStorage(pg_url, engine_kwargs=storage.engine_kwargs(pg_url))  # not the process's cached one
    study = optuna.create_study(storage=mine, study_name="s")
    trial = study.ask()
    resume, failed = threading.Event(), []
    stopped = _stop_after(mine, "INSERT INTO trial_params", resume)

    def write_param() -> None:
        try:
            trial.suggest_int("x", 0, 9)
        except Exception as exc:  # noqa: BLE001 (examined below)
            failed.append(exc)

    writer = threading.Thread(target=write_param)
    writer.start()
    try:
        assert stopped.wait(30)
        started = time.monotonic()
        with create_engine(pg_url).begin() as conn:  # the rescuer
            conn.execute(text("SET LOCAL lock_timeout = '15s'"))  # without the limit: fails here, not a hung test
            conn.execute(text("SELECT trial_id FROM trials WHERE trial_id = :id FOR UPDATE"), {"id": trial._trial_id})
        waited = time.monotonic() - started
    finally:
        resume.set()
        writer.join(60)
    assert waited < 10, waited
    assert len(failed) == 1 and storage.transient(failed[0]), failed
    assert study.ask().number == 1  # the stopped client goes on, on a fresh connection
