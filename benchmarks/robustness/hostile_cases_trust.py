"""Hostile-input cases, classes A (code a worker was not allowed to run, shadowing) and B (a cache that lies)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from benchmarks.robustness.hostile_harness import (
    CACHE,
    H100,
    TINY,
    WARM,
    WORK,
    Res,
    af,
    base_env,
    breakdown,
    case,
    lib_json,
    make_entry,
    marker_code,
    marks,
    no_traceback,
    queue_copy,
    scenario,
    search_state,
    worker,
)

# ================================================================ A. code the worker was not allowed to run

def refusal(entry: str, roots: list[str], env_roots: str | None = None) -> object:
    code = f"""
        import json, os
        from autofit.schedule.checks import entry_refusal, entry_roots
        roots = entry_roots({roots!r}, environ={{'AUTOFIT_ENTRY_ROOTS': {env_roots or ''!r}}})
        print(json.dumps(entry_refusal({entry!r}, roots)))
    """
    return lib_json(code)


ROOTS_DIR = WORK / "allowed"


@case("A01-hub-trust-roots-flag", "allow-list", "hf:ORG/NAME?trust_remote_code=true refused under --entry-root")
def _():
    ROOTS_DIR.mkdir(exist_ok=True)
    got = refusal("hf:evil-org/model?seq_len=16&trust_remote_code=true", [str(ROOTS_DIR)])
    return got is not None, f"refusal={got!r}"


@case("A02-hub-trust-roots-env", "allow-list", "same via AUTOFIT_ENTRY_ROOTS: refused")
def _():
    ROOTS_DIR.mkdir(exist_ok=True)
    got = refusal("hf:evil-org/model?seq_len=16&trust_remote_code=true", [], env_roots=str(ROOTS_DIR))
    return got is not None, f"refusal={got!r}"


@case("A03-hub-plain-roots", "allow-list", "hf:ORG/NAME (no remote code) under roots: refused or explicitly allowed by a Hub allow-list")  # noqa: E501
def _():
    ROOTS_DIR.mkdir(exist_ok=True)
    got = refusal("hf:some-org/model?seq_len=16", [str(ROOTS_DIR)])
    return got is not None, f"refusal={got!r} (no way to name allowed Hub orgs)"


@case("A04-symlink-out-of-root", "allow-list", "a symlink inside the root to a file outside: refused (control)")
def _():
    root = WORK / "root-sym"
    root.mkdir(exist_ok=True)
    outside = Path(make_entry(WORK / "outside", "evil").rpartition(":")[0])
    link = root / "link.py"
    if not link.exists():
        link.symlink_to(outside)
    got = refusal(f"{link}:tiny_workload", [str(root)])
    return got is not None, f"refusal={got!r}"


@case("A05-hf-folder-out-of-root", "allow-list", "hf:/folder outside the roots: refused (control)")
def _():
    (WORK / "hfdir").mkdir(exist_ok=True)
    ROOTS_DIR.mkdir(exist_ok=True)
    got = refusal(f"hf:{WORK / 'hfdir'}?seq_len=16", [str(ROOTS_DIR)])
    return got is not None, f"refusal={got!r}"


@case("A06-dotdot-out-of-root", "allow-list", "ROOT/../x.py: refused (control)")
def _():
    ROOTS_DIR.mkdir(exist_ok=True)
    evil = make_entry(WORK, "dotdot").rpartition(":")[0]
    got = refusal(f"{ROOTS_DIR}/../{Path(evil).name}:tiny_workload", [str(ROOTS_DIR)])
    return got is not None, f"refusal={got!r}"


@scenario
def hub_worker():
    """A Hub name with remote code in the local HF cache, queued; a worker with --entry-root elsewhere."""
    mark = WORK / "hub-marker.jsonl"
    snap = WORK / "hf" / "hub" / "models--evil-org--tinyremote" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True, exist_ok=True)
    (WORK / "hf" / "hub" / "models--evil-org--tinyremote" / "refs").mkdir(exist_ok=True)
    (WORK / "hf" / "hub" / "models--evil-org--tinyremote" / "refs" / "main").write_text("a" * 40)
    (snap / "config.json").write_text(json.dumps({
        "model_type": "evilgpt", "architectures": ["EvilModel"], "n_layer": 2, "n_embd": 32, "n_head": 2,
        "vocab_size": 128, "n_positions": 64,
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}}))
    (snap / "configuration_evil.py").write_text(
        "import os, sys\n" + marker_code(mark, "hub remote code") + "\nfrom transformers import GPT2Config\n"
        "class EvilConfig(GPT2Config):\n    model_type = 'evilgpt'\n")
    (snap / "modeling_evil.py").write_text(
        "from transformers import GPT2LMHeadModel\nfrom .configuration_evil import EvilConfig\n"
        "class EvilModel(GPT2LMHeadModel):\n    config_class = EvilConfig\n")
    ROOTS_DIR.mkdir(exist_ok=True)
    url = queue_copy("hub", "hf:evil-org/tinyremote?seq_len=16&trust_remote_code=true")
    res = worker(url, "--entry-root", str(ROOTS_DIR), timeout=90)
    return res, marks(mark), search_state(url)


@case("A07-hub-worker-runs-remote-code", "allow-list",
      "worker --entry-root DIR does not run a queued hf:ORG/NAME's remote code")
def _():
    res, m, st = hub_worker()
    ran = [x for x in m if "worker" in x["argv"] or "worker" in " ".join(x["argv"])]
    return not m, f"remote code ran {len(m)}x (in worker: {bool(ran)}); state={st['state']}"


@case("A08-hub-worker-gives-back", "allow-list", "that search is given back (queued), not run/failed")
def _():
    res, m, st = hub_worker()
    return st["state"] == "queued", f"state={st['state']} msg={str(st.get('message'))[:90]}"


@scenario
def changed_entry_worker():
    """An entry inside the root, changed after queueing to run code at import; the worker gets
    AUTOFIT_STORAGE from its environment (as the docs' Kubernetes example does)."""
    mark = WORK / "changed-marker.jsonl"
    root = WORK / "root-changed"
    entry = make_entry(root, at_import=marker_code(mark, "import"))
    url = queue_copy("changed", entry)
    res = af("worker", "--hardware", "cpu", "--idle-exit", "1", "--entry-root", str(root),
             env=base_env(AUTOFIT_STORAGE=url), timeout=90)
    return res, marks(mark), search_state(url)


@case("A09-fingerprint-before-import", "allow-list",
      "an entry changed since queueing is refused before any of its code runs")
def _():
    res, m, st = changed_entry_worker()
    return not m, f"entry code ran {len(m)}x in the worker before the check; state={st['state']}"


@case("A10-changed-entry-fails-with-reason", "allow-list", "the search ends with the 'not the workload' reason (control)")
def _():
    res, m, st = changed_entry_worker()
    msg = str(st.get("message"))
    return st["state"] == "failed" and "not the workload" in msg, f"state={st['state']} msg={msg[:70]}"


def shadow_case(module: str, command: str = "estimate"):
    folder = WORK / f"shadow-{module}"
    mark = folder / "marker.jsonl"
    entry = make_entry(folder)
    (folder / f"{module}.py").write_text("import os, sys\n" + marker_code(mark, f"planted {module}.py") + "\n")
    r = af(command, entry, *H100, "--no-cache", timeout=120)
    m = marks(mark)
    return not m, f"planted {module}.py ran {len(m)}x; rc={r.rc} {r.last()[:60]}"


@case("A11-planted-rich", "shadowing", "a rich.py beside the entry does not run inside `autofit estimate`")
def _():
    return shadow_case("rich")


@case("A12-planted-deepspeed", "shadowing", "a deepspeed.py beside the entry does not run inside `autofit estimate`")
def _():
    return shadow_case("deepspeed")


@case("A13-planted-sympy", "shadowing", "a sympy.py beside the entry does not run inside `autofit estimate`")
def _():
    return shadow_case("sympy")


@case("A14-two-entries-common", "shadowing", "two entries that each `import common` get their own common (one process)")
def _():
    for name in ("one", "two"):
        d = WORK / f"common-{name}"
        make_entry(d, at_import="import common")
        (d / "common.py").write_text(f"WHO = {name!r}\n")
    code = f"""
        import json, sys
        from autofit.workload.entry import load_workload
        load_workload({str(WORK / 'common-one' / 'tiny.py') + ':tiny_workload'!r})
        load_workload({str(WORK / 'common-two' / 'tiny.py') + ':tiny_workload'!r})
        w1 = load_workload({str(WORK / 'common-one' / 'tiny.py') + ':tiny_workload'!r})
        w2 = load_workload({str(WORK / 'common-two' / 'tiny.py') + ':tiny_workload'!r})
        print(json.dumps([sys.modules[w.model.__module__].common.WHO for w in (w1, w2)]))
    """
    got = lib_json(code)
    return got == ["one", "two"], f"the entries' common.WHO={got!r}"


@case("A15-syspath-restored", "shadowing", "loading an entry leaves sys.path as it was")
def _():
    code = f"""
        import json, sys
        before = list(sys.path)
        from autofit.workload.entry import load_workload
        before = list(sys.path)
        load_workload({TINY!r})
        print(json.dumps([p for p in sys.path if p not in before]))
    """
    got = lib_json(code)
    return got == [], f"added to sys.path: {got}"


@case("A16-same-stem-entries", "shadowing", "entries a/tiny.py and b/tiny.py loaded in one process stay distinct")
def _():
    a = make_entry(WORK / "stem-a", at_import="WHO = 'a'")
    b = make_entry(WORK / "stem-b", at_import="WHO = 'b'")
    code = f"""
        import json, sys
        from autofit.workload.entry import load_workload
        wa = load_workload({a!r}); wb = load_workload({b!r})
        print(json.dumps([sys.modules[wa.model.__module__].WHO, sys.modules[wb.model.__module__].WHO]))
    """
    got = lib_json(code)
    return got == ["a", "b"], f"modules' WHO={got!r}"


# ================================================================ B. a cache that lies

def cache_copy(name: str, mutate, mode: int = 0o700, owner: str | None = None) -> Path:
    """A copy of the warm cache with every facts entry mutated by ``mutate(facts)``."""
    root = WORK / f"cache-{name}"
    shutil.copytree(CACHE, root)
    for f in (root / "traces").glob("*.json"):
        doc = json.loads(f.read_text())
        if "facts" in doc:
            mutate(doc["facts"])
            f.write_text(json.dumps(doc))
    import pwd
    uid = gid = None
    if owner:
        record = pwd.getpwnam(owner)
        uid, gid = record.pw_uid, record.pw_gid
    for d in (root, root / "traces"):
        os.chmod(d, mode)
        if owner:
            os.chown(d, uid, gid)
    if owner:
        for f in (root / "traces").glob("*.json"):
            os.chown(f, uid, gid)
    return root


def forge_fits(facts: dict) -> None:
    for p in facts["profiles"].values():
        for point in p["points"]:
            for k in ("peak_with_grads_bytes", "peak_without_grads_bytes", "activation_bytes"):
                point[k] = 0


def est_with_cache(root: Path) -> Res:
    return af("estimate", TINY, *H100, "--json", env=base_env(AUTOFIT_CACHE_DIR=str(root)), timeout=120)


def trusted(res: Res) -> tuple[bool, str]:
    """Whether the forged entry was believed: activations 0 in the plan."""
    b = breakdown(res)
    return (b is not None and b["activations"] == 0), f"rc={res.rc} activations={b and b['activations']} {res.last()[:70]}"


@case("B01-forged-other-owner", "cache", "a cache dir owned by another user (0777) is not trusted (forged plan refused)")
def _():
    believed, got = trusted(est_with_cache(cache_copy("other-owner", forge_fits, 0o777, "nobody")))
    return not believed, got


@case("B02-forged-world-writable", "cache", "a world-writable cache dir is refused or warned about, not trusted")
def _():
    r = est_with_cache(cache_copy("world", forge_fits, 0o777))
    believed, got = trusted(r)
    warned = "cache" in r.err.lower() and ("writable" in r.err.lower() or "permission" in r.err.lower())
    return (not believed) or warned, got + (" (warned)" if warned else " (no warning)")


@case("B03-forged-group-writable", "cache", "a group-writable cache dir is refused or warned about")
def _():
    r = est_with_cache(cache_copy("group", forge_fits, 0o770))
    believed, got = trusted(r)
    warned = "cache" in r.err.lower() and "writable" in r.err.lower()
    return (not believed) or warned, got


@case("B04-cache-dir-private", "cache", "a cache dir autofit creates is private (no group/other bits)")
def _():
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (CACHE, CACHE / "traces")}
    ok = all(not (stat.S_IMODE(p.stat().st_mode) & 0o077) for p in (CACHE, CACHE / "traces"))
    return ok, f"modes {modes} (umask {oct(os.umask(os.umask(0o022)))})"


