"""An entry point is loaded once in a forked child, under a time limit, before autofit's own process loads it
(:func:`load_workload_in_time`, what planning and the queue's worker call).

Two things user code can do at import cannot be caught in the process that runs it: ``os._exit(0)`` ends the
process on the spot (``autofit run --out X`` would exit 0 with no file: success, faked), and a load that never
returns (a socket read, a lock, ``input()``) holds a plan or a worker's lease forever. In a child both are seen
from outside: the child reports on a pipe when the load returned (or raised: the error is then the parent's own
load to report, in its usual line), and a child that ended without a word, or did not answer within
:func:`load_timeout_s`, is one :class:`AutofitError` line. The child is forked, not spawned: autofit and torch
are already imported, so the honest path pays the entry's own code again, not an interpreter's start nor torch's import.

The child leads its own session (the subprocesses an entry starts end with it), ends with its parent
(:mod:`autofit.machine.lifetime`), writes nothing to autofit's stdout or stderr, and runs without the storage's
secrets in its environment (:func:`autofit.core.storage_url.without_secrets`).
"""

from __future__ import annotations

import os
import select
import signal
import time

from autofit.core.errors import AutofitError
from autofit.core.storage_url import without_secrets
from autofit.core.units import seconds_from_env
from autofit.machine.lifetime import die_with_parent, end_session_with_parent, kill_session
from autofit.workload.entry import is_loadable, load_workload
from autofit.workload.hf import HfEntry, is_hf_entry
from autofit.workload.types import Workload

#: environment variable: the most seconds loading an entry point may take (a positive number; unset or empty:
#: :data:`LOAD_TIMEOUT_S`)
LOAD_TIMEOUT_ENV = "AUTOFIT_LOAD_TIMEOUT_S"
#: the default limit: an entry builds a config and a factory, not the model; an ``hf:`` entry may fetch a config
#: and remote code from the Hub first
LOAD_TIMEOUT_S = 600.0
#: what the child writes on the pipe once its load returned (``ok``) or raised (``error``)
_LOADED, _RAISED = b"ok", b"error"


def load_timeout_s() -> float:
    """:data:`LOAD_TIMEOUT_ENV` in seconds, else :data:`LOAD_TIMEOUT_S` (:func:`autofit.core.units.seconds_from_env`)."""
    return seconds_from_env(LOAD_TIMEOUT_ENV, LOAD_TIMEOUT_S)


def load_workload_in_time(entry: str) -> Workload:
    """:func:`autofit.workload.entry.load_workload`, once the entry was seen to load in a child within
    :func:`load_timeout_s` (:func:`check_entry_loads`)."""
    check_entry_loads(entry, load_timeout_s())
    return load_workload(entry)


def check_entry_loads(entry: str, timeout_s: float) -> None:
    """Load ``entry`` in a forked child: an :class:`AutofitError` where the child ended without a word (an exit at
    import) or did not finish within ``timeout_s``; nothing where it loaded or raised (the caller's own load
    reports the error). Where no fork is (Windows), or loading ``entry`` runs no user code (:func:`runs_user_code`),
    nothing is checked."""
    if not runs_user_code(entry) or not hasattr(os, "fork"):
        return
    # autofit's own dependencies, which every entry imports and the plan needs next: imported once, before the
    # fork, not in the child and again here (torch alone takes 2-4 s on a 2-core machine, docs/results/hostile.md)
    import torch  # noqa: F401

    if entry.startswith("hf:"):
        import transformers  # noqa: F401

    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _child(entry, parent, read_end, write_end)
    os.close(write_end)
    reaped = False
    try:
        word = _read_word(read_end, timeout_s)
        if word is None:
            raise AutofitError(f"loading entry point {entry!r} did not finish within {timeout_s:g} s "
                               f"({LOAD_TIMEOUT_ENV}): it waits on something that does not come (the network, a lock, "
                               f"input); raise {LOAD_TIMEOUT_ENV} if it is only slow")
        if word in (_LOADED, _RAISED):
            return
        status = os.waitpid(pid, 0)[1]
        reaped = True
        raise AutofitError(f"entry point {entry!r} ended the process while loading ({_how_it_ended(status)}), "
                           "without an error: an entry must return its Workload, not exit (os._exit or a "
                           "crash at import)")
    finally:
        os.close(read_end)
        if not reaped:
            _end(pid)


def runs_user_code(entry: str) -> bool:
    """Whether loading ``entry`` runs code a user wrote: an entry point does, an ``hf:`` entry only with
    ``trust_remote_code`` (the repository's own code); without it only transformers' code runs, on a config (a Hub
    fetch has huggingface_hub's own timeouts). A :class:`Workload` handed over as an object is loaded already."""
    if not is_loadable(entry):
        return False
    return not is_hf_entry(entry) or HfEntry.parse(entry).options.trust_remote_code


def _child(entry: str, parent: int, read_end: int, write_end: int) -> None:
    """The forked child: load ``entry``, say how it went, exit. Never returns."""
    try:
        os.close(read_end)
        os.setsid()
        die_with_parent(parent)
        end_session_with_parent(parent)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_DFL)  # not the worker's handlers
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)  # the parent's own load prints what the entry prints; --json's stdout stays autofit's
        os.dup2(quiet, 2)
        environ = without_secrets(os.environ)
        os.environ.clear()
        os.environ.update(environ)
        try:
            load_workload(entry)
            word = _LOADED
        except BaseException:  # the parent's own load raises it again, and says it in its line
            word = _RAISED
        os.write(write_end, word)
    finally:
        os._exit(0)


def _read_word(read_end: int, timeout_s: float) -> bytes | None:
    """What the child wrote (b"" where it closed the pipe without a word), None where ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([read_end], [], [], min(left, 1.0))
        if ready:
            return os.read(read_end, 16)
    return None


def _how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _end(pid: int) -> None:
    """Kill the child and its session and reap the child."""
    try:
        os.kill(pid, signal.SIGKILL)  # first: a child that has not called setsid yet has no session of its own
    except OSError:
        pass
    kill_session(pid)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
