"""How long ``autofit estimate`` takes to answer, as a user sees it: a subprocess timed on the wall clock, imports
included, cold (an empty trace cache) and warm (the same model traced before: :mod:`autofit.trace.cache`).

    python -m benchmarks.speed.planning_speed [--repeats 3] [--plans 7b,70b,405b] [--label after] [--software here]
                                        [--pythonpath DIR] [--baseline DIR --baseline-label before]
                                        [--out benchmarks/results/planning_speed.json]

Plans: LLaMA-7B on 8 x H100 (``examples/llama_7b.py:workload --gpus 8 --global-batch 64``), LLaMA-2-70B on 64
H100s (``examples/llama2.py:llama2_70b --gpus 8 --nodes 8 --global-batch 1024``) and Llama-3.1-405B on 128 H100s
(``hf:examples/hf_configs/llama3_1_405b --seq-len 8192 --gpus 8 --nodes 16 --global-batch 1024``; not by
default). Each checkout is compiled to bytecode first, as an installed one is (:func:`compiled`). Each cold run gets a
new empty ``AUTOFIT_CACHE_DIR``; the warm runs reuse the last cold run's. Reported:
the median of ``--repeats`` runs, each run's time, the machine's load average when the run started (a shared
machine's timings are only comparable with its load), and whether every run printed the same ``--json`` document (a
warm answer is the cold one).

``--pythonpath``: the ``autofit`` checkout the subprocesses import (default: this one), e.g. a worktree of an
earlier commit for a before/after comparison (``--label before``; a checkout without the cache runs warm as
cold: ``--cold-only``). ``--baseline DIR``: that checkout measured too, run for run interleaved with this one (its
cold run after this one's, and the warm runs alike), kept under ``--baseline-label``, and whether both printed the
same document (``same_output_as_baseline``): on a shared machine both see the same load. Results are kept by label
in ``--out`` (a label measured again replaces its rows) with the commit, host and date.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PLANS = {
    "7b": ["examples/llama_7b.py:workload", "--hardware", "h100-80gb", "--gpus", "8", "--global-batch", "64"],
    "70b": ["examples/llama2.py:llama2_70b", "--hardware", "h100-80gb", "--gpus", "8", "--nodes", "8",
            "--global-batch", "1024"],
    # Llama-3.1-405B's config (a causal LM: the long-context keys are searched too); by absolute path, so that a
    # --pythonpath/--baseline checkout without the folder plans it as well
    "405b": [f"hf:{ROOT / 'examples' / 'hf_configs' / 'llama3_1_405b'}", "--seq-len", "8192", "--hardware", "h100-80gb",
             "--gpus", "8", "--nodes", "16", "--global-batch", "1024"],
}


def timed_estimate(plan: str, checkout: Path, cache_dir: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One ``autofit estimate --json`` of ``plan`` in a fresh process: its wall time, output's digest and winner."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "AUTOFIT_CACHE_DIR": str(cache_dir), "DS_ACCELERATOR": "cpu"}
    env.pop("AUTOFIT_NO_CACHE", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the bytecode :func:`compiled` wrote is read, as an install's is
    command = [sys.executable, "-c", "from autofit.cli import main; main()", "estimate", *PLANS[plan], *extra, "--json"]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{plan}: autofit estimate failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    document = json.loads(done.stdout)
    # the document's digest, not its text's: a checkout that lays the same document out otherwise writes the same
    canonical = json.dumps(document, sort_keys=True).encode()
    return {"wall_s": round(wall, 2), "load_1min": round(load, 2),
            "output_sha256": hashlib.sha256(canonical).hexdigest(), **winner_of(document)}


def winner_of(document: dict[str, Any]) -> dict[str, Any]:
    """The fastest candidate predicted to fit (its config), the candidates' count and the software assumed."""
    fitting = [c for c in document["candidates"] if c["fits"]]
    best = fitting[0] if fitting else None
    return {"winner": best["config"] if best else None,
            "winner_samples_per_s": best["predicted"]["samples_per_s"] if best else None,
            "n_candidates": len(document["candidates"]), "n_fitting": len(fitting),
            "software": (document.get("software") or {}).get("source")}