@case("B05-cache-entry-private", "cache", "cache entry files are 0600 (control)")
def _():
    modes = {oct(stat.S_IMODE(f.stat().st_mode)) for f in (CACHE / "traces").glob("*.json")}
    return modes <= {"0o600"}, f"modes {sorted(modes)}"


def garbled(name: str, mutate) -> tuple[bool, str]:
    """A private cache whose entries are garbled: retraced (exit 0, real numbers) or an error naming the cache."""
    r = est_with_cache(cache_copy(name, mutate))
    b = breakdown(r)
    retraced = r.rc == 0 and b == WARM["breakdown"]
    named = r.rc not in (0, None) and "cache" in r.err.lower() and no_traceback(r)
    return retraced or named, f"rc={r.rc} breakdown={b and {k: b[k] for k in ('params', 'activations')}} {r.last()[:70]}"


def _set_all(key, value):
    def mutate(facts):
        facts[key] = value
    return mutate


def _set_points(key, value):
    def mutate(facts):
        for p in facts["profiles"].values():
            for point in p["points"]:
                point[key] = value
    return mutate


@case("B06-garbled-zero-hidden", "cache", "hidden_size=0 in an entry: retraced or one line naming the cache")
def _():
    return garbled("hidden0", _set_all("hidden_size", 0))


