"""What a probe costs beyond its steps, and what README command 1 costs end to end: fresh processes against a
search's warm parent (autofit/probe/warm.py), measured side by side.

    python -m benchmarks.probe.probe_speed [--probes 5] [--readme 5 --before REV] [--out benchmarks/results/probe_speed.json]

**Probes** (``--probes N``): ``examples/mlp.py:workload`` at micro-batch 4, ZeRO-0, fp32, one CPU rank, 3 timed
steps, probed N times from a fresh process and N times forked by one warm parent, alternately (fresh, forked, fresh,
...), so a slow spell of the machine falls on both. A probe's overhead is its wall time, seen from the caller, less
its timed steps; the warm parent's own start (once a search) is reported apart, and the first forked probe, which
waits for it, is left out of the forked overheads. The peaks are reported too: the forked probe must measure what
the fresh one does.

**README command 1** (``--readme N``): the command the README opens with (``autofit run
hf:examples/hf_configs/llama_gqa ... --trials 6``), in a fresh temporary folder each run, with this checkout
(``after``) and with a worktree of ``--before REV`` (``before``), alternately, after one untimed run of each (so
both find their trace cached, as a user's second run does). Its wall time, the winner and the trials' outcomes.

Medians, every run, and the machine's load average when each run started go to ``--out`` with the commit, host and
date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from autofit.core.config import Config
from autofit.machine.device import get_hardware
from autofit.probe.result import ProbeResult
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec
from autofit.probe.warm import WarmParent

ROOT = Path(__file__).resolve().parents[2]
ENTRY = f"{ROOT / 'examples' / 'mlp.py'}:workload"
README_ARGS = ["run", "hf:examples/hf_configs/llama_gqa", "--seq-len", "128", "--hardware", "cpu", "--memory", "2GiB",
               "--global-batch", "16", "--space", "cpu", "--trials", "6", "--out", "ds_config.json", "--report",
               "autofit-report", "--json"]
OPS = ("deepspeed_shm_comm", "fused_adam")


def overhead_s(result: ProbeResult) -> float:
    """The probe's wall time less its timed steps."""
    return result.wall_s - sum(result.step_times_s)


def probe_row(result: ProbeResult) -> dict[str, Any]:
    """One probe: its overhead, split into start-up (before the first step) and untimed steps (warm-up, the CPU's
    steps around its peak reading)."""
    steps_s = result.phases_s.get("steps_s", 0.0)
    return {"status": result.status, "wall_s": round(result.wall_s, 3), "overhead_s": round(overhead_s(result), 3),
            "start_up_s": round(result.wall_s - steps_s, 3),
            "untimed_steps_s": round(steps_s - sum(result.step_times_s), 3),
            "timed_steps_s": round(sum(result.step_times_s), 3), "peak_bytes": result.peak_bytes,
            "phases_s": {k: round(v, 3) for k, v in result.phases_s.items()}, "load": os.getloadavg()[0]}


def measure_probes(n: int) -> dict[str, Any]:
    """``n`` fresh and ``n`` forked probes of :data:`ENTRY`, alternately."""
    spec = probe_spec(ENTRY, Config(micro_batch_size=4), get_hardware("cpu"), steps=3)
    fresh: list[dict[str, Any]] = []
    forked: list[dict[str, Any]] = []
    with WarmParent(ENTRY, "eager", "cpu", OPS) as warm:
        for _ in range(n + 1):  # the first forked probe waits for the warm parent's start: left out below
            fresh.append(probe_row(run_probe(spec, timeout_s=600)))
            forked.append(probe_row(run_probe(spec, timeout_s=600, warm=warm)))
        start_s = warm.ready.get("seconds")
    fresh, first_forked, forked = fresh[1:], forked[0], forked[1:]
    return {
        "entry": "examples/mlp.py:workload", "config": "mb4 fp32 adamw z0, 1 CPU rank, 3 timed steps",
        "fresh_overhead_s": statistics.median(r["overhead_s"] for r in fresh),
        "forked_overhead_s": statistics.median(r["overhead_s"] for r in forked),
        "fresh_start_up_s": statistics.median(r["start_up_s"] for r in fresh),
        "forked_start_up_s": statistics.median(r["start_up_s"] for r in forked),
        "fresh_peak_bytes": statistics.median(r["peak_bytes"] for r in fresh),
        "forked_peak_bytes": statistics.median(r["peak_bytes"] for r in forked),
        "warm_parent_start_s": start_s, "first_forked": first_forked, "fresh": fresh, "forked": forked,
    }


