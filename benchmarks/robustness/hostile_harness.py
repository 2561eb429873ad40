"""The harness of ``benchmarks/robustness/hostile_inputs.py`` (issue 40): autofit run as real subprocesses (the CLI, a
worker over a SQLite queue, real cache folders) against hostile input; the cases register with :func:`case`.

Adapted from the investigation's ``cases.py``: the source root is this checkout (``AUTOFIT_ROOT`` overrides), the
interpreter this one (``AUTOFIT_PYTHON`` overrides)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = os.path.abspath(os.environ.get("AUTOFIT_ROOT", str(Path(__file__).resolve().parents[2])))
PY = os.environ.get("AUTOFIT_PYTHON", sys.executable)
LAUNCH = 'import sys; sys.argv[0] = "autofit"; from autofit.cli import main; main()'
WORK = Path(tempfile.mkdtemp(prefix="autofit-hostile-"))
CACHE = WORK / "cache"  # the warm cache the value cases share (read only after setup)
SECRET = "S3cretPw9"
H100 = ["--hardware", "h100-80gb", "--global-batch", "16", "--set", "micro_batch_size=4", "--set", "zero_stage=0"]
CPU_REQ = ["--hardware", "cpu", "--memory", "2GiB", "--global-batch", "16", "--space", "cpu",
           "--set", "micro_batch_size=4", "--set", "zero_stage=0", "--set", "checkpoint_ratio=0.0",
           "--optimizer", "sgd", "--set", "attention=sdpa", "--set", "compile=off"]
CPU_RUN = [*CPU_REQ, "--trials", "1"]


# ---------------------------------------------------------------- running things

def base_env(**extra: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOFIT_", "HF_", "PG"))}
    env.update(PYTHONPATH=ROOT, DS_ACCELERATOR="cpu", AUTOFIT_CACHE_DIR=str(CACHE), AUTOFIT_TRACE_WORKERS="1",
               HF_HUB_OFFLINE="1", HF_HOME=str(WORK / "hf"), TRANSFORMERS_OFFLINE="1", COLUMNS="200",
               OMP_NUM_THREADS="1")
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


class Res:
    def __init__(self, rc: int | None, out: str, err: str, secs: float) -> None:
        self.rc, self.out, self.err, self.secs = rc, out, err, secs

    @property
    def timed_out(self) -> bool:
        return self.rc is None

    def last(self) -> str:
        lines = [ln for ln in self.err.strip().splitlines() if ln.strip()]
        return lines[-1][:160] if lines else ""

    def json(self) -> object | None:
        try:
            return json.loads(self.out)
        except ValueError:
            return None


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60, cwd: Path | None = None) -> Res:
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=env or base_env(), cwd=str(cwd or WORK), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = None
    return Res(rc, out, err, time.monotonic() - started)


def af(*args: str, env: dict[str, str] | None = None, timeout: float = 60, cwd: Path | None = None) -> Res:
    return run([PY, "-c", LAUNCH, *args], env=env, timeout=timeout, cwd=cwd)


def lib(code: str, env: dict[str, str] | None = None, timeout: float = 60) -> Res:
    return run([PY, "-c", textwrap.dedent(code)], env=env, timeout=timeout)


class Skip(Exception):
    pass


def lib_json(code: str, env: dict[str, str] | None = None) -> object:
    """Run ``code`` (which prints one JSON value last); Skip when an autofit import moved."""
    r = lib(code, env=env)
    if "ModuleNotFoundError" in r.err or "ImportError" in r.err:
        raise Skip(r.last())
    try:
        return json.loads(r.out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"lib code failed: {r.last()}") from None


# ---------------------------------------------------------------- entries

ENTRY_TEMPLATE = '''\
import os, sys
{at_import}
import torch
from torch import nn
from autofit import Workload


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Tiny(nn.Module):
    def __init__(self, d=64, n_layers=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x, y):
        {in_forward}
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x).mean(dim=1), y)


def tiny_workload():
    {at_call}
    return Workload(model=Tiny, batch=lambda n: (torch.randn(n, 128, 64), torch.randn(n, 1)), name="tiny")
'''


def make_entry(folder: Path, name: str = "tiny", at_import: str = "", at_call: str = "pass",
               in_forward: str = "pass") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(ENTRY_TEMPLATE.format(at_import=at_import, at_call=at_call,
                                                             in_forward=in_forward))
    return f"{folder / name}.py:tiny_workload"


def marker_code(path: Path, what: str = "ran") -> str:
    """One line of Python that appends pid, argv and AUTOFIT_STORAGE to ``path``."""
    return (f"open({str(path)!r}, 'a').write(__import__('json').dumps({{'what': {what!r}, 'pid': os.getpid(), "
            f"'argv': sys.argv, 'storage': os.environ.get('AUTOFIT_STORAGE')}}) + '\\n')")


def marks(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def breakdown(res: Res) -> dict | None:
    doc = res.json()
    if not isinstance(doc, dict) or not doc.get("candidates"):
        return None
    return doc["candidates"][0]["predicted"]["breakdown"]


def no_traceback(res: Res) -> bool:
    return "Traceback (most recent call last)" not in res.err


def one_line_error(res: Res) -> bool:
    return res.rc not in (0, None) and no_traceback(res) and "error" in res.err.lower()


# ---------------------------------------------------------------- the case registry

CASES: list[tuple[str, str, str, object]] = []  # (id, class, expected, fn -> (ok, got) or list of rows)


def case(cid: str, cls: str, expected: str):
    def deco(fn):
        CASES.append((cid, cls, expected, fn))
        return fn
    return deco


SCENARIOS: dict[str, object] = {}


def scenario(fn):
    """A shared expensive run (a worker, a search) several cases read; run once, on first use."""
    import threading

    lock = threading.Lock()
    box: dict = {}

    def get():
        with lock:
            if "v" not in box:
                try:
                    box["v"] = fn()
                except Exception as exc:
                    box["v"] = exc
        if isinstance(box["v"], Exception):
            raise box["v"]
        return box["v"]
    return get


# ---------------------------------------------------------------- setup

TINY = f"{WORK / 'entries' / 'base' / 'tiny'}.py:tiny_workload"  # written by setup()
WARM: dict = {}
QUEUE_DB = WORK / "queue-base.db"
SEARCH_ID = ""


def setup() -> None:
    global SEARCH_ID
    make_entry(WORK / "entries" / "base")
    r = af("estimate", TINY, *H100, "--json", timeout=240)
    if r.rc != 0 or breakdown(r) is None:
        sys.exit(f"setup: warm estimate failed ({r.rc}): {r.last()}")
    WARM["breakdown"] = breakdown(r)
    r = af("schedule", "add", TINY, *CPU_REQ, "--trials", "1", "--storage", f"sqlite:///{QUEUE_DB}",
           timeout=300)
    if r.rc != 0:
        sys.exit(f"setup: schedule add failed ({r.rc}): {r.last()}")
    SEARCH_ID = r.out.strip().splitlines()[-1].strip()


def queue_copy(name: str, entry: str) -> str:
    """A copy of the setup's queue with its one search's entry replaced by ``entry`` (what any submitter with
    write access to the queue can put there: ``schedule add`` takes any entry string); its sqlite URL."""
    db = WORK / f"queue-{name}.db"
    shutil.copy(QUEUE_DB, db)
    con = sqlite3.connect(db)
    rows = con.execute("select study_id, value_json from study_user_attributes where key='request'").fetchall()
    for study_id, value in rows:
        request = json.loads(json.loads(value)) if isinstance(json.loads(value), str) else json.loads(value)
        request["entry"] = entry
        con.execute("update study_user_attributes set value_json=? where study_id=? and key='request'",
                    (json.dumps(request), study_id))
    con.commit()
    con.close()
    return f"sqlite:///{db}"


def search_state(url: str) -> dict:
    r = af("schedule", "list", "--storage", url, "--json", timeout=60)
    doc = r.json()
    if not isinstance(doc, dict) or not doc.get("searches"):
        return {"state": f"? ({r.last()})", "message": None}
    return doc["searches"][0]


def worker(url: str, *extra: str, env: dict[str, str] | None = None, timeout: float = 45) -> Res:
    return af("worker", "--storage", url, "--hardware", "cpu", "--idle-exit", "1", *extra, env=env, timeout=timeout)


