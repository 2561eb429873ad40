"""Session-wide set-up shared by every test folder."""

from __future__ import annotations

import pytest


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
