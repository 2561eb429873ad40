"""A throwaway PostgreSQL server for the scheduler's tests: a fresh cluster on loopback, stopped at the end.

PostgreSQL refuses to run as root, so as root the cluster is made and started as the ``postgres`` user
(``runuser``); as anyone else, as that user. The server binaries are looked up where Debian puts them
(``/usr/lib/postgresql/<version>/bin``, ``.ci/run`` installs them) or on PATH.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def server_bin() -> Path | None:
    """The folder with ``initdb`` and ``pg_ctl``, newest version first; None when PostgreSQL is not installed."""
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True):
        if (Path(folder) / "initdb").exists():
            return Path(folder)
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """``initdb`` + ``pg_ctl start`` in a temporary folder; :meth:`url` of a new database per test."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="autofit-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.root, "postgres")
        self._n = 0

    def _run(self, *args: str) -> None:
        command = ["runuser", "-u", "postgres", "--", *args] if self.as_postgres else list(args)
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {done.stdout[-1000:]} {done.stderr[-1000:]}")

    def start(self) -> Server:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self.up()
        return self

    def up(self) -> None:
        """Start the cluster's server (again), on the same port: clients reconnect to the same URL."""
        options = f"-k {self.root} -h 127.0.0.1 -p {self.port} -c fsync=off -c max_connections=200"
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-o", options, "-w", "start")

    def down(self, mode: str = "immediate") -> None:
        """Stop the server, keeping the cluster: ``immediate`` drops every connection at once, as a crash or a
        killed pod does (committed data survives: the write-ahead log is replayed at the next start)."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, down_s: float = 0.0, mode: str = "immediate") -> None:
        """Stop the server, wait ``down_s`` seconds, start it again."""
        self.down(mode)
        time.sleep(down_s)
        self.up()

    def stop(self) -> None:
        try:
            self.down()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database's URL."""
        import psycopg

        self._n += 1
        name = f"autofit_{os.getpid()}_{self._n}_{int(time.time())}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)
