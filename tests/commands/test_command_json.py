"""``--json`` of the commands that plan and search, through the one writer (autofit/report/outputs.py,
``emit_document``): the real stdout of the installed ``autofit`` command is the one JSON document, also where the
user's entry prints on fd 1 (what it prints goes to stderr). The queue's commands are checked in
tests/schedule/test_json_stdout.py, ``run --json``'s real stdout in tests/schedule/test_secrets.py (its search, with a
report and a storage, parsed from the process's stdout)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hostile_helpers import env, make_entry

#: the console script ``pip install`` put beside this interpreter (pyproject.toml's ``[project.scripts]``)
AUTOFIT = Path(sys.executable).with_name("autofit")
SPACE = "micro_batch_size: [4, 8]\nprecision: [fp32]\noptimizer: [sgd]\nzero_stage: [0]\ncheckpoint_ratio: [0.0]\n"
DEVICE = ("--hardware", "cpu", "--memory", "1GiB", "--global-batch", "16", "--optimizer", "sgd")


def installed_autofit(*args: str, cwd: Path) -> tuple[dict[str, Any], str]:
    """Run the installed command with ``--json``; its stdout parsed as one document, and its stderr."""
    assert AUTOFIT.exists(), f"no installed autofit command at {AUTOFIT} (pip install -e .)"
    done = subprocess.run([str(AUTOFIT), *args, "--json"], cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout), done.stderr


@pytest.mark.slow
def test_estimate_and_ladder_json_are_the_real_stdout(tmp_path: Path) -> None:
    entry = make_entry(tmp_path, at_import="print('hello from the entry')")
    (tmp_path / "space.yaml").write_text(SPACE)
    space = ("--space", str(tmp_path / "space.yaml"), "--set", "compile=off")

    estimated, said = installed_autofit("estimate", entry, *DEVICE, *space, cwd=tmp_path)
    assert {c["config"]["micro_batch_size"] for c in estimated["candidates"]} <= {4, 8}
    assert "hello from the entry" in said

    ladder, said = installed_autofit("ladder", entry, *DEVICE, cwd=tmp_path)
    assert ladder["rungs"] and ladder["global_batch"] == 16
    assert "hello from the entry" in said
