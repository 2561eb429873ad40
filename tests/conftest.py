"""Session-wide set-up shared by every test folder."""

from __future__ import annotations

import os

import pytest

# One compute thread in every test process: pytest-xdist runs a worker per core, and each worker, its CLI
# subprocesses and their probe ranks would otherwise start as many OpenMP threads as there are cores (a probe rank
# takes ``OMP_NUM_THREADS`` where it is set: autofit/probe/launch.py). Oversubscribed, OpenMP's spinning barriers
# turn a tiny model's step of half a second into several. Set before anything imports torch (the workers start
# after this module is read, with this environment); a value the caller set stands.
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: the DeepSpeed ops the suite's probes and scripts load on the CPU (DS_ACCELERATOR=cpu): AdamW's, and gloo's
#: shared-memory collectives (ShareMemCommBuilder, loaded by ``init_distributed``)
SUITE_OPS = ("fused_adam", "deepspeed_shm_comm")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist, build the ops once in the controller before the workers start (xdist's own sessionstart,
    which starts them, runs last). Left to the tests, an op's first build runs inside one of them while tests on the
    other worker wait on torch's build lock; a test that kills its search mid-build ends that build with it
    (:func:`autofit.probe.ops.load_ops`), a later probe clears the lock it left as stale, and a waiting test then loads
    an ``.so`` that was never written. Built here, every later load finds the op up to date. One process: nothing to
    race, nothing done. A lock an earlier build left when it was killed is cleared first, as a probe's own
    preparation clears it (:func:`autofit.probe.ops.prepare_ops`): left, the build here waits on it to its timeout."""
    import importlib.util

    if not session.config.pluginmanager.hasplugin("dsession") or importlib.util.find_spec("deepspeed") is None:
        return
    from autofit.probe.ops import clear_stale_locks, load_ops

    clear_stale_locks()

    failed = {op: state for op, state in load_ops(SUITE_OPS, "cpu", timeout_s=1800).items() if state != "ok"}
    if failed:  # the tests that need an op say so themselves; the rest run
        print(f"autofit tests: DeepSpeed ops not built before the workers started: {failed}")


@pytest.fixture(scope="session", autouse=True)
def _no_stale_extension_locks() -> None:
    """A DeepSpeed op build killed mid-way leaves torch's lock file behind, and every later
    ``deepspeed.initialize`` that loads the op waits on it forever: the probes clear such locks
    (:func:`autofit.probe.ops.prepare_ops`), but tests that start DeepSpeed directly do not."""
    from autofit.probe.ops import clear_stale_locks

    clear_stale_locks()


@pytest.fixture(scope="session", autouse=True)
def _no_trace_cache() -> None:
    """Tests trace for real and leave nothing in the user's cache directory (:mod:`autofit.trace.cache`); the
    cache's own tests turn it on in a temporary directory. Set in the environment: CLI subprocesses inherit it."""
    import os

    os.environ["AUTOFIT_NO_CACHE"] = "1"
