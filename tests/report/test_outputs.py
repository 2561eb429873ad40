"""Issue 40, class 3: --out and --report checked before the search, written all or nothing, modes kept; stdout
under --json is the document alone (the real CLI)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

import pytest
from hostile_helpers import FIXED, autofit, make_entry, one_line_error

from autofit.core.errors import AutofitError
from autofit.ds.emit import write_text_atomic
from autofit.report.outputs import REPORT_MARKER, check_outputs, commit_outputs, staged_report

DS = {"train_batch_size": 8}


def test_out_naming_a_folder_or_a_fifo_is_refused_and_left_alone(tmp_path: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    for out, words in ((tmp_path, "is a folder"), (fifo, "not a regular file")):
        with pytest.raises(AutofitError, match=words):
            check_outputs(out, None)
        with pytest.raises(AutofitError, match=words):
            write_text_atomic(out, "{}")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_report_into_the_users_folder_is_refused_but_autofits_own_is_not(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.html").write_text("<p>mine</p>")
    with pytest.raises(AutofitError, match="has files autofit did not write"):
        check_outputs(None, mine)
    (tmp_path / "empty").mkdir()
    check_outputs(None, tmp_path / "empty")
    check_outputs(None, tmp_path / "new" / "deeper")

    def commit(report: Path) -> Path:
        with staged_report(report) as staged:
            assert staged is not None
            (staged.folder / "index.html").write_text("report")
            commit_outputs(DS, tmp_path / "ds.json", staged)
            return staged.final(staged.folder / "index.html")

    index = commit(tmp_path / "rep")
    assert index == tmp_path / "rep" / "index.html" and (tmp_path / "rep" / REPORT_MARKER).is_file()
    check_outputs(None, tmp_path / "rep")  # a previous report: written over
    commit(tmp_path / "rep")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_outputs_are_all_or_nothing(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="disk full"), staged_report(tmp_path / "rep") as staged:
        assert staged is not None
        (staged.folder / "index.html").write_text("half")
        raise OSError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither --out nor the report, no temp folder
    (tmp_path / "blocker").write_text("a file")
    with pytest.raises(OSError), staged_report(tmp_path / "rep") as staged:
        assert staged is not None
        (staged.folder / "index.html").write_text("ok")
        commit_outputs(DS, tmp_path / "blocker" / "ds.json", staged)
    assert not (tmp_path / "rep").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]


def test_a_failed_out_brings_the_previous_report_back(tmp_path: Path) -> None:
    for text, out in (("first", tmp_path / "ds.json"), ("second", tmp_path / "blocker" / "ds.json")):
        with contextlib.suppress(OSError), staged_report(tmp_path / "rep") as staged:
            assert staged is not None
            (staged.folder / "index.html").write_text(text)
            commit_outputs(DS, out, staged)
        (tmp_path / "blocker").touch()
    assert (tmp_path / "rep" / "index.html").read_text() == "first"
    assert json.loads((tmp_path / "ds.json").read_text()) == DS


def test_an_existing_file_keeps_its_mode_and_a_new_one_follows_the_umask(tmp_path: Path) -> None:
    out = tmp_path / "ds.json"
    out.write_text("{}")
    out.chmod(0o640)
    write_text_atomic(out, "{}")
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "new.json", "{}")
        write_text_atomic(tmp_path / "cache.json", "{}", private=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "cache.json").stat().st_mode) == 0o600


@pytest.mark.slow
def test_run_refuses_out_naming_a_folder_before_the_search(tmp_path: Path) -> None:
    res = autofit("run", make_entry(tmp_path), *FIXED, "--out", str(tmp_path), "--storage",
                  f"sqlite:///{tmp_path / 'a.db'}", cwd=tmp_path, timeout=60)
    assert one_line_error(res, "is a folder") and ".tmp" not in res.stderr, res.stderr[-400:]
    assert "candidates" not in res.stderr  # refused before planning


@pytest.mark.slow
@pytest.mark.parametrize("hooks", [{"at_import": "print('hello')"}, {"in_forward": "print('forward!')"},
                                   {"at_call": "os.write(1, b'raw fd 1\\n')"}], ids=["import", "forward", "fd1"])
def test_estimate_json_stdout_is_the_document_alone(tmp_path: Path, hooks: dict[str, str]) -> None:
    res = autofit("estimate", make_entry(tmp_path, **hooks), *FIXED, "--json")
    assert res.returncode == 0, res.stderr[-400:]
    assert json.loads(res.stdout)["candidates"]
