"""Fixtures of the scheduler's tests: a real PostgreSQL server (one per session), SQLite files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pgserver import Server, server_bin


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Server]:
    """A PostgreSQL cluster on loopback for the session. Skipped without PostgreSQL, unless
    ``AUTOFIT_REQUIRE_POSTGRES=1`` (``.ci/run`` sets it: there a missing server is a failure)."""
    bindir = server_bin()
    if bindir is None:
        if os.environ.get("AUTOFIT_REQUIRE_POSTGRES") == "1":
            pytest.fail("PostgreSQL server binaries not found (apt-get install postgresql)")
        pytest.skip("PostgreSQL is not installed")
    server = Server(bindir).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(postgres_server: Server) -> str:
    """A fresh PostgreSQL database of the test's own."""
    return postgres_server.new_database()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'queue.db'}"
