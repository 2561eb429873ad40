"""A search's warm parent for its probe ranks: the launcher's side of :mod:`autofit.probe.rank.zygote`.

:class:`WarmParent` starts the zygote once (it imports and loads what every rank needs), and
:meth:`WarmParent.fork_rank` asks it for one rank: a forked child, returned as a :class:`WarmRank`, which the launcher
polls, waits for and kills by its process group as it does a rank it started itself
(:func:`autofit.probe.launch.launch`). Where the zygote cannot serve (it failed to start, it died, or a CUDA
context exists in it), :meth:`~WarmParent.fork_rank` returns None and the launcher starts that rank fresh: the probe
is the same, only slower to start.

This module imports no torch: the zygote does.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from autofit.machine.lifetime import PARENT_PID_ENV, kill_session
from autofit.probe.launch import available_cores, training_env

#: seconds the zygote may take to import and load what the ranks need (a cold import of torch and DeepSpeed on a
#: busy 2-core machine is ~10 s; the ops are built already, :func:`autofit.probe.ops.prepare_ops`)
READY_TIMEOUT_S = 180.0
#: seconds the zygote may take to answer a fork request
FORK_TIMEOUT_S = 30.0


class WarmRank:
    """One rank forked by the zygote: the part of :class:`subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int, parent: WarmParent) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._parent = parent

    def poll(self) -> int | None:
        """Its return code (Popen's convention, ``-N`` for signal N) once the zygote reported it ended, else None."""
        if self.returncode is None:
            self.returncode = self._parent.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return int(self.returncode)  # type: ignore[arg-type]


class WarmParent:
    """The zygote of one search: ``entry``'s workload on a ``kind`` device (``cpu``, ``cuda``), the DeepSpeed
    ``ops`` its candidates load already built. Started on the first :meth:`fork_rank`; :meth:`close` ends it (and it
    ends with this process however this process ends: it asked the kernel to)."""

    def __init__(self, entry: str, attention: str, kind: str, ops: tuple[str, ...] = ()) -> None:
        self.entry, self.attention, self.kind, self.ops = entry, attention, kind, ops
        self.proc: subprocess.Popen[bytes] | None = None
        self.failure: str | None = None
        """Why the zygote serves no rank (None while it does, or before it started)."""
        self.ready: dict[str, Any] = {}
        """The zygote's ``ready`` answer: its start-up seconds, ``prepaid_bytes``, the ops it loaded."""
        self._exits: dict[int, int] = {}
        self._buffer = b""
        self._answers: list[dict[str, Any]] = []
        self._log = tempfile.TemporaryFile(prefix="autofit-zygote-")

    def fork_rank(self, spec_path: Path, env: dict[str, str], log_path: Path) -> WarmRank | None:
        """A child of the zygote running the rank ``env`` names of ``spec_path``, its output in ``log_path``; None
        where the zygote cannot serve (:attr:`failure` says why, or the zygote answered ``cold``)."""
        if self.proc is None and self.failure is None:
            self._start()
        if self.failure is not None:
            return None
        answer = self._ask({"spec": str(spec_path), "env": env, "log": str(log_path)}, FORK_TIMEOUT_S)
        if answer is None or "forked" not in answer:
            if answer is None:
                self._fail("the warm parent did not answer a fork request")
            return None
        return WarmRank(int(answer["forked"]), self)

    def exit_code(self, pid: int) -> int | None:
        """The return code the zygote reported for its child ``pid``, None while it runs. A zygote that died
        took its children with it: they read as killed (``-9``)."""
        self._read(0.0)
        if pid not in self._exits and self.failure is not None:
            return -9
        return self._exits.get(pid)

    def close(self) -> None:
        """End the zygote and whatever it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            kill_session(self.proc.pid)
            self.proc.wait()
        self.failure = self.failure or "closed"
        self._log.close()

    def __enter__(self) -> WarmParent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        env = training_env(dict(os.environ), self.kind, local_ranks=1, cores=available_cores())
        env[PARENT_PID_ENV] = str(os.getpid())
        env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available() without a CUDA context
        self.proc = subprocess.Popen([sys.executable, "-m", "autofit.probe.rank.zygote"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True, cwd=os.getcwd())
        setup = {"entry": self.entry, "attention": self.attention, "kind": self.kind, "ops": list(self.ops)}
        answer = self._ask(setup, READY_TIMEOUT_S)
        if answer is None or not answer.get("ready"):
            why = answer.get("error") if answer else f"no answer within {READY_TIMEOUT_S:g} s ({self._last_logged()})"
            self._fail(f"the warm parent did not start: {why}")
            return
        self.ready = answer

    def _last_logged(self) -> str:
        """The last line the zygote wrote on its stderr (why it died, where it did)."""
        self._log.seek(0)
        lines = [line for line in self._log.read()[-4000:].decode("utf-8", "replace").splitlines() if line.strip()]
        return lines[-1].strip()[:300] if lines else "no output"

    def _fail(self, why: str) -> None:
        self.failure = why
        if self.proc is not None and self.proc.poll() is None:
            kill_session(self.proc.pid)
            self.proc.wait()

    def _ask(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """Send ``message``; the zygote's next answer that is not an exit report (None: it died or was silent)."""
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + timeout_s
        while not self._answers and self.failure is None and time.monotonic() < deadline:
            self._read(deadline - time.monotonic())
        return self._answers.pop(0) if self._answers else None

    def _read(self, timeout_s: float) -> None:
        """Take in what the zygote said, waiting up to ``timeout_s`` for a first byte: exit reports into
        :meth:`exit_code`'s table, answers in order for :meth:`_ask`."""
        if self.proc is None or self.proc.stdout is None or self.failure == "closed":
            return
        fd = self.proc.stdout.fileno()
        while select.select([fd], [], [], max(0.0, timeout_s))[0]:
            chunk = os.read(fd, 65536)
            if not chunk:  # the zygote is gone, and its children with it
                self.failure = self.failure or "the warm parent exited"
                return
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "exited" in message:
                    self._exits[int(message["exited"])] = int(message["code"])
                else:
                    self._answers.append(message)
            timeout_s = 0.0
