"""Every committed GPU allocation history replayed through the caching allocator's simulator.

    python -m benchmarks.gpu.allocator_replay [--json benchmarks/results/allocator_replay.json]

The histories are the real allocator's own events (``benchmarks/gpu/gpu_check_grid.py``: from the model's copy to the
GPU through ``deepspeed.initialize`` and 3 steps), one per grid row that kept one, in
``benchmarks/results/gpu_check/*_alloc_history_<model>.json.gz``; each row of the run's JSON beside it holds the
measured peaks. Each history is replayed by :func:`autofit.cost_model.allocator_replay.replay` twice: new segments
at the addresses the device gave (so every block's address can be compared) and at stand-in addresses (as a plan
without a GPU would run it); and once with ``expandable_segments:True``, a prediction (no row measured it).

A replay is exact only where the row's ``before.reserved_bytes`` is 0: the allocator held nothing when the history
began. Elsewhere it held segments the history does not show (its ``before``), which the real allocator filled
first; the simulator starts empty, and is set against the row's ``max_memory_reserved`` (those segments included).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path
from typing import Any

from autofit.cost_model.allocator import AllocatorSettings
from autofit.cost_model.allocator_replay import history_events, replay

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "benchmarks" / "results" / "gpu_check"
HISTORY = re.compile(r"(?P<run>.+)_alloc_history_(?P<model>.+)\.json\.gz$")
GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "allocator_replay.json"))
    args = parser.parse_args(argv)
    rows = [row for path in sorted(GPU_CHECK.glob("*_alloc_history_*.json.gz")) for row in replay_file(path)]
    Path(args.json).write_text(json.dumps({"command": "python -m benchmarks.gpu.allocator_replay", "rows": rows},
                                          indent=1) + "\n")
    print(table(rows))
    return 0


def replay_file(path: Path) -> list[dict[str, Any]]:
    """Each history of one file beside its measured row."""
    match = HISTORY.match(path.name)
    assert match, path.name
    run = json.loads((GPU_CHECK / f"{match['run']}.json").read_text())
    measured = {r["label"]: r for r in run["steps"]["grid"]["result"]["models"][match["model"]]["rows"]}
    device_bytes = run["steps"]["env"]["result"]["device"]["memory_bytes"]
    with gzip.open(path) as f:
        histories = json.load(f)
    return [replay_one(match["run"], match["model"], label, history, measured[label], device_bytes)
            for label, history in histories.items() if measured[label].get("status") == "ok"]


def replay_one(run: str, model: str, label: str, history: dict[str, Any], row: dict[str, Any],
               device_bytes: int) -> dict[str, Any]:
    events = history_events(history)
    placed = replay(events)
    stand_in = replay(events, recorded_addresses=False)
    expandable = replay(events, AllocatorSettings(expandable_segments=True, device_bytes=device_bytes),
                        recorded_addresses=False)
    before = int(row["before"]["reserved_bytes"])
    real = int(row["max_memory_reserved_bytes"])
    return {
        "run": run, "model": model, "label": label, "n_events": len(events), "clean": before == 0,
        "before_reserved_bytes": before, "max_memory_reserved_bytes": real,
        "max_memory_allocated_bytes": int(row["max_memory_allocated_bytes"]),
        "events_peak_reserved_bytes": placed.recorded_peak_reserved_bytes,
        "simulated_peak_reserved_bytes": placed.peak_reserved_bytes,
        "error": (placed.peak_reserved_bytes - real) / real,
        "stand_in_peak_reserved_bytes": stand_in.peak_reserved_bytes,
        "stand_in_error": (stand_in.peak_reserved_bytes - real) / real,
        "simulated_peak_allocated_bytes": placed.peak_allocated_bytes,
        "segment_allocs": [placed.n_segment_allocs, placed.recorded_n_segment_allocs],
        "segment_alloc_bytes": [placed.segment_alloc_bytes, placed.recorded_segment_alloc_bytes],
        "segment_frees": [placed.n_segment_frees, placed.recorded_n_segment_frees],
        "n_empty_cache": placed.n_empty_cache, "n_allocs": placed.n_allocs,
        "n_blocks_misplaced": placed.n_address_mismatches, "first_misplaced_event": placed.first_mismatch_event,
        "expandable_peak_reserved_bytes": expandable.peak_reserved_bytes,
        "expandable_vs_measured": (expandable.peak_reserved_bytes - real) / real,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: measured reserved peak against the simulated one, per history."""
    lines = ["| history | clean | measured reserved peak GiB | simulated GiB | error | stand-in addresses | "
             "segments sim / real | blocks misplaced | expandable_segments GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['run'].replace('_2026-11-28', '')} {r['model']} {short(r['label'])} | "
            f"{'yes' if r['clean'] else 'no (%.2f GiB held before)' % (r['before_reserved_bytes'] / GIB)} | "
            f"{r['max_memory_reserved_bytes'] / GIB:.3f} | {r['simulated_peak_reserved_bytes'] / GIB:.3f} | "
            f"{r['error']:+.3%} | {r['stand_in_error']:+.3%} | {r['segment_allocs'][0]} / {r['segment_allocs'][1]} | "
            f"{r['n_blocks_misplaced']} of {r['n_allocs']} | {r['expandable_peak_reserved_bytes'] / GIB:.3f} "
            f"({r['expandable_vs_measured']:+.1%}) |")
    return "\n".join(lines)


def short(label: str) -> str:
    """``mb2x1 bf16 adamw z3 ckpt0 sdpa`` as ``mb2 z3 ckpt0``."""
    parts = label.split()
    return " ".join([parts[0].split("x")[0], *[p for p in parts if p.startswith(("z", "ckpt"))]])


if __name__ == "__main__":
    sys.exit(main())
