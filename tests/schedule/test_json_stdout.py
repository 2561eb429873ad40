"""``--json`` of the queue's commands through the one writer (autofit/report/outputs.py, ``emit_document``): the real
stdout of a real ``python -m autofit`` process is the one JSON document, also where the entry prints on fd 1 (issue
51: ``schedule add --json`` wrote its document to stderr, so ``id=$(autofit schedule add ... --json)`` was empty)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hostile_helpers import autofit, make_entry

SPACE = "micro_batch_size: [4, 8]\nprecision: [fp32]\noptimizer: [sgd]\nzero_stage: [0]\ncheckpoint_ratio: [0.0]\n"


@pytest.mark.slow
def test_schedule_add_list_and_results_json_is_the_real_stdout(pg_url: str, tmp_path: Path) -> None:
    entry = make_entry(tmp_path, at_import="print('hello from the entry')")
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    add = autofit("schedule", "add", entry, "--hardware", "cpu", "--memory", "1GiB", "--global-batch", "16",
                  "--space", str(space), "--set", "compile=off", "--optimizer", "sgd", "--trials", "2",
                  "--storage", pg_url, "--json")
    assert add.returncode == 0, add.stderr[-2000:]
    added = json.loads(add.stdout)  # the document alone: the entry's print went to stderr
    assert set(added) == {"id", "state", "cached"} and added["state"] == "queued" and added["id"]
    assert "hello from the entry" in add.stderr and added["id"] not in add.stderr

    listed = autofit("schedule", "list", "--storage", pg_url, "--json")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert [s["id"] for s in json.loads(listed.stdout)["searches"]] == [added["id"]]

    shown = autofit("results", "--storage", pg_url, "--json")
    assert shown.returncode == 0, shown.stderr[-2000:]
    rows = json.loads(shown.stdout)["results"]
    assert [(r["hardware"], r["source"]) for r in rows] == [("cpu", "predicted")]
