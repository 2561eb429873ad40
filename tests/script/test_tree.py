"""Memory of a process tree, read from outside: a child's own peak and what its children hold."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from autofit.script.tree import TreeMeter

MIB = 2**20

#: holds 120 MiB for a moment, frees it, then starts a grandchild that holds 80 MiB while the parent sleeps
_TREE = textwrap.dedent(
    """
    import subprocess, sys, time
    block = bytearray(120 * 2**20)
    time.sleep(0.3)
    del block
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(80 * 2**20); time.sleep(0.6)"])
    child.wait()
    """
)


def _meter(budget_bytes: int | None) -> tuple[TreeMeter, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", _TREE])
    exceeded: list[int] = []
    meter = TreeMeter([proc.pid], "cpu", budget_bytes, exceeded.append)
    with meter:
        proc.wait(timeout=60)
        time.sleep(0.05)
    return meter, exceeded


def test_the_peak_is_the_processs_high_water_mark_plus_its_childrens_memory() -> None:
    meter, exceeded = _meter(None)
    # the parent's freed 120 MiB stays in its VmHWM; the grandchild's 80 MiB comes on top while it lives
    assert meter.peaks[0] >= (120 + 80) * MIB
    assert meter.peaks[0] < (120 + 80 + 200) * MIB  # two interpreters' own memory, not more
    assert exceeded == []


def test_passing_the_budget_is_reported_once() -> None:
    meter, exceeded = _meter(100 * MIB)
    assert meter.exceeded and len(exceeded) == 1 and exceeded[0] > 100 * MIB
