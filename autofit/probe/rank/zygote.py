"""The warm parent of a search's probe ranks: ``python -m autofit.probe.rank.zygote`` (started by
:class:`autofit.probe.warm.WarmParent`).

A probe rank started from nothing spends seconds before its first step on work that is the same for every probe
of a search: importing torch, DeepSpeed and the workload's libraries, torch's compiler front end (``torch.optim``
imports ``torch._dynamo`` when the first optimizer is made), DeepSpeed's compiled ops (each op's ``load`` runs
py-cpuinfo in a subprocess before it finds the op built). This process does that work once, then forks one child
per rank the launcher asks for. Each child is a process of its own, as a fresh one is: its own session (the
launcher kills it, and all it started, by its process group), its own peak, its own end; a crash, an OOM or a hang
in it cannot reach this process or the next child, which is forked from this process's unchanged state.

What the child inherits must be what a fresh rank would have at its memory baseline (docs/design.md, "Memory,
measured"), so the probe measures the same peak whichever way it started:

* The baseline imports (:func:`autofit.probe.rank.worker.import_workload`) are done here; the child takes its
  baseline after repeating them (cached: instant).
* What a fresh rank does *after* its baseline (the compiler front end, the ops) is done here too, and its resident
  bytes, read here before and after (settled: :func:`autofit.probe.rank.memory.settled_rss_bytes`), are the
  child's ``prepaid_bytes``: its baseline is lowered by them, so its peak counts them as a fresh rank's does.
* No computation runs here: an OpenMP (libgomp) thread pool made before a fork is unusable in the child. This
  process starts no thread (torch's import leaves one native thread of its own, as in any process that forks
  DataLoader workers). Each child sets its own thread count (``OMP_NUM_THREADS`` of its rank environment) before
  its first operation.
* CUDA: a CUDA context does not survive ``fork``. This process never creates one (the device check is NVML's,
  ``PYTORCH_NVML_BASED_CUDA_CHECK``); if one exists all the same (``torch.cuda.is_initialized()``), it forks
  nothing and answers ``cold``: the launcher then starts the rank as a fresh process.

Protocol, one JSON object a line: the first line on stdin says what to prepare (``entry``, ``attention``,
``ops``); this process answers ``{"ready": ...}`` (or ``{"error": ...}``) on the file descriptor it was given as
stdout, which it keeps for the protocol alone (DeepSpeed logs on stdout: that goes to stderr here). Then each line
``{"spec", "env", "log"}`` is answered ``{"forked": pid}`` or ``{"cold": why}``, and each child's end is reported
``{"exited": pid, "code": returncode}`` (Popen's convention: ``-N`` for a signal) as soon as it is reaped. End of
stdin ends this process (its children die with it: they asked the kernel to).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from autofit.machine.lifetime import die_with_parent, parent_from_env
from autofit.probe.ops import load_ops_here
from autofit.probe.rank.memory import populate, resident_file_runs, settled_rss_bytes
from autofit.probe.rank.worker import import_workload, run_rank

_PPID_AT_START = os.getppid()


def prepare(entry: str, attention: str, ops: list[str], kind: str) -> dict[str, Any]:
    """Import what every rank imports, then do what every rank does after its baseline; returns the ``ready``
    answer: the seconds it took and the resident bytes of the second part (``prepaid_bytes``)."""
    started = time.time()
    import deepspeed  # noqa: F401
    import torch

    import_workload(entry, attention, torch)
    before = settled_rss_bytes()
    import torch._dynamo  # noqa: F401  (torch.optim's first optimizer imports it)

    # a CUDA op's builder asks the device for its compute capability, which creates a CUDA context: each rank
    # loads its CUDA ops itself
    loaded = load_ops_here(ops) if ops and kind == "cpu" else {}
    prepaid = max(0, settled_rss_bytes() - before)
    if kind == "cuda" and torch.cuda.is_initialized():
        return {"error": "a CUDA context exists in the warm parent after its imports"}
    return {"ready": True, "seconds": time.time() - started, "prepaid_bytes": prepaid, "ops": loaded}


def _file_pages(kind: str) -> list[tuple[int, int]]:
    """CPU: the library pages this process holds resident, which each child faults in before its baseline
    (:func:`autofit.probe.rank.memory.resident_file_runs`): a fresh rank holds them from its imports. CUDA: none
    (the device's memory is NVML's, not the process's)."""
    return resident_file_runs() if kind == "cpu" else []


@dataclass(frozen=True)
class Inheritance:
    """What a child is given beside this process's memory: the bytes it is credited (``prepaid_bytes``, see the
    module's docstring) and the library pages it faults in before its baseline (:func:`_file_pages`)."""

    prepaid_bytes: int
    file_pages: list[tuple[int, int]]


def fork_rank(request: dict[str, Any], given: Inheritance, channels: tuple[int, ...]) -> dict[str, Any]:
    """Fork the child of one rank (:func:`_child`); the answer for the launcher."""
    import torch

    if torch.cuda.is_initialized():
        return {"cold": "a CUDA context exists in the warm parent: a forked child cannot use it"}
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _child(request, given, channels, parent)  # never returns
    return {"forked": pid}


def _child(request: dict[str, Any], given: Inheritance, channels: tuple[int, ...], parent: int) -> None:
    """The rank, in the forked child: a session of its own, its log as stdout and stderr, its rank environment,
    its thread count, ended with this process, the parent's library pages in its page table; then the worker's
    rank, which ends the process."""
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in {*channels, log, null} - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        die_with_parent(parent)
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        populate(given.file_pages)
        run_rank(Path(request["spec"]), started_at=time.time(), prepaid_bytes=given.prepaid_bytes)
    finally:
        os._exit(70)  # run_rank ends the process itself; reached only when it could not start


def _reap(out: TextIO) -> None:
    """Report every child that has ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(out, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _say(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def serve(requests: TextIO, out: TextIO, given: Inheritance) -> None:
    """Answer fork requests until ``requests`` ends, reporting ended children as they end."""
    channels = (requests.fileno(), out.fileno())
    while True:
        ready, _, _ = select.select([requests], [], [], 0.02)
        _reap(out)
        if not ready:
            continue
        line = requests.readline()
        if not line:
            return
        try:
            _say(out, fork_rank(json.loads(line), given, channels))
        except Exception as exc:  # a request it cannot serve: the launcher starts that rank fresh
            _say(out, {"cold": f"{type(exc).__name__}: {exc}"[:300]})


def main() -> int:
    die_with_parent(parent_from_env(_PPID_AT_START))
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print goes to stderr; stdout's descriptor is the protocol's
    setup = json.loads(sys.stdin.readline() or "{}")
    try:
        ready = prepare(setup["entry"], setup["attention"], list(setup.get("ops", ())), setup["kind"])
    except BaseException as exc:  # the launcher starts every rank fresh, where the same error will say itself
        ready = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    _say(out, ready)
    if "error" in ready:
        return 1
    serve(sys.stdin, out, Inheritance(int(ready["prepaid_bytes"]), _file_pages(setup["kind"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
