"""Where the caching allocator's reserve comes from: every committed allocation history split into phases.

    python -m benchmarks.gpu.allocator_phases

Reads only the committed histories (``benchmarks/results/gpu_check/*_alloc_history_<model>.json.gz``, recorded by
``benchmarks/gpu/gpu_check_grid.py`` from the model's copy to the GPU through ``deepspeed.initialize`` and 3 steps) and
the run JSON beside each (its ``after_initialize`` figures). Each history is replayed through
:class:`~autofit.cost_model.allocator.CachingAllocator` as :func:`autofit.cost_model.allocator_replay.replay` does
(new segments at the recorded addresses: exact on the clean histories, within 0.03% on the others), and the
simulator's state is read event by event.

Phases, found from the event structure alone:

* ``copy``: from the first event to the first flat buffer, the first request of at least half the largest one
  before step 1 (the largest is the fp32 flat buffer, ``params x 4`` bytes, or under ZeRO-3 its first sub-group of
  1e9 elements; the first is the bf16 one, ``params x 2``): the parameters' own copies on the GPU (ZeRO-0: the
  module's bf16 copy inside ``deepspeed.initialize``; ZeRO-3: the model built under ``zero.Init``, then the
  engine's partitions moved to the host and ``empty_cache``, which leaves nothing allocated);
* ``init``: from there to the last event at which the allocated bytes equal the row's ``after_initialize`` (the
  optimizer's flat buffers and states);
* ``s1 fwd`` / ``s1 bwd`` / ``s1 opt``: step 1, from the end of ``init`` (the batch's copy included); its forward
  ends at the loss: the allocated peak within 40 events of the bf16 logits (the step's first request of 64 MiB or
  more followed within 3 events by one twice its size, their fp32 upcast); the optimizer begins at the
  step's last cluster of flat-buffer-sized requests (>= ``params x 2`` bytes, within 40 events);
* ``s2-3``: steps 2 and 3, found as the tail's repeating period (the two last steps' alloc/free sequences agree
  request for request).

Per phase: allocated and reserved at its end and their peaks inside it, the segments it allocated (MiB x count),
and the share of the reserve at the reserved peak (reserved - allocated there) held in segments it created. At the
reserved peak: the rounding inside live blocks (block - request), the free cached blocks by pool, and the segments
wholly free there with the request that made each, the free blocks of 64 MiB or more, and the peaks of the history
replayed with only its requests of at least 1, 10 and 64 MiB.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from autofit.cost_model.allocator import BumpAddresses, CachingAllocator
from autofit.cost_model.allocator_replay import APART, GROW, SHRINK, history_events, replay

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "benchmarks" / "results" / "gpu_check"
HISTORY = re.compile(r"(?P<run>.+)_alloc_history_(?P<model>.+)\.json\.gz$")
MIB, GIB = 2**20, 2**30
PHASES = ("copy", "init", "s1 fwd", "s1 bwd", "s1 opt", "s2-3")


class Tracked:
    """A replay (as :func:`~autofit.cost_model.allocator_replay.replay`, recorded addresses) that keeps, per event,
    the allocated and reserved bytes, and per segment the event and request that made it."""

    def __init__(self, events: list[tuple[str, int, int]], stop: int | None = None) -> None:
        pending: list[tuple[int, int]] = []
        stand_in = BumpAddresses(APART)

        def segment_address(size: int) -> int:
            if pending and pending[0][1] == size:
                return pending.pop(0)[0]
            return stand_in(size)

        self.allocator = allocator = CachingAllocator(None, segment_address)
        self.allocated: list[int] = []
        self.reserved: list[int] = []
        self.made: dict[int, tuple[int, int]] = {}  # segment address -> (event index, request)
        names: dict[int, int] = {}
        previous = ""
        for index, (action, address, size) in enumerate(events):
            if stop is not None and index > stop:
                break
            if action in GROW:
                pending.append((address, size))
            elif action in SHRINK and previous not in SHRINK:
                allocator.empty_cache()
            elif action == "alloc":
                grown = len(allocator.segment_events)
                names[address] = allocator.malloc(size)
                pending.clear()
                for _, ptr, _ in allocator.segment_events[grown:]:
                    self.made[ptr] = (index, size)
            elif action == "free_completed" and address in names:
                allocator.free(names.pop(address))
            previous = action
            self.allocated.append(allocator.allocated_bytes)
            self.reserved.append(allocator.reserved_bytes)


def tokens(events: list[tuple[str, int, int]], start: int, end: int) -> list[tuple[int, str, int]]:
    """The requests and completed frees of ``events[start:end]`` as (index, action, size)."""
    return [(i, events[i][0], events[i][2]) for i in range(start, end)
            if events[i][0] in ("alloc", "free_completed")]


def boundaries(events: list[tuple[str, int, int]], tracked: Tracked, after_init_allocated: int) -> list[int]:
    """The first event of each phase (and len(events)): see the module's docstring."""
    n = len(events)
    # steps 2 and 3: the tail's period, found where two consecutive stretches of requests and frees agree
    toks = tokens(events, 0, n)
    keys = [(a, s) for _, a, s in toks]
    period = next(p for p in range(len(keys) // 4, len(keys) // 2 + 1) if keys[-p:] == keys[-2 * p:-p])
    step2 = toks[-2 * period][0]
    while step2 > 0 and events[step2 - 1][0] in GROW:
        step2 -= 1
    # before step 1 (at least as long as a later step) the largest request is an fp32 flat buffer (ZeRO-3 may cut it
    # in sub-groups of 1e9 elements), the bf16 one half the whole
    before = step2 - (n - step2) // 2
    flat16 = max(size for action, _, size in events[:before] if action == "alloc") // 2
    init = next(i for i, (a, _, s) in enumerate(events) if a == "alloc" and s >= flat16)
    if init > 0 and events[init - 1][0] in GROW:
        init -= 1
    ends = [i for i in range(init, step2) if tracked.allocated[i] == after_init_allocated]
    step1 = (ends[-1] + 1) if ends else init
    large = [i for i in range(step1, step2) if events[i][0] == "alloc" and events[i][2] >= flat16 * 0.99]
    opt = large[-1]
    while large and large[-1] >= opt - 40:
        opt = large.pop()
    if events[opt - 1][0] in GROW:
        opt -= 1
    logits = next(i for i in range(step1, opt) if events[i][0] == "alloc" and events[i][2] >= 64 * MIB
                  and any(a == "alloc" and s == 2 * events[i][2] for a, _, s in events[i + 1:i + 4]))
    forward_end = max(range(logits, logits + 40), key=lambda i: (tracked.allocated[i], -i)) + 1
    return [0, init, step1, forward_end, opt, step2, n]


def analyse(run: str, model: str, label: str, history: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    events = history_events(history)
    tracked = Tracked(events)
    starts = boundaries(events, tracked, int(row["after_initialize"]["allocated_bytes"]))
    peak_at = max(range(len(events)), key=lambda i: (tracked.reserved[i], -i))
    at_peak = Tracked(events, stop=peak_at)
    allocator = at_peak.allocator
    assert allocator.reserved_bytes == tracked.reserved[peak_at]
    reserve = allocator.reserved_bytes - allocator.allocated_bytes
    live = list(allocator._live.values())
    rounding = sum(b.size - b.requested for b in live)
    free_small = sum(b.size for b in allocator._small.blocks.values())
    free_large = sum(b.size for b in allocator._large.blocks.values())

    def phase_of(index: int) -> int:
        return next(k for k in range(len(PHASES)) if starts[k] <= index < starts[k + 1])

    by_phase = [0] * len(PHASES)
    idle, holes = [], []
    for segment in allocator.segments():
        made_at, request = at_peak.made[segment.address]
        free = sum(size for size, allocated in segment.blocks if not allocated)
        by_phase[phase_of(made_at)] += free
        live = sum(size for size, allocated in segment.blocks if allocated)
        holes += [(size, PHASES[phase_of(made_at)], segment.total_bytes(), request, live)
                  for size, allocated in segment.blocks if not allocated and size >= 64 * MIB]
        if not any(allocated for _, allocated in segment.blocks):
            idle.append((PHASES[phase_of(made_at)], segment.total_bytes(), request))
    phases = []
    for k, name in enumerate(PHASES):
        lo, hi = starts[k], starts[k + 1]
        grown = Counter(size for action, _, size in events[lo:hi] if action in GROW)
        phases.append({
            "phase": name, "events": [lo, hi],
            "allocated_end": tracked.allocated[hi - 1], "reserved_end": tracked.reserved[hi - 1],
            "allocated_peak": max(tracked.allocated[lo:hi]), "reserved_peak": max(tracked.reserved[lo:hi]),
            "segments": sorted(grown.items(), key=lambda kv: -kv[0]),
            "reserve_share": by_phase[k] / reserve if reserve else 0.0, "reserve_bytes": by_phase[k]})
    return {"run": run, "model": model, "label": label, "n_events": len(events), "starts": starts,
            "peak_event": peak_at, "peak_phase": PHASES[phase_of(peak_at)],
            "reserved_peak": allocator.reserved_bytes, "allocated_at_peak": allocator.allocated_bytes,
            "reserve": reserve, "rounding": rounding, "free_small": free_small, "free_large": free_large,
            "free_large_under_10mib": sum(b.size for b in allocator._large.blocks.values() if b.size < 10 * MIB),
            "coarse": coarse(events), "idle_segments": idle, "holes": sorted(holes, reverse=True), "phases": phases}


def coarse(events: list[tuple[str, int, int]]) -> dict[int, tuple[float, float]]:
    """The reserved and allocated peaks' change (relative to the whole history's, stand-in addresses) when only the
    requests of at least 1, 10 and 64 MiB are replayed (``empty_cache`` kept): how fine a synthesized sequence has
    to be."""
    full = replay(events, recorded_addresses=False)
    found = {}
    for mib in (1, 10, 64):
        kept = [e for e in events if e[0] not in ("alloc", "free_requested", "free_completed") or e[2] >= mib * MIB]
        part = replay(kept, recorded_addresses=False)
        found[mib] = ((part.peak_reserved_bytes - full.peak_reserved_bytes) / full.peak_reserved_bytes,
                      (part.peak_allocated_bytes - full.peak_allocated_bytes) / full.peak_allocated_bytes)
    return found


def history_rows() -> list[dict[str, Any]]:
    rows = []
    for path in sorted(GPU_CHECK.glob("*_alloc_history_*.json.gz")):
        match = HISTORY.match(path.name)
        assert match, path.name
        run = json.loads((GPU_CHECK / f"{match['run']}.json").read_text())
        measured = {r["label"]: r for r in run["steps"]["grid"]["result"]["models"][match["model"]]["rows"]}
        with gzip.open(path) as f:
            histories = json.load(f)
        rows += [analyse(match["run"], match["model"], label, history, measured[label])
                 for label, history in histories.items() if measured[label].get("status") == "ok"]
    return rows


def gib(n: int) -> str:
    return f"{n / GIB:.3f}"


def segments_text(grown: list[tuple[int, int]]) -> str:
    return ", ".join(f"{size / MIB:g}x{count}" if count > 1 else f"{size / MIB:g}" for size, count in grown) or "-"


def name_of(r: dict[str, Any]) -> str:
    parts = r["label"].split()
    return f"{r['run'].replace('_2026-11-28', '')} {r['model']} {parts[0].split('x')[0]} " + " ".join(
        p for p in parts if p.startswith(("z", "ckpt")))


def summary(rows: list[dict[str, Any]]) -> str:
    """One row per history: the reserved peak, where it falls, its reserve and the phases that made it."""
    lines = ["| history | reserved peak GiB (phase) | reserve GiB (%) | made in copy / init / s1 fwd / s1 bwd / s1 opt "
             "/ s2-3 | free small pool MiB | free large < 10 MiB MiB | rounding MiB | >= 1 / 10 / 64 MiB only |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shares = " / ".join(f"{p['reserve_share']:.0%}" for p in r["phases"])
        only = " / ".join(f"{d[0]:+.1%}" for d in r["coarse"].values())
        lines.append(f"| {name_of(r)} | {gib(r['reserved_peak'])} ({r['peak_phase']}) | {gib(r['reserve'])} "
                     f"({r['reserve'] / r['reserved_peak']:.0%}) | {shares} | {r['free_small'] / MIB:.1f} | "
                     f"{r['free_large_under_10mib'] / MIB:.0f} | {r['rounding'] / MIB:.1f} | {only} |")
    return "\n".join(lines)


def report(r: dict[str, Any]) -> str:
    lines = [f"### {name_of(r)}", "",
             f"{r['n_events']} events; phases start at {r['starts'][:-1]}; reserved peak {gib(r['reserved_peak'])} GiB "
             f"at event {r['peak_event']} ({r['peak_phase']}), allocated there {gib(r['allocated_at_peak'])} GiB, "
             f"reserve {gib(r['reserve'])} GiB = free "
             f"cached: small pool {r['free_small'] / MIB:.1f} MiB + large pool {r['free_large'] / MIB:.1f} MiB "
             f"(in blocks < 10 MiB: {r['free_large_under_10mib'] / MIB:.1f} MiB); "
             f"rounding inside live blocks (block - request) {r['rounding'] / MIB:.1f} MiB", "",
             "| phase | alloc end GiB | reserved end GiB | alloc peak GiB | reserved peak GiB | reserve at peak made "
             "here | segments allocated (MiB x n) |", "|---|---|---|---|---|---|---|"]
    for p in r["phases"]:
        lines.append(f"| {p['phase']} | {gib(p['allocated_end'])} | {gib(p['reserved_end'])} | "
                     f"{gib(p['allocated_peak'])} | {gib(p['reserved_peak'])} | {p['reserve_bytes'] / MIB:.0f} MiB "
                     f"({p['reserve_share']:.0%}) | {segments_text(p['segments'])} |")
    idle = Counter((phase, size, request) for phase, size, request in r["idle_segments"])
    lines += ["", "Segments wholly free at the peak (phase made, segment MiB, the request that made it MiB): "
              + ("; ".join(f"{phase} {size / MIB:g} <- {request / MIB:.2f}" + (f" x{n}" if n > 1 else "")
                           for (phase, size, request), n in sorted(idle.items(), key=lambda kv: -kv[0][1]))
                 or "none"),
              "", "Only the requests of at least N MiB replayed, reserved (allocated) peak against the whole history's: "
              + "; ".join(f">= {mib} MiB {d[0]:+.1%} ({d[1]:+.1%})" for mib, d in r["coarse"].items()),
              "", "Free blocks of 64 MiB or more at the peak (MiB, in a segment of MiB made in phase by a request of MiB, "
              "live MiB in that segment): "
              + ("; ".join(f"{size / MIB:.1f} in {total / MIB:g} ({phase}, {request / MIB:.2f}, live {live / MIB:.1f})"
                           for size, phase, total, request, live in r["holes"]) or "none"), ""]
    return "\n".join(lines)


def main() -> int:
    rows = history_rows()
    print(summary(rows), end="\n\n")
    for r in rows:
        print(report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
