"""Entry points from the queue: imported only from under the allowed roots, checked before import; an entry not
importable on one worker is given back for another instead of failing the search for all."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from queue_helpers import model_worker, queue_tiny
from tiny import HERE as TINY

from autofit.cli import main
from autofit.core.errors import AutofitError
from autofit.schedule import queue
from autofit.schedule.checks import entry_refusal, entry_roots


def test_roots_come_from_the_flag_and_the_environment(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert entry_roots([], {}) is None  # neither set: every entry, as before
    assert entry_roots([str(a)], {"AUTOFIT_ENTRY_ROOTS": f"{b}{os.pathsep}{a}"}) == (a.resolve(), b.resolve())



@pytest.mark.parametrize(("written", "says"), [
    ("/nonexistent/typo", "entry root '/nonexistent/typo' (--entry-root, AUTOFIT_ENTRY_ROOTS): no such folder"),
    ("~nosuchuser_zz/models", "entry root '~nosuchuser_zz/models' (--entry-root, AUTOFIT_ENTRY_ROOTS): no such user's"),
])
def test_a_root_that_is_no_folder_stops_the_worker_in_one_line(written: str, says: str, sqlite_url: str) -> None:
    with pytest.raises(AutofitError, match=re.escape(says)):
        entry_roots([], {"AUTOFIT_ENTRY_ROOTS": written})
    done = CliRunner().invoke(main, ["worker", "--storage", sqlite_url, "--hardware", "cpu", "--idle-exit", "0"],
                              env={"AUTOFIT_ENTRY_ROOTS": written})
    assert done.exit_code == 1 and done.output.startswith(f"autofit: error: {says}")
    assert len(done.output.strip().splitlines()) == 1


def test_a_file_is_no_root(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("")
    with pytest.raises(AutofitError, match="not a folder"):
        entry_roots([str(tmp_path / "m.py")], {})

def test_an_entry_outside_the_roots_or_missing_is_refused_without_importing_it(tmp_path: Path) -> None:
    allowed, other = tmp_path / "models", tmp_path / "elsewhere"
    allowed.mkdir()
    other.mkdir()
    (allowed / "m.py").write_text("def workload(): ...\n")
    (other / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    (allowed / "escape").symlink_to(other, target_is_directory=True)
    roots = (allowed.resolve(),)
    assert entry_refusal(f"{allowed}/m.py:workload", roots) is None
    for entry in (f"{other}/evil.py:f", f"{allowed}/../elsewhere/evil.py:f", f"{allowed}/escape/evil.py:f"):
        assert "outside the allowed entry roots" in entry_refusal(entry, roots)
    assert "outside" in entry_refusal("json:loads", roots)  # a package is checked where it lies, not imported
    assert not (tmp_path / "ran").exists()
    assert entry_refusal(f"{allowed}/gone.py:f", roots) == f"not importable here: no file {allowed.resolve()}/gone.py"
    assert entry_refusal("no_such_package_zz.models:f", None) == "not importable here: no module named 'no_such_package_zz'"
    assert "not in this worker's Hub allow-list" in str(entry_refusal("hf:gpt2", roots))  # issue 40: deny by default
    assert entry_refusal("hf:gpt2", roots, ("gpt2",)) is None
    assert entry_refusal("hf:gpt2", None) is None  # no roots: any entry


def test_a_worker_gives_back_an_entry_outside_its_roots_before_importing_it(sqlite_url: str, tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text(TINY.read_text())
    search_id = queue_tiny(sqlite_url, entry=f"{model}:tiny_workload", hardware="l4", memory_mib=None).id
    marker = tmp_path / "imported"
    future = "from __future__ import annotations\n"
    model.write_text(TINY.read_text().replace(future, f"{future}open({str(marker)!r}, 'w').write('x')\n"))
    guarded = model_worker(sqlite_url, "guarded", "l4")
    guarded.entry_roots = (Path(__file__).parent.resolve(),)
    assert guarded.serve() == [search_id]  # claimed once, given back, not claimed again
    row = queue.search_rows(sqlite_url)[0]
    assert (row.state, row.worker, row.claims) == ("queued", None, 0) and "outside the allowed entry roots" in row.message
    assert not marker.exists()
    model_worker(sqlite_url, "open", "l4").serve()  # no roots: its sources changed since queueing, so not imported
    assert not marker.exists()
    row = queue.search_rows(sqlite_url)[0]
    assert row.state == "failed" and "not the workload that was queued" in str(row.message)


@pytest.mark.slow
def test_a_missing_entry_file_on_one_worker_leaves_the_search_to_another(pg_url: str, tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text(TINY.read_text())
    search_id = queue_tiny(pg_url, entry=f"{model}:tiny_workload", hardware="l4", memory_mib=None).id
    model.rename(tmp_path / "away.py")  # this worker's machine has no such file
    model_worker(pg_url, "without-the-file", "l4").serve()
    row = queue.search_rows(pg_url)[0]
    assert row.state == "queued" and "given back by without-the-file: not importable here" in row.message
    (tmp_path / "away.py").rename(model)  # another worker's machine has it
    assert model_worker(pg_url, "with-the-file", "l4").serve() == [search_id]
    row = queue.search_rows(pg_url)[0]
    assert (row.state, row.worker, row.claims, row.message) == ("done", "with-the-file", 1, None)
