#!/usr/bin/env python3
"""Issue 40, hostile and broken input: autofit run as real subprocesses (the CLI, a worker over a SQLite queue,
real cache folders) against 103 cases, each a bad input and what autofit must do with it; a table case /
expected / got, and ``benchmarks/results/hostile_inputs.json``.

    DS_ACCELERATOR=cpu python -m benchmarks.robustness.hostile_inputs [-k SUBSTR] [-j 2] [--keep]

``AUTOFIT_ROOT`` (default: this checkout) is put on PYTHONPATH for every autofit process, ``AUTOFIT_PYTHON``
(default: this interpreter) runs them. A "lib" case calls one library function in a subprocess and reports SKIP
when its module moved. Exit status 0 when every case passes. A few minutes on two cores (one real search).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import sys
import time
from pathlib import Path

import benchmarks.robustness.hostile_cases_io
import benchmarks.robustness.hostile_cases_trust  # noqa: F401
from benchmarks.robustness.hostile_harness import CASES, PY, ROOT, WORK, Skip, setup

RESULT = Path(__file__).resolve().parents[1] / "results" / "hostile_inputs.json"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", default="", help="run only cases whose id contains this")
    ap.add_argument("-j", type=int, default=int(os.environ.get("HOSTILE_JOBS", "2")))
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    opts = ap.parse_args()
    started = time.monotonic()
    print(f"autofit root {ROOT}; python {PY}; work {WORK}", flush=True)
    setup()
    print(f"setup done in {time.monotonic() - started:.0f} s", flush=True)
    chosen = [c for c in CASES if opts.k in c[0]]
    rows: list[dict] = []

    def one(c):
        cid, cls, expected, fn = c
        t = time.monotonic()
        try:
            ok, got = fn()
            verdict = "PASS" if ok else "FAIL"
        except Skip as exc:
            verdict, got = "SKIP", f"module moved: {exc}"
        except Exception as exc:
            verdict, got = "ERROR", f"{type(exc).__name__}: {exc}"
        row = dict(id=cid, cls=cls, expected=expected, got=str(got).replace("\n", " "), verdict=verdict,
                   secs=round(time.monotonic() - t, 1))
        print(f"  {verdict:5} {cid} ({row['secs']} s)", flush=True)
        return row

    with cf.ThreadPoolExecutor(max_workers=max(1, opts.j)) as pool:
        rows = list(pool.map(one, chosen))
    print()
    print(f"{'case':34} | {'class':10} | {'expected':60} | {'got':70} | verdict")
    print("-" * 200)
    for r in rows:
        print(f"{r['id']:34} | {r['cls']:10} | {r['expected'][:60]:60} | {r['got'][:70]:70} | {r['verdict']}")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("PASS", "FAIL", "SKIP", "ERROR")}
    print(f"\n{len(rows)} cases: " + ", ".join(f"{v} {n}" for v, n in counts.items()) +
          f"; {time.monotonic() - started:.0f} s")
    Path(os.environ.get("HOSTILE_OUT", str(RESULT))).write_text(json.dumps(
        {"counts": counts, "total": len(rows), "seconds": round(time.monotonic() - started), "rows": rows}, indent=1))
    if not opts.keep:
        shutil.rmtree(WORK, ignore_errors=True)
    return 0 if counts["FAIL"] == counts["ERROR"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
