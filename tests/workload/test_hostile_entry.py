"""Issue 40, class 1 and 6: an entry that exits, raises a BaseException, parses argv, or plants modules beside
itself; run through the real CLI (``python -m autofit``) or a real interpreter."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hostile_helpers import FIXED, autofit, env, make_entry, one_line_error, python

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("hooks", [
    {"at_call": "sys.exit(0)"},
    {"at_import": "sys.exit(0)"},
    {"at_call": "sys.exit(3)"},
    {"at_call": "raise type('Boom', (BaseException,), {})('boom')"},
    {"in_forward": "raise type('Boom', (BaseException,), {})('boom')"},
    {"in_forward": "sys.exit(0)"},
], ids=["exit0-call", "exit0-import", "exit3", "baseexc-call", "baseexc-forward", "exit0-forward"])
def test_an_entry_that_exits_is_one_error_line_and_exit_1(tmp_path: Path, hooks: dict[str, str]) -> None:
    res = autofit("estimate", make_entry(tmp_path, **hooks), *FIXED)
    assert one_line_error(res), (res.returncode, res.stderr[-600:])
    assert "raised" in res.stderr


def test_argparse_at_import_reads_the_entrys_argv_not_autofits(tmp_path: Path) -> None:
    entry = make_entry(tmp_path, at_import="import argparse; p = argparse.ArgumentParser(); p.add_argument('--lr');"
                                           " ARGS = p.parse_args(); assert sys.argv[0].endswith('tiny.py')")
    res = autofit("estimate", entry, *FIXED, "--json")
    assert res.returncode == 0, res.stderr[-600:]
    assert "usage:" not in res.stderr
    assert json.loads(res.stdout)["candidates"]


def test_python_dash_m_autofit_runs_the_cli() -> None:
    res = autofit("--help")
    assert res.returncode == 0 and "estimate" in res.stdout


def test_entries_load_without_shadowing_autofit_or_each_other(tmp_path: Path) -> None:
    entries = {}
    for who in ("a", "b"):
        entries[who] = make_entry(tmp_path / who, at_import=f"import common\nWHO = {who!r}")
        (tmp_path / who / "common.py").write_text(f"WHO = {who!r}\n")
    (tmp_path / "a" / "rich.py").write_text("raise SystemExit('planted rich ran')\n")
    code = f"""
import json, sys
before = list(sys.path)
from autofit.workload.entry import load_workload
before = list(sys.path)
wa = load_workload({entries['a']!r}); wb = load_workload({entries['b']!r})
ma, mb = sys.modules[wa.model.__module__], sys.modules[wb.model.__module__]
import rich
print(json.dumps([ma.WHO, mb.WHO, ma.common.WHO, mb.common.WHO, sys.path == before, 'common' in sys.modules]))
"""
    res = python(code)
    assert res.returncode == 0, res.stderr[-600:]
    assert json.loads(res.stdout.splitlines()[-1]) == ["a", "b", "a", "b", True, False]


def test_an_entry_that_ends_the_process_at_import_is_one_error_line_not_success(tmp_path: Path) -> None:
    res = autofit("estimate", make_entry(tmp_path, at_import="os._exit(0)"), *FIXED, "--json")
    assert one_line_error(res, "ended the process while loading (exit status 0)"), (res.returncode, res.stderr[-600:])
    assert res.stdout == ""


def test_an_entry_that_never_loads_ends_at_the_time_limit_with_what_it_started(tmp_path: Path) -> None:
    marker = tmp_path / "sleeper.pid"
    entry = make_entry(tmp_path, at_import="import subprocess, time\n"
                                           "child = subprocess.Popen(['sleep', '1000'], process_group=0)\n"
                                           f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
                                           "time.sleep(10**6)")
    started = time.monotonic()
    res = autofit("estimate", entry, *FIXED, environ=env(AUTOFIT_LOAD_TIMEOUT_S="3"), timeout=120)
    assert one_line_error(res, "did not finish within 3 s (AUTOFIT_LOAD_TIMEOUT_S)"), (res.returncode, res.stderr[-600:])
    assert time.monotonic() - started < 60
    sleeper = int(marker.read_text())
    deadline = time.monotonic() + 10
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(sleeper)  # the entry's own subprocess ended with it, in a process group of its own


def test_a_load_time_limit_that_is_no_positive_number_is_refused(tmp_path: Path) -> None:
    res = autofit("estimate", make_entry(tmp_path), *FIXED, environ=env(AUTOFIT_LOAD_TIMEOUT_S="nan"))
    assert one_line_error(res, "AUTOFIT_LOAD_TIMEOUT_S must be a finite number > 0, but got 'nan'"), res.stderr[-600:]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_trusted_repositorys_code_that_ends_the_process_is_one_error_line(tmp_path: Path) -> None:
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "configuration_tiny.py").write_text("import os\nos._exit(0)\n")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "autofit_tiny_remote", "architectures": ["TinyRemoteForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tiny.TinyRemoteConfig"}, "hidden_size": 64,
    }))
    res = autofit("estimate", f"hf:{folder}", "--seq-len", "8", "--trust-remote-code", *FIXED,
                  environ=env(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1"))
    assert one_line_error(res, "ended the process while loading (exit status 0)"), (res.returncode, res.stderr[-600:])