def readme_run(pythonpath: Path) -> dict[str, Any]:
    """README command 1 once, with the autofit at ``pythonpath``, in a new folder holding the examples."""
    with tempfile.TemporaryDirectory(prefix="autofit-readme-") as folder:
        shutil.copytree(ROOT / "examples", Path(folder) / "examples")
        env = dict(os.environ, PYTHONPATH=str(pythonpath), DS_ACCELERATOR="cpu")
        load, started = os.getloadavg()[0], time.monotonic()
        done = subprocess.run([sys.executable, "-m", "autofit", *README_ARGS], cwd=folder, env=env,
                              capture_output=True, text=True, check=False)
        wall_s = time.monotonic() - started
    row: dict[str, Any] = {"wall_s": round(wall_s, 1), "returncode": done.returncode, "load": load}
    if done.returncode == 0:
        document = json.loads(done.stdout)
        row["winner"] = document["best"]["config"]
        row["winner_samples_per_s"] = document["best"]["measured"]["samples_per_s"]
        row["trials"] = [(t["phase"], t["measured"]["status"]) for t in document["trials"]]
    else:
        row["stderr_tail"] = done.stderr[-500:]
    return row


def measure_readme(n: int, before: str) -> dict[str, Any]:
    """README command 1, ``n`` times with this checkout and ``n`` with a worktree of ``before``, alternately."""
    with tempfile.TemporaryDirectory(prefix="autofit-before-") as worktree:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", worktree, before], check=True,
                       capture_output=True)
        try:
            for path in (ROOT, Path(worktree)):
                readme_run(path)  # untimed: the trace cached for both
            after_rows, before_rows = [], []
            for _ in range(n):
                before_rows.append(readme_run(Path(worktree)))
                after_rows.append(readme_run(ROOT))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", worktree], check=False)
    return {"before_rev": before, "before_wall_s": statistics.median(r["wall_s"] for r in before_rows),
            "after_wall_s": statistics.median(r["wall_s"] for r in after_rows),
            "before": before_rows, "after": after_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", type=int, default=5, help="fresh and forked probes each (0: none)")
    parser.add_argument("--readme", type=int, default=0, help="runs of README command 1 each, before and after")
    parser.add_argument("--before", default=None, help="the commit README command 1 is compared with")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "probe_speed.json")
    args = parser.parse_args()
    if args.readme and not args.before:
        parser.error("--readme needs --before REV")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    results: dict[str, Any] = {"commit": commit, "host": platform.node(), "cores": os.cpu_count(),
                               "date": datetime.date.today().isoformat()}
    if args.probes:
        results["probes"] = measure_probes(args.probes)
        p = results["probes"]
        print(f"probe overhead: fresh {p['fresh_overhead_s']:.2f} s, forked {p['forked_overhead_s']:.2f} s; start-up "
              f"{p['fresh_start_up_s']:.2f} s vs {p['forked_start_up_s']:.2f} s "
              f"(warm parent's start {p['warm_parent_start_s']:.1f} s once); peaks {p['fresh_peak_bytes'] / 2**20:.1f} "
              f"vs {p['forked_peak_bytes'] / 2**20:.1f} MiB")
    if args.readme:
        results["readme_command_1"] = measure_readme(args.readme, args.before)
        r = results["readme_command_1"]
        print(f"README command 1: before {r['before_wall_s']:.1f} s, after {r['after_wall_s']:.1f} s")
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
