"""Probes where autofit is PID 1, as in a container without an init process (Docker, Kubernetes).

``unshare --pid --fork --mount-proc`` starts ``autofit probe`` as PID 1 of a new PID namespace;
its worker's parent pid is then 1, which must read as a live parent. Skipped where unshare or
the privilege to make a PID namespace is missing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ENTRY = f"{Path(__file__).resolve().parent / 'probe_workloads.py'}:tiny"
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run([*UNSHARE, "sh", "-c", "echo $$"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip() == "1"


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="no unshare, or no privilege for a PID namespace")
def test_a_probe_run_as_pid_1_succeeds() -> None:
    cli = "import os, sys; assert os.getpid() == 1, os.getpid(); from autofit.cli import main; main()"
    argv = ["probe", ENTRY, "--hardware", "cpu", "--steps", "1", "--json"]
    # SGD needs no DeepSpeed op built; a first op build (fused_adam) took 634 s on this loaded 2-core machine
    for fixed in ("micro_batch_size=2", "zero_stage=0", "offload_optimizer=none", "optimizer=sgd", "precision=fp32"):
        argv += ["--set", fixed]
    done = subprocess.run([*UNSHARE, sys.executable, "-c", cli, *argv], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["status"] == "ok", result["message"]
    assert result["peak_bytes"] > 0
