"""What loading an entry in a time-limited child first (:mod:`autofit.workload.preflight`) costs the honest path.

    DS_ACCELERATOR=cpu python -m benchmarks.probe.preflight_cost [--repeats 3]

Each run is a fresh process with autofit's CLI and torch imported, as the CLI has them when it loads an entry; it
times :func:`check_entry_loads` (the forked child's whole run, the entry's modules cold) and the process's own
:func:`load_workload` after it. Results: ``benchmarks/results/preflight_cost.json`` (each run, and the load average
when it started: a shared machine's timings are only comparable with its load).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = ["examples/mlp.py:workload", "examples/llama_7b.py:workload", "hf:examples/hf_configs/llama_gqa?seq_len=128"]
ONE_RUN = """
import json, sys, time
import autofit.cli  # noqa: F401 - what the CLI has imported before it loads an entry
import torch  # noqa: F401 - the plan imports it right after the load: not the preflight's cost
from autofit.workload.entry import load_workload
from autofit.workload.preflight import check_entry_loads
entry = sys.argv[1]
if entry.startswith("hf:"):
    import transformers  # noqa: F401
t0 = time.perf_counter(); check_entry_loads(entry, 600); t1 = time.perf_counter(); load_workload(entry)
print(json.dumps({"preflight_s": round(t1 - t0, 4), "load_s": round(time.perf_counter() - t1, 4)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "preflight_cost.json"))
    args = parser.parse_args()
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), PYTHONPATH=str(ROOT))
    runs = []
    for _ in range(args.repeats):
        for entry in ENTRIES:  # interleaved: each entry's runs see the same spread of load
            load = os.getloadavg()[0]
            done = subprocess.run([sys.executable, "-c", ONE_RUN, entry], cwd=ROOT, env=env, capture_output=True,
                                  text=True, check=True)
            runs.append({"entry": entry, "load": round(load, 2), **json.loads(done.stdout.splitlines()[-1])})
            print(json.dumps(runs[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
