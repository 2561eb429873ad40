"""Hostile-input cases, classes C (silent success, stalls), D (secrets), E (values never written) and F (files, stdout)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

from benchmarks.robustness.hostile_harness import (
    CPU_RUN,
    H100,
    LAUNCH,
    PY,
    SECRET,
    TINY,
    WORK,
    Res,
    af,
    base_env,
    case,
    lib_json,
    make_entry,
    no_traceback,
    one_line_error,
    queue_copy,
    scenario,
    search_state,
    worker,
)

# ================================================================ C. silent success, endless stalls

def est_entry(name: str, timeout: float = 120, env: dict[str, str] | None = None, **hooks: str) -> Res:
    entry = make_entry(WORK / f"entry-{name}", **hooks)
    return af("estimate", entry, *H100, "--no-cache", env=env, timeout=timeout)


def run_dir(name: str) -> tuple[Path, list[str]]:
    """A folder of its own for one `autofit run` (its default sqlite:///autofit.db would be shared)."""
    d = WORK / f"run-{name}"
    d.mkdir(exist_ok=True)
    return d, ["--storage", f"sqlite:///{d / 'autofit.db'}"]


def fmt(r: Res) -> str:
    tb = "" if no_traceback(r) else " +traceback"
    return f"rc={'timeout' if r.timed_out else r.rc}{tb} err={r.last()[:80]!r}"


@case("C01-exit0-in-function", "exit", "entry function sys.exit(0): one error line, exit != 0")
def _():
    r = est_entry("exit0", at_call="sys.exit(0)")
    return one_line_error(r), fmt(r)


@case("C02-exit0-at-import", "exit", "sys.exit(0) at import: one error line, exit != 0")
def _():
    r = est_entry("exit0imp", at_import="sys.exit(0)")
    return one_line_error(r), fmt(r)


@case("C03-exit3-in-function", "exit", "sys.exit(3): one autofit error line, exit 1")
def _():
    r = est_entry("exit3", at_call="sys.exit(3)")
    return one_line_error(r) and r.rc == 1, fmt(r)


@case("C04-argparse-at-import", "exit",
      "argparse.parse_args() at import reads the entry's own argv (none), not autofit's: no usage spew, estimate runs")
def _():
    r = est_entry("argparse", at_import="import argparse; p = argparse.ArgumentParser(); p.add_argument('--lr'); p.parse_args()")
    return r.rc == 0 and "usage:" not in r.err and no_traceback(r), fmt(r)


@case("C05-baseexception", "exit", "a BaseException subclass from the entry: one line, no traceback")
def _():
    r = est_entry("baseexc", at_call="raise type('Boom', (BaseException,), {})('boom')")
    return one_line_error(r), fmt(r)


@case("C06-baseexception-in-forward", "exit", "a BaseException raised while tracing forward: one line")
def _():
    r = est_entry("baseexc-fwd", in_forward="raise type('Boom', (BaseException,), {})('boom')")
    return one_line_error(r), fmt(r)


@case("C07-os-exit", "exit", "os._exit(0) at import: exit != 0 (the entry is loaded in a forked child first)")
def _():
    r = est_entry("osexit", at_import="os._exit(0)")
    return r.rc not in (0, None), fmt(r)


@case("C08-exception-control", "exit", "a plain exception from the entry: one line, exit 1 (control)")
def _():
    r = est_entry("valueerror", at_call="raise ValueError('nope')")
    return one_line_error(r) and r.rc == 1, fmt(r)


@case("C09-run-exit0-out", "exit", "`autofit run --out X` with a sys.exit(0) entry: exit != 0")
def _():
    entry = make_entry(WORK / "entry-runexit", at_call="sys.exit(0)")
    out = WORK / "runexit.json"
    d, st = run_dir("exit0")
    r = af("run", entry, *CPU_RUN, *st, "--no-cache", "--out", str(out), timeout=120, cwd=d)
    return r.rc not in (0, None), f"{fmt(r)} out exists={out.exists()}"


@case("C10-estimate-hang-limit", "stall", "an entry that never returns: estimate ends with an error (AUTOFIT_LOAD_TIMEOUT_S=3) within 30 s")  # noqa: E501
def _():
    r = est_entry("hang", at_call="import time; time.sleep(10**6)", timeout=30,
                  env=base_env(AUTOFIT_LOAD_TIMEOUT_S="3"))
    return r.rc not in (0, None), fmt(r)


def worker_with(name: str, timeout: float = 60, env: dict | None = None, **hooks: str):
    root = WORK / f"root-{name}"
    entry = make_entry(root, **hooks)
    url = queue_copy(name, entry)
    res = worker(url, "--entry-root", str(root), env=env, timeout=timeout)
    return res, search_state(url)


@case("C11-worker-exit0", "stall", "a queued entry calling sys.exit(0): the search ends failed with the reason")
def _():
    res, st = worker_with("w-exit0", at_call="sys.exit(0)")
    return st["state"] == "failed", f"worker rc={res.rc}; state={st['state']} msg={str(st.get('message'))[:60]}"


@case("C12-worker-argparse", "stall", "a queued model file calling parse_args() at import: search failed with the reason")
def _():
    res, st = worker_with("w-argparse", at_import="import argparse; argparse.ArgumentParser().parse_args()")
    return st["state"] == "failed", f"worker rc={res.rc}; state={st['state']} msg={str(st.get('message'))[:60]}"


@case("C13-worker-baseexc", "stall", "a queued entry raising a BaseException subclass: search failed, worker alive")
def _():
    res, st = worker_with("w-baseexc", at_call="raise type('Boom', (BaseException,), {})('boom')")
    return st["state"] == "failed", f"worker rc={res.rc}; state={st['state']}"


@case("C14-worker-hang", "stall", "a queued entry that never returns: search given back/failed with the reason (AUTOFIT_LOAD_TIMEOUT_S=5), not `running` with a live lease")  # noqa: E501
def _():
    root = WORK / "root-w-hang"
    entry = make_entry(root, at_call="import time; time.sleep(10**6)")
    url = queue_copy("w-hang", entry)
    proc = subprocess.Popen([PY, "-c", LAUNCH, "worker", "--storage", url, "--hardware", "cpu", "--idle-exit", "1",
                             "--lease", "3", "--entry-root", str(root)], env=base_env(AUTOFIT_LOAD_TIMEOUT_S="5"),
                            cwd=WORK, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(25)
    st = search_state(url)
    alive = proc.poll() is None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the worker already exited (idle after the search ended)
        pass
    proc.wait()
    return st["state"] != "running", f"after 25 s: state={st['state']} worker alive={alive}"


def _building_in(folder: Path) -> list[int]:
    """Live processes working under ``folder`` (a build's ninja and compilers work in its build directory)."""
    alive = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and Path(os.readlink(entry / "cwd")).is_relative_to(folder)
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                alive.append(int(entry.name))
        except OSError:
            continue
    return alive


@case("C15-op-build-killed", "stall", "a worker killed (SIGKILL) while DeepSpeed builds an op: no ninja or compiler left running within 15 s")  # noqa: E501
def _():
    ext = WORK / "ext-killed"
    ext.mkdir(exist_ok=True)
    code = "from autofit.probe.ops import load_ops; load_ops(('cpu_adam',), 'cpu', 600)"
    proc = subprocess.Popen([PY, "-c", code], env=base_env(TORCH_EXTENSIONS_DIR=str(ext)), cwd=WORK,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(_building_in(ext)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    started = len(_building_in(ext))
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while _building_in(ext) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _building_in(ext)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return started >= 2 and not left, f"building before the kill: {started} processes; after: {len(left)}"


# ================================================================ D. secrets

def leaked(res: Res, *secrets: str) -> list[str]:
    return [s for s in secrets if s in res.out or s in res.err]


PG_DOWN = "127.0.0.1:9"  # nothing listens: connection refused


@case("D01-query-password-list", "secrets", "`?password=` in --storage never printed (schedule list)")
def _():
    r = af("schedule", "list", "--storage", f"postgresql://alice@{PG_DOWN}/db?password={SECRET}", timeout=60)
    bad = leaked(r, SECRET)
    return not bad, f"rc={r.rc} leaked={bad} err={r.last()[:90]!r}"


@case("D02-at-in-password", "secrets", "a password containing @ never printed, not even its tail")
def _():
    r = af("schedule", "list", "--storage", f"postgresql://alice:p@{SECRET}@{PG_DOWN}/db", timeout=60)
    bad = leaked(r, SECRET, f"p@{SECRET}")
    return not bad, f"rc={r.rc} leaked={bad} err={r.last()[:90]!r}"


@case("D03-query-password-worker", "secrets", "`?password=` never printed by `autofit worker`")
def _():
    r = af("worker", "--storage", f"postgresql://alice@{PG_DOWN}/db?password={SECRET}", "--hardware", "cpu",
           "--idle-exit", "0", timeout=60)
    bad = leaked(r, SECRET)
    return not bad, f"rc={r.rc} leaked={bad} err={r.last()[:90]!r}"


@case("D04-query-password-add", "secrets", "`?password=` never printed by `autofit schedule add`")
def _():
    r = af("schedule", "add", TINY, *H100, "--storage", f"postgresql://alice@{PG_DOWN}/db?password={SECRET}",
           timeout=90)
    bad = leaked(r, SECRET)
    return not bad, f"rc={r.rc} leaked={bad} err={r.last()[:90]!r}"


@case("D05-sslpassword", "secrets", "`?sslpassword=` (libpq's key passphrase) never printed")
def _():
    r = af("schedule", "list", "--storage", f"postgresql://alice@{PG_DOWN}/db?sslpassword={SECRET}", timeout=60)
    bad = leaked(r, SECRET)
    return not bad, f"rc={r.rc} leaked={bad} err={r.last()[:90]!r}"


@case("D06-colon-in-password", "secrets", "a password containing ':' and '/' never printed")
def _():
    r = af("schedule", "list", "--storage", f"postgresql://alice:a:b/{SECRET}@{PG_DOWN}/db", timeout=60)
    bad = leaked(r, SECRET)
    return not bad, f"rc={r.rc} leaked={bad} err={r.last()[:90]!r}"


@case("D07-userinfo-password-control", "secrets", "a plain user:password@ never printed (control)")
def _():
    r = af("schedule", "list", "--storage", f"postgresql://alice:{SECRET}@{PG_DOWN}/db", timeout=60)
    bad = leaked(r, SECRET)
    return not bad, f"rc={r.rc} leaked={bad} err={r.last()[:90]!r}"


SCRUB_FORMS = {
    "D08-scrub-query": f"postgresql://u@h/db?password={SECRET}",
    "D09-scrub-at": f"postgresql://u:x@{SECRET}@h/db",
    "D10-scrub-multihost": f"postgresql://u:{SECRET}@h1:5432,h2:5432/db",
    "D11-scrub-encoded-at": f"postgresql://u:x%40{SECRET}@h/db",
    "D12-scrub-driver": f"postgresql+psycopg2://u@h/db?sslpassword={SECRET}",
    "D13-scrub-upper-query": f"postgresql://u@h/db?PASSWORD={SECRET}",
}
for _cid, _url in SCRUB_FORMS.items():
    def _make(url=_url):
        def fn():
            code = f"""
                import json
                from autofit.core.storage_url import scrub, redact_url
                url = {url!r}
                text = 'could not connect to ' + url + ' (' + url.split('://', 1)[1] + ')'
                print(json.dumps([redact_url(url), scrub(text, url)]))
            """
            shown = lib_json(code)
            return SECRET not in json.dumps(shown), f"redact_url -> {shown[0][:70]!r}"
        return fn
    case(_cid, "secrets", f"redact_url/scrub hide the secret in {_url.split('://')[0]}://…{_url[-28:]}")(_make())


@case("D15-probe-env-scrubbed", "secrets", "a probe's environment drops AUTOFIT_STORAGE / PGPASSWORD")
def _():
    code = """
        import json
        from autofit.probe.launch import training_env
        env = training_env({'AUTOFIT_STORAGE': 'postgresql://u:pw@h/db', 'PGPASSWORD': 'pw', 'PATH': '/bin'}, 'cpu', 1, 1)
        print(json.dumps(sorted(k for k in env if k in ('AUTOFIT_STORAGE', 'PGPASSWORD'))))
    """
    got = lib_json(code)
    return got == [], f"kept {got}"


# ================================================================ E. values that should never be written

def est(*extra: str, env: dict | None = None, timeout: float = 90, entry: str | None = None) -> Res:
    return af("estimate", entry or TINY, *H100, *extra, "--json", env=env, timeout=timeout)


def rejected(r: Res, word: str | None = None) -> tuple[bool, str]:
    ok = one_line_error(r) and (word is None or word.lower() in r.err.lower())
    text = r.out if r.rc == 0 else ""
    bad = [t for t in ("NaN", "Infinity") if t in text]
    return ok, f"rc={'timeout' if r.timed_out else r.rc} {('JSON has ' + ','.join(bad)) if bad else ''} {r.last()[:70]!r}"


for _cid, _args, _word in [
    ("E01-lr-nan", ["--lr", "nan"], "lr"),
    ("E02-lr-inf", ["--lr", "inf"], "lr"),
    ("E03-lr-1e309", ["--lr", "1e309"], "lr"),
    ("E04-eps-nan", ["--eps", "nan"], "eps"),
    ("E05-weight-decay-inf", ["--weight-decay", "inf"], "weight_decay"),
    ("E06-momentum-nan", ["--optimizer", "sgd", "--momentum", "nan"], "momentum"),
    ("E07-betas-nan-control", ["--betas", "0.9,nan"], "betas"),
    ("E08-lr-negative-control", ["--lr", "-1"], "lr"),
    ("E09-memory-1e30GiB", ["--memory", "1e30GiB"], "memory"),
    ("E10-memory-overflow", ["--memory", "1" + "0" * 400 + "GiB"], "memory"),
    ("E11-memory-zero-control", ["--memory", "0GiB"], "memory"),
    ("E12-global-batch-1e24", ["--global-batch", str(10**24)], "batch"),
    ("E13-gpus-1e6", ["--gpus", str(10**6), "--global-batch", str(4 * 10**6)], "gpus"),
    ("E14-nodes-1e7", ["--nodes", str(10**7), "--global-batch", str(4 * 10**7)], "nodes"),
    ("E15-set-twice-differs", ["--set", "precision=bf16", "--set", "precision=fp32"], "precision"),
    ("E16-set-ratio-nan", ["--set", "checkpoint_ratio=nan"], "checkpoint_ratio"),
    ("E17-set-ratio-inf", ["--set", "checkpoint_ratio=inf"], "checkpoint_ratio"),
    ("E18-set-mbs-1e24", ["--set", f"micro_batch_size={10**24}"], "micro_batch"),
]:
    def _make(args=_args, word=_word):
        return lambda: rejected(est(*args, timeout=60), word)
    case(_cid, "values", f"estimate {' '.join(a if len(a) < 20 else a[:8] + '…' for a in _args)}: one line naming {_word}, exit 1")(_make())  # noqa: E501


@case("E19-set-twice-same-control", "values", "--set zero_stage=0 twice (same value): accepted (control)")
def _():
    r = est("--set", "zero_stage=0")
    return r.rc == 0, f"rc={r.rc} {r.last()[:60]!r}"


def recipe_file(name: str, text: str) -> str:
    p = WORK / f"recipe-{name}.json"
    p.write_text(text)
    return str(p)


@case("E20-recipe-from-lr-nan", "values", "--recipe-from a DeepSpeed JSON with lr NaN: rejected")
def _():
    f = recipe_file("nan", '{"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": NaN}}}')
    return rejected(est("--recipe-from", f), "lr")


@case("E21-recipe-from-lr-inf", "values", "--recipe-from with lr Infinity: rejected")
def _():
    f = recipe_file("inf", '{"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": Infinity}}}')
    return rejected(est("--recipe-from", f), "lr")


@case("E22-recipe-from-wd-inf", "values", "--recipe-from with weight_decay Infinity: rejected")
def _():
    f = recipe_file("wd", '{"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": Infinity}}}')  # noqa: E501
    return rejected(est("--recipe-from", f), "weight_decay")


@case("E23-trace-workers-huge", "values", "AUTOFIT_TRACE_WORKERS=1000000: one line (bounded), exit 1")
def _():
    return rejected(est(env=base_env(AUTOFIT_TRACE_WORKERS="1000000")), "AUTOFIT_TRACE_WORKERS")


@case("E24-trace-workers-zero-control", "values", "AUTOFIT_TRACE_WORKERS=0: one line, exit 1 (control)")
def _():
    return rejected(est(env=base_env(AUTOFIT_TRACE_WORKERS="0")), "AUTOFIT_TRACE_WORKERS")


@case("E25-space-1e8", "values", "a space of 10^8 candidates: one line saying so within 20 s (not a silent hang)")
def _():
    n = 10**4
    space = WORK / "huge-space.yaml"
    space.write_text(
        "global_batch_size: 16\n"
        f"micro_batch_size: [{', '.join(str(i) for i in range(1, 17))}]\n"
        f"checkpoint_ratio: [{', '.join(f'{i / n:.6f}' for i in range(n))}]\n"
        "checkpoint_granularity: [block, attention]\nprecision: [fp32, bf16]\noptimizer: [adamw]\n"
        "zero_stage: [0, 1, 2, 3]\noffload_optimizer: [none, cpu]\noffload_params: [none, cpu]\n"
        "attention: [sdpa, eager]\ncompile: ['off', 'on']\noverlap_comm: [false, true]\n"
        "contiguous_gradients: [true, false]\nbucket_scale: [1, 2, 4, 8]\n")
    r = af("estimate", TINY, "--hardware", "h100-80gb", "--space", str(space), "--json", timeout=20)
    return one_line_error(r), fmt(r) + f" after {r.secs:.0f} s"


def results_with(*args: str) -> Res:
    return af("results", "--storage", f"sqlite:///{WORK / 'results.db'}", *args, timeout=60)


@case("E26-price-inf", "values", "results --price cpu=inf: one line, exit 1")
def _():
    return rejected(results_with("--price", "cpu=inf"), "price")


@case("E27-price-1e999", "values", "results --price cpu=1e999: one line, exit 1")
def _():
    return rejected(results_with("--price", "cpu=1e999"), "price")


@case("E28-price-nan-control", "values", "results --price cpu=nan: one line, exit 1 (control)")
def _():
    return rejected(results_with("--price", "cpu=nan"), "price")


@case("E29-worker-lease-nan", "values", "worker --lease nan: refused (exit != 0) at once")
def _():
    r = af("worker", "--storage", f"sqlite:///{WORK / 'w-nan.db'}", "--hardware", "cpu", "--lease", "nan",
           "--idle-exit", "0", timeout=30)
    return r.rc not in (0, None), fmt(r)


@case("E30-worker-idle-nan", "values", "worker --idle-exit nan: refused at once (else it never exits)")
def _():
    r = af("worker", "--storage", f"sqlite:///{WORK / 'w-idle.db'}", "--hardware", "cpu", "--idle-exit", "nan",
           timeout=20)
    return r.rc not in (0, None), fmt(r)


@case("E31-run-margin-nan", "values", "run --margin nan: refused before any planning (within 10 s)")
def _():
    r = af("run", TINY, *H100, "--margin", "nan", "--trials", "1", "--out", str(WORK / "margin.json"), timeout=10)
    return r.rc not in (0, None), fmt(r)


@case("E32-run-timeout-nan", "values", "run --timeout nan: refused before any planning (within 10 s)")
def _():
    r = af("run", TINY, *H100, "--timeout", "nan", "--trials", "1", "--out", str(WORK / "tnan.json"), timeout=10)
    return r.rc not in (0, None), fmt(r)


@case("E33-probe-timeout-neg", "values", "probe --timeout -1: refused before any planning (within 10 s)")
def _():
    r = af("probe", TINY, *H100, "--timeout", "-1", timeout=10)
    return r.rc not in (0, None) and not r.timed_out, fmt(r)


# ================================================================ F. files and stdout

@scenario
def good_run():
    """One successful search: DS_ACCELERATOR unset, --json, --out over an existing 0644 file."""
    out = WORK / "good" / "ds.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text("{}")
    os.chmod(out, 0o644)
    r = af("run", TINY, *CPU_RUN, "--out", str(out), "--json", env=base_env(DS_ACCELERATOR=None),
           timeout=240, cwd=out.parent)  # default storage: sqlite:///autofit.db in its own folder
    return r, out


@case("F01-run-json-stdout", "stdout", "`run --json` (DS_ACCELERATOR unset): stdout is one JSON document")
def _():
    r, out = good_run()
    return r.rc == 0 and r.json() is not None, f"rc={r.rc} stdout starts {r.out[:70]!r}"


@case("F02-out-mode-kept", "files", "an existing --out of mode 0644 keeps 0644 (umask honoured)")
def _():
    r, out = good_run()
    mode = oct(stat.S_IMODE(out.stat().st_mode)) if out.exists() else None
    return r.rc == 0 and mode == "0o644", f"rc={r.rc} mode={mode}"


@case("F03-out-is-dir", "files", "--out DIR: one line naming DIR before the search (< 15 s), no temp-file name")
def _():
    d = WORK / "outdir"
    d.mkdir(exist_ok=True)
    w, st = run_dir("outdir")
    r = af("run", TINY, *CPU_RUN, *st, "--out", str(d), timeout=240, cwd=w)
    ok = one_line_error(r) and ".tmp" not in r.err and r.secs < 15
    return ok, f"{fmt(r)} after {r.secs:.0f} s"


@case("F04-report-over-user-index", "files", "--report into a folder with the user's index.html: refused before the search, file untouched")  # noqa: E501
def _():
    d = WORK / "userreport"
    d.mkdir(exist_ok=True)
    (d / "index.html").write_text("<p>mine</p>")
    w, st = run_dir("userreport")
    r = af("run", TINY, *CPU_RUN, *st, "--out", str(WORK / "rep.json"), "--report", str(d), timeout=240, cwd=w)
    kept = (d / "index.html").read_text() == "<p>mine</p>"
    return kept and r.rc != 0 and r.secs < 15, f"rc={r.rc} index.html kept={kept} after {r.secs:.0f} s {r.last()[:50]!r}"


@case("F05-report-fails-after-out", "files", "--report that cannot be written: no --out left behind (all-or-nothing)")
def _():
    blocker = WORK / "blocker"
    blocker.write_text("a file, not a folder")
    out = WORK / "half.json"
    w, st = run_dir("half")
    r = af("run", TINY, *CPU_RUN, *st, "--out", str(out), "--report", str(blocker / "rep"), timeout=240, cwd=w)
    return r.rc != 0 and not out.exists(), f"rc={r.rc} --out exists={out.exists()} after {r.secs:.0f} s {r.last()[:50]!r}"


@case("F06-out-fifo", "files", "--out naming a FIFO/device: refused, the node not replaced by a file")
def _():
    fifo = WORK / "out.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    w, st = run_dir("fifo")
    r = af("run", TINY, *CPU_RUN, *st, "--out", str(fifo), timeout=240, cwd=w)
    still = stat.S_ISFIFO(fifo.lstat().st_mode)
    return r.rc != 0 and still, f"rc={r.rc} still a FIFO={still} after {r.secs:.0f} s"


def json_stdout(name: str, **hooks: str) -> tuple[bool, str]:
    entry = make_entry(WORK / f"entry-{name}", **hooks)
    r = af("estimate", entry, *H100, "--no-cache", "--json", timeout=120)
    return r.json() is not None, f"rc={r.rc} stdout starts {r.out[:50]!r}"


@case("F07-print-at-import", "stdout", "entry print() at import: `estimate --json` stdout is still one JSON document")
def _():
    return json_stdout("print-import", at_import="print('hello from the model file')")


@case("F08-print-in-forward", "stdout", "print() in forward (while tracing): stdout still JSON")
def _():
    return json_stdout("print-fwd", in_forward="print('forward!')")


@case("F09-oswrite-fd1", "stdout", "os.write(1, …) in the entry: stdout still JSON")
def _():
    return json_stdout("oswrite", at_call="os.write(1, b'raw fd 1\\n')")


@case("F10-estimate-no-ds-accelerator", "stdout", "`estimate --json` with DS_ACCELERATOR unset: stdout JSON")
def _():
    r = af("estimate", TINY, *H100, "--no-cache", "--json", env=base_env(DS_ACCELERATOR=None), timeout=120)
    return r.json() is not None, f"rc={r.rc} stdout starts {r.out[:60]!r}"


