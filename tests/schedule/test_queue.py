"""The queue on SQLite and on a real PostgreSQL server: atomic claims, leases, takeover, the cache."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from queue_helpers import model_worker, queue_tiny
from tiny import HERE as TINY

from autofit.schedule import queue
from autofit.schedule.request import SearchRequest
from autofit.schedule.status import search_summaries


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


def _request(n: int, **changes: Any) -> SearchRequest:
    return replace(SearchRequest(entry="m.py:f", hardware="cpu", gpus=1, nodes=1, global_batch=8 * n, space={},
                                 space_name="s", fixed={}, trials=2), **changes)


def _machine(name: str = "cpu"):  # noqa: ANN202
    from autofit.machine.device import get_hardware
    from autofit.machine.fingerprint import detect_machine

    return detect_machine(get_hardware(name))


def test_each_search_is_claimed_by_exactly_one_of_many_racing_workers(url: str) -> None:
    ids = {queue.add_search(url, _request(n), "wfp").id for n in range(1, 5)}
    assert len(ids) == 4
    machine = _machine()
    claimed: dict[str, list[str]] = {}
    start = threading.Barrier(8)

    def race(worker: str) -> None:
        start.wait()
        claimed[worker] = []
        while (held := queue.claim(url, worker, machine)) is not None:
            claimed[worker].append(held.id)

    threads = [threading.Thread(target=race, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [s for searches in claimed.values() for s in searches]
    assert sorted(won) == sorted(ids)  # every search once, none twice
    rows = {r.id: r for r in queue.search_rows(url)}
    assert all(rows[s].worker == w and rows[s].claims == 1 for w, searches in claimed.items() for s in searches)


def test_a_search_whose_lease_ran_out_is_taken_over_and_its_old_holder_is_told(url: str) -> None:
    search_id = queue.add_search(url, _request(1), "wfp").id
    machine = _machine()
    a = queue.claim(url, "a", machine, lease_s=1.0)
    assert a is not None and a.id == search_id
    assert queue.claim(url, "b", machine, lease_s=1.0) is None  # a's lease holds
    assert queue.heartbeat(url, a)
    time.sleep(1.3)
    b = queue.claim(url, "b", machine, lease_s=1.0)
    assert b is not None and b.id == search_id
    assert not queue.heartbeat(url, a)  # a learns it lost the search
    assert not queue.finish(url, a, "done")
    assert queue.finish(url, b, "done")
    assert [(r.state, r.worker, r.claims) for r in queue.search_rows(url)] == [("done", "b", 2)]


def test_a_worker_claims_only_its_own_device_and_count(sqlite_url: str) -> None:
    queue.add_search(sqlite_url, _request(1, hardware="l4"), "wfp")
    queue.add_search(sqlite_url, _request(2, gpus=2), "wfp")
    assert queue.claim(sqlite_url, "w", _machine()) is None


@pytest.mark.slow
def test_a_done_search_is_returned_cached_with_its_winner(url: str) -> None:
    first = queue_tiny(url)
    assert (first.state, first.cached) == ("queued", False)
    assert queue_tiny(url) == first  # queued: the same search, not a second one
    assert model_worker(url, "w1").serve() == [first.id]
    again = queue_tiny(url)
    assert (again.id, again.state, again.cached) == (first.id, "done", True)
    summary = search_summaries(url)[0]
    assert again.result is not None and again.result["best"]["config"] == summary["best"]["config"]
    assert summary["state"] == "done" and summary["worker"] == "w1" and summary["trials"] == 2


@pytest.mark.slow
def test_a_changed_model_file_makes_a_new_search(sqlite_url: str, tmp_path: Path) -> None:
    # on an L4 (a worker answering from the cost model): a CPU plan of a new file measures its kernel footprint in a
    # fresh process (~10 s a file), and the queue's fingerprints do not depend on the device
    model = tmp_path / "model.py"
    model.write_text(TINY.read_text())
    entry = f"{model}:tiny_workload"
    first = queue_tiny(sqlite_url, entry=entry, hardware="l4", memory_mib=None)
    model_worker(sqlite_url, "w1", "l4").serve()
    assert queue_tiny(sqlite_url, entry=entry, hardware="l4", memory_mib=None).cached
    model.write_text(TINY.read_text().replace("n_layers: int = 4", "n_layers: int = 3"))
    changed = queue_tiny(sqlite_url, entry=entry, hardware="l4", memory_mib=None)
    assert (changed.cached, changed.state) == (False, "queued") and changed.id != first.id


@pytest.mark.slow
def test_a_changed_space_makes_a_new_search(sqlite_url: str) -> None:
    first = queue_tiny(sqlite_url)
    model_worker(sqlite_url, "w1").serve()
    other = queue_tiny(sqlite_url, micro_batches=(4,))
    assert (other.cached, other.state) == (False, "queued") and other.id != first.id


@pytest.mark.slow
def test_a_new_torch_or_driver_on_the_workers_makes_a_new_search(sqlite_url: str) -> None:
    first = queue_tiny(sqlite_url)
    model_worker(sqlite_url, "old").serve()
    assert queue_tiny(sqlite_url).cached
    upgraded = model_worker(sqlite_url, "new", torch="99.0", driver="999.1")
    upgraded.serve()  # registers; nothing queued for it yet
    fresh = queue_tiny(sqlite_url)
    assert (fresh.cached, fresh.state) == (False, "queued") and fresh.id != first.id
    assert upgraded.serve() == [fresh.id]
    assert queue_tiny(sqlite_url) == queue.Added(fresh.id, "done", True, queue.stored_result(sqlite_url, fresh.id))


@pytest.mark.slow
def test_nothing_fits_is_a_state_and_is_cached_too(sqlite_url: str) -> None:
    first = queue_tiny(sqlite_url, memory_mib=2)
    model_worker(sqlite_url, "w").serve()
    summary = search_summaries(sqlite_url)[0]
    assert summary["state"] == "nothing-fits" and "nothing fits" in summary["message"]
    again = queue_tiny(sqlite_url, memory_mib=2)
    assert (again.id, again.state, again.cached) == (first.id, "nothing-fits", True)


def test_a_worker_that_finds_another_model_than_queued_fails_the_search(sqlite_url: str, tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text(TINY.read_text())
    queue_tiny(sqlite_url, entry=f"{model}:tiny_workload", hardware="l4", memory_mib=None)  # on an L4: as above
    model.write_text(TINY.read_text().replace("n_layers: int = 4", "n_layers: int = 2"))
    model_worker(sqlite_url, "w", "l4").serve()
    summary = search_summaries(sqlite_url)[0]
    assert summary["state"] == "failed" and "not the workload that was queued" in summary["message"]
    assert summary["probes"] == 0


def test_the_documented_url_form_reaches_postgresql_through_psycopg_3(pg_url: str) -> None:
    # `postgresql://user@host/db` as README and examples/slurm document it: SQLAlchemy 2 maps it to psycopg 3
    from click.testing import CliRunner

    from autofit.cli import main
    from autofit.schedule.store import engine

    assert pg_url.startswith("postgresql://")
    assert engine(pg_url).dialect.driver == "psycopg"
    queue.add_search(pg_url, _request(1), "wfp")
    done = CliRunner().invoke(main, ["schedule", "list", "--storage", pg_url, "--json"])
    assert done.exit_code == 0, done.output


@pytest.mark.slow
def test_a_changed_sibling_module_the_entry_imports_makes_a_new_search(sqlite_url: str, tmp_path: Path) -> None:
    (tmp_path / "sizes.py").write_text("WIDTH = 64\n")
    model = tmp_path / "model.py"
    model.write_text(TINY.read_text() + "\nfrom sizes import WIDTH  # noqa: E402, F401\n")
    entry = f"{model}:tiny_workload"
    first = queue_tiny(sqlite_url, entry=entry, hardware="l4", memory_mib=None)  # on an L4: as above
    model_worker(sqlite_url, "w1", "l4").serve()
    assert queue_tiny(sqlite_url, entry=entry, hardware="l4", memory_mib=None).cached
    (tmp_path / "sizes.py").write_text("WIDTH = 64  # the model file itself is unchanged\n")
    changed = queue_tiny(sqlite_url, entry=entry, hardware="l4", memory_mib=None)
    assert (changed.cached, changed.state) == (False, "queued") and changed.id != first.id


@pytest.mark.slow
def test_the_cache_compares_with_the_live_workers_not_the_last_started_one(sqlite_url: str) -> None:
    from dataclasses import replace

    from sqlalchemy import update

    from autofit.schedule.store import engine, tables

    first = queue_tiny(sqlite_url)
    old = model_worker(sqlite_url, "old")
    old.serve()  # done on the old software, then exited
    queue.register_worker(sqlite_url, "still-up", old.machine)  # a live worker on the same software
    upgraded = replace(old.machine, software=old.machine.software | {"transformers": "99.0"})
    model_worker(sqlite_url, "new", software=upgraded.software).serve()  # started last, but exited at once
    assert queue_tiny(sqlite_url) == queue.Added(first.id, "done", True, queue.stored_result(sqlite_url, first.id))
    workers = tables()[2]
    with engine(sqlite_url).begin() as conn:  # the old-software worker goes away; the upgraded one comes back
        conn.execute(update(workers).where(workers.c.id == "still-up").values(state="exited"))
    queue.register_worker(sqlite_url, "new-again", upgraded)
    fresh = queue_tiny(sqlite_url)
    assert (fresh.cached, fresh.state) == (False, "queued") and fresh.id != first.id