@case("B07-garbled-zero-layers", "cache", "n_layers=0: retraced or one line naming the cache")
def _():
    return garbled("layers0", _set_all("n_layers", 0))


@case("B08-garbled-string", "cache", "n_params='lots': retraced or one line naming the cache")
def _():
    return garbled("string", _set_all("n_params", "lots"))


@case("B09-garbled-nan", "cache", "peak_without_grads_bytes=NaN: retraced or one line naming the cache")
def _():
    return garbled("nan", _set_points("peak_without_grads_bytes", float("nan")))


@case("B10-garbled-negative", "cache", "peak_without_grads_bytes=-10**12: retraced or one line naming the cache")
def _():
    return garbled("negative", _set_points("peak_without_grads_bytes", -10**12))


@case("B11-garbled-zero-flops", "cache", "flops=0 everywhere: retraced or one line naming the cache")
def _():
    return garbled("flops0", _set_points("flops", 0))


@case("B12-garbled-negative-params", "cache", "n_params=-1: retraced or one line naming the cache")
def _():
    return garbled("params-neg", _set_all("n_params", -1))


@case("B13-garbled-list-profiles", "cache", "profiles=[] (wrong type): retraced (control-ish)")
def _():
    return garbled("profiles-list", _set_all("profiles", []))


@case("B14-unknown-key", "cache", "an unknown extra key: retraced (control)")
def _():
    return garbled("extra", _set_all("surprise", 1))


@case("B15-truncated-entry", "cache", "a truncated entry: retraced (control)")
def _():
    root = cache_copy("trunc", lambda f: None)
    for f in (root / "traces").glob("*.json"):
        f.write_text(f.read_text()[:50])
    r = est_with_cache(root)
    b = breakdown(r)
    return r.rc == 0 and b is not None and b["activations"] > 0, f"rc={r.rc} {r.last()[:60]}"


@case("D14-storage-env-in-user-code", "secrets", "queued model code cannot read AUTOFIT_STORAGE (worker started with it in its env)")  # noqa: E501
def _():
    res, m, st = changed_entry_worker()
    seen = [x["storage"] for x in m if x.get("storage")]
    return not seen, f"entry saw AUTOFIT_STORAGE={seen[:1]}"
