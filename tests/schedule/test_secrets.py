"""The storage's password never leaves the process given it: a whole run on a real PostgreSQL server with a
password in the URL, every output, table, report, log and database row searched for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from queue_helpers import ENTRY

from autofit.cli import main
from autofit.core.storage_url import redact_url, scrub
from autofit.schedule import queue
from autofit.tuner.study import SIGNATURE_ATTR

REPO = Path(__file__).resolve().parents[2]
SECRET = "Zq9-s3cret-Pw"


def _with_password(url: str) -> str:
    """``postgresql://postgres@host/db`` -> ``postgresql://postgres:SECRET@host/db`` (the test server trusts
    loopback, so any password connects)."""
    return url.replace("postgres@", f"postgres:{SECRET}@", 1)


def _autofit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from autofit.cli import main; main()", *args],
                          env=dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", **(env or {})),
                          capture_output=True, text=True, timeout=900)


def _database_text(url: str) -> str:
    """Every row of every table of the database (ours and Optuna's), as text."""
    import psycopg
    from sqlalchemy.engine import make_url

    parts = make_url(url)
    with psycopg.connect(host=parts.host, port=parts.port, user=parts.username, dbname=parts.database) as conn:
        tables = [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        assert {"autofit_searches", "autofit_workers", "studies", "trials"} <= set(tables)
        return "\n".join(str(row) for table in tables for row in conn.execute(f'SELECT * FROM "{table}"'))


def test_redaction_keeps_the_url_and_hides_only_the_password() -> None:
    url = "postgresql://bob:p%40ss@db.internal:5432/autofit?sslmode=require"
    assert redact_url(url) == "postgresql://bob:***@db.internal:5432/autofit?sslmode=require"
    assert redact_url("sqlite:///autofit.db") == "sqlite:///autofit.db"
    assert scrub(f"could not reach {url}; password p@ss rejected", url) == (
        "could not reach postgresql://bob:***@db.internal:5432/autofit?sslmode=require; password *** rejected")


@pytest.mark.slow
def test_a_password_in_the_storage_url_appears_in_no_output_table_report_log_or_row(pg_url: str, tmp_path: Path) -> None:
    url = _with_password(pg_url)
    runner = CliRunner()
    outputs: list[str] = []
    space = tmp_path / "space.yaml"
    space.write_text("micro_batch_size: [4, 8]\nprecision: [fp32]\noptimizer: [sgd]\nzero_stage: [0]\nattention: [sdpa]\n")
    add = ["schedule", "add", ENTRY, "--hardware", "cpu", "--memory", "1GiB", "--space", str(space), "--set",
           "optimizer=sgd", "--trials", "2", "--storage", url]
    for batch in ("16", "32"):
        done = runner.invoke(main, [*add, "--global-batch", batch, "--json"])
        assert done.exit_code == 0, done.output
        outputs.append(done.output)
    # the second search's study says it was started for another search: the worker's error quotes the storage
    ids = [row.id for row in queue.search_rows(url)]
    queue.study_attrs(url, ids[1])  # the study exists
    import optuna

    from autofit.schedule.store import optuna_storage

    optuna.load_study(study_name=queue.study_name(ids[1]), storage=optuna_storage(url)).set_user_attr(SIGNATURE_ATTR, "x")

    worker = _autofit("worker", "--hardware", "cpu", "--idle-exit", "2", env={"AUTOFIT_STORAGE": url})
    assert worker.returncode == 0, worker.stderr[-2000:]
    outputs += [worker.stdout, worker.stderr]
    states = {row.id: (row.state, row.message) for row in queue.search_rows(url)}
    assert states[ids[0]][0] == "done"
    assert states[ids[1]][0] == "failed" and redact_url(url) in states[ids[1]][1]  # the error names the store, hidden

    for args in (["schedule", "list"], ["schedule", "list", "--json"], ["results", "--report", str(tmp_path / "results")],
                 ["results", "--json"]):
        done = runner.invoke(main, [*args, "--storage", url])
        assert done.exit_code == 0, done.output
        outputs.append(done.output)
    listed = runner.invoke(main, ["schedule", "list", "--storage", url, "--json"]).stdout
    assert "***" in json.dumps(json.loads(listed))

    run = _autofit("run", ENTRY, "--hardware", "cpu", "--memory", "1GiB", "--global-batch", "16", "--space", str(space),
                   "--set", "optimizer=sgd", "--trials", "2", "--storage", url, "--study", "own-run",
                   "--out", str(tmp_path / "ds_config.json"), "--report", str(tmp_path / "run-report"), "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    outputs += [run.stdout, run.stderr]
    assert json.loads(run.stdout)["search"]["storage"] == redact_url(url)

    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.parent.name == "run-report" for p in files) and any(p.parent.name == "results" for p in files)
    leaks = [p.name for p in files if SECRET.encode() in p.read_bytes()]
    leaks += [f"output {i}" for i, text in enumerate(outputs) if SECRET in text]
    leaks += ["database"] if SECRET in _database_text(pg_url) else []
    assert not leaks, leaks