def measure(plan: str, checkout: Path, repeats: int, scratch: Path, warm_too: bool = True,
            extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """``repeats`` cold runs (each with an empty cache), then ``repeats`` warm ones (the last cold run's cache;
    none where not ``warm_too``); ``extra``: more options of ``autofit estimate`` (``--software here``)."""
    return measure_each(plan, [checkout], repeats, scratch, warm_too, extra)[0]


def measure_each(plan: str, checkouts: list[Path], repeats: int, scratch: Path, warm_too: bool = True,
                 extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """:func:`measure` of each of ``checkouts``, run for run interleaved (each cold run of the first, then of the
    next, ...; the warm runs alike), each checkout with caches of its own."""
    cold: list[list[dict[str, Any]]] = [[] for _ in checkouts]
    warm: list[list[dict[str, Any]]] = [[] for _ in checkouts]
    for i in range(repeats):
        for c, checkout in enumerate(checkouts):
            cold[c].append(timed_estimate(plan, checkout, scratch / f"{plan}-{c}-cold-{i}", extra))
            print(f"{plan} {checkout} cold {i}: {cold[c][-1]['wall_s']} s (load {cold[c][-1]['load_1min']})",
                  file=sys.stderr)
    for i in range(repeats if warm_too else 0):
        for c, checkout in enumerate(checkouts):
            warm[c].append(timed_estimate(plan, checkout, scratch / f"{plan}-{c}-cold-{repeats - 1}", extra))
            print(f"{plan} {checkout} warm {i}: {warm[c][-1]['wall_s']} s (load {warm[c][-1]['load_1min']})",
                  file=sys.stderr)
    return [summary(plan, cold[c], warm[c], extra) for c in range(len(checkouts))]


def summary(plan: str, cold: list[dict[str, Any]], warm: list[dict[str, Any]], extra: tuple[str, ...]) -> dict[str, Any]:
    """One plan's row: the medians, every run, and whether every run printed the same document."""
    outputs = {run["output_sha256"] for run in cold + warm}
    return {
        "plan": plan,
        "command": "autofit estimate " + " ".join([*PLANS[plan], *extra]) + " --json",
        "cold_median_s": statistics.median(r["wall_s"] for r in cold),
        "warm_median_s": statistics.median(r["wall_s"] for r in warm) if warm else None,
        "cold_runs": cold,
        "warm_runs": warm,
        "same_output": len(outputs) == 1,
        **{key: cold[-1].get(key) for key in ("winner", "winner_samples_per_s", "n_candidates", "n_fitting",
                                               "software")},
    }


def compiled(checkout: Path) -> None:
    """The checkout's ``autofit`` and ``examples`` compiled to bytecode, as ``pip install`` compiles a package: a
    machine that runs with ``PYTHONDONTWRITEBYTECODE`` would otherwise compile autofit's modules in every run
    (0.2-0.3 s of a warm plan here), which no installed copy does."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "autofit", "examples"], cwd=checkout, check=True,
                   stdout=subprocess.DEVNULL)


def commit_of(checkout: Path) -> str:
    """``git describe``-like: the short commit, ``-dirty`` where the work tree has changes (other than results)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, check=False).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if changed else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plans", default="7b,70b", help="comma-separated: " + ", ".join(PLANS))
    parser.add_argument("--label", default="after", help="the name these rows are kept under in --out")
    parser.add_argument("--pythonpath", type=Path, default=ROOT, help="the autofit checkout to time")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout measured run for run interleaved with --pythonpath's")
    parser.add_argument("--baseline-label", default="before", help="the name the baseline's rows are kept under")
    parser.add_argument("--baseline-commit", default=None,
                        help="the baseline's commit, where its folder is not a git work tree (a git archive)")
    parser.add_argument("--cold-only", action="store_true",
                        help="no warm runs (a checkout without the trace cache: they would be cold ones)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "planning_speed.json")
    parser.add_argument("--software", default=None, help="autofit estimate's --software (default: its own)")
    args = parser.parse_args()
    extra = ("--software", args.software) if args.software else ()
    checkouts = [args.pythonpath.resolve(), *([args.baseline.resolve()] if args.baseline else [])]
    for checkout in checkouts:
        compiled(checkout)
    with tempfile.TemporaryDirectory(prefix="autofit-planning-speed-") as scratch:
        rows = [measure_each(plan, checkouts, args.repeats, Path(scratch), not args.cold_only, extra)
                for plan in args.plans.split(",")]
    if args.baseline:
        for this, base in rows:
            this["same_output_as_baseline"] = {r["output_sha256"] for r in this["cold_runs"]} == {
                r["output_sha256"] for r in base["cold_runs"]}
    labels = [(args.label, commit_of(checkouts[0]))]
    if args.baseline:
        labels.append((args.baseline_label, args.baseline_commit or commit_of(checkouts[1])))
    runs = [{
        "label": label,
        "commit": commit,
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "repeats": args.repeats,
        "interleaved_with": [other for other, _ in labels if other != label],
        "plans": [row[c] for row in rows],
    } for c, (label, commit) in enumerate(labels)]
    existing = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    existing["runs"] = [r for r in existing["runs"] if r["label"] not in {label for label, _ in labels}] + runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(existing, indent=1) + "\n")
    print("| label | commit | plan | cold s (median) | warm s (median) | same output |")
    print("|---|---|---|---:|---:|---|")
    for r in existing["runs"]:
        for p in r["plans"]:
            warm = "-" if p["warm_median_s"] is None else f"{p['warm_median_s']:.1f}"
            print(f"| {r['label']} | {r['commit']} | {p['plan']} | {p['cold_median_s']:.1f} | {warm} "
                  f"| {'yes' if p['same_output'] else 'NO'} |")


if __name__ == "__main__":
    main()
