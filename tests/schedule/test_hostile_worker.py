"""Issue 40, class 6: code a worker was not allowed to run. With entry roots, Hub models only from the allow-list;
an entry whose sources changed since ``schedule add`` is refused before any of it runs (real queue, real files)."""

from __future__ import annotations

from pathlib import Path

import pytest
from queue_helpers import model_worker, queue_tiny
from tiny import HERE as TINY

from autofit.schedule import queue
from autofit.schedule.checks import allowed_hub, entry_refusal


def test_hub_models_under_entry_roots_need_the_allow_list(tmp_path: Path) -> None:
    roots = (tmp_path.resolve(),)
    remote = "hf:evil-org/model?seq_len=16&trust_remote_code=true"
    assert "Hub allow-list" in str(entry_refusal(remote, roots, ()))
    assert "Hub allow-list" in str(entry_refusal("hf:some-org/model?seq_len=16", roots, ()))
    assert entry_refusal(remote, roots, allowed_hub(["Evil-Org/Model"], environ={})) is None
    assert entry_refusal(remote, roots, allowed_hub(environ={"AUTOFIT_ALLOW_HUB": "other/x, evil-org/*"})) is None
    assert entry_refusal("hf:evil-org/other", roots, allowed_hub(["evil-org/model"], environ={})) is not None


@pytest.mark.slow
def test_an_entry_changed_after_queueing_never_runs_in_the_worker(sqlite_url: str, tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text(TINY.read_text())
    queue_tiny(sqlite_url, entry=f"{model}:tiny_workload", memory_mib=None)
    marker = tmp_path / "ran"
    future = "from __future__ import annotations\n"
    model.write_text(TINY.read_text().replace(future, f"{future}open({str(marker)!r}, 'w').write('x')\n"))
    worker = model_worker(sqlite_url, "w")
    worker.entry_roots = (tmp_path.resolve(),)
    worker.serve()
    row = queue.search_rows(sqlite_url)[0]
    assert row.state == "failed" and "not the workload that was queued" in str(row.message)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize(("at_load", "reason"), [
    ("import time; time.sleep(10**6)", "did not finish within 3 s"),
    ("os._exit(0)", "ended the process while loading (exit status 0)"),
], ids=["hang", "os-exit"])
def test_an_entry_that_hangs_or_exits_when_the_worker_loads_it_fails_its_search_and_the_worker_goes_on(
        sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at_load: str, reason: str) -> None:
    model = tmp_path / "model.py"
    future = "from __future__ import annotations\n"
    # the same file at queueing and in the worker: only the worker's environment makes it hang or exit
    model.write_text(TINY.read_text().replace(future, f"{future}import os\nif os.environ.get('AT_LOAD'):\n"
                                                      f"    {at_load}\n"))
    queue_tiny(sqlite_url, entry=f"{model}:tiny_workload", memory_mib=None)
    monkeypatch.setenv("AT_LOAD", "1")
    monkeypatch.setenv("AUTOFIT_LOAD_TIMEOUT_S", "3")
    worker = model_worker(sqlite_url, "w")
    worker.entry_roots = (tmp_path.resolve(),)
    assert len(worker.serve()) == 1
    row = queue.search_rows(sqlite_url)[0]
    assert row.state == "failed" and reason in str(row.message), row.message
