"""Predicted vs measured on a CUDA machine: peak device memory and throughput, 4 architectures of 0.6-0.8 B.

    python -m benchmarks.accuracy.cuda_accuracy                       # every model x bf16/fp8 x ZeRO 0-3
    python -m benchmarks.accuracy.cuda_accuracy --quick               # ZeRO 0 and 3 only
    python -m benchmarks.accuracy.cuda_accuracy --models llama t5 --out benchmarks/results/cuda
    python -m benchmarks.accuracy.cuda_accuracy --parts               # the parts, and which rows each has measured
    python -m benchmarks.accuracy.cuda_accuracy --part 3              # one part: fits one 10-minute command

One command, unchanged on an H100 or H200: the world size is the number of GPUs present, the
hardware is detected (``--hardware auto``), fp8 rows run where the device and torchao have it (else
they are listed as pruned, with the reason). Each row is one config through a real probe (5 timed
steps after 2 warm-up): the measured peak is NVML's per-process figure (docs/design.md, "Memory, measured"), shown beside
``max_memory_reserved`` + the CUDA context; throughput is samples/s of the slowest rank. Predictions
are the uncalibrated cost model's (``Coefficients.for_hardware``). Writes ``cuda_accuracy.md``
(the table) and ``cuda_accuracy.json`` (every row, with the device's name) into ``--out``.

In parts: part K is one model in one precision (its ZeRO stages, 4 rows or 2 with ``--quick``; ``--parts``
lists them). Every row is appended to ``cuda_accuracy.json`` as soon as it is measured, and a run skips the
rows that file already holds for this device and world size (``--retry-failed``: also re-run its error and
timeout rows), so a part cut short by the command's limit goes on where it stopped when run again. A run
starts no row it cannot finish within ``--budget`` seconds (540 by default: a 10-minute command, less the
start), reckoned from the slowest row so far; the probe's own timeout is cut to what is left. A results
file from another device or world size is refused, in one line.

Without a CUDA device it prints one line and exits with status 1. What to carry to a GPU machine without
internet: docs/guides/cuda.md, "Running the GPU benchmark in parts".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: model name -> (entry, micro-batch per GPU); micro-batches sized to leave ZeRO-0 bf16 room on 80 GB
MODELS = {
    "llama": ("benchmarks/models/gpu_large.py:llama", 4),
    "gpt2": ("benchmarks/models/gpu_large.py:gpt2", 4),
    "t5": ("benchmarks/models/gpu_large.py:t5", 8),
    "vit": ("benchmarks/models/gpu_large.py:vit", 32),
}
PRECISIONS = ("bf16", "fp8")


def configs_for(micro_batch: int, quick: bool) -> list[Any]:
    from autofit.core.config import Config

    stages = (0, 3) if quick else (0, 1, 2, 3)
    return [
        Config(micro_batch_size=micro_batch, precision=p, zero_stage=z, optimizer="adamw", attention="sdpa")
        for p in PRECISIONS
        for z in stages
    ]


def runnable(configs: list[Any], hardware: Any, world_size: int, software: Any = None) -> tuple[list[Any], list[str]]:
    """The configs the space's rules let run on ``software`` (default: this machine's), and one line per pruned group
    (fp8 below sm89 ...)."""
    from autofit.core.space import SearchSpace, enumerate_candidates
    from autofit.machine.software import detect_software

    software = software if software is not None else detect_software()
    keep, reasons = [], []
    for config in configs:
        values = {k: (v,) for k, v in config.to_dict().items() if k != "grad_accum_steps"}
        space = SearchSpace(name="cuda_accuracy", description="one config", values=values)
        try:
            enumerate_candidates(space, software=software,
                                 hardware=hardware, world_size=world_size, global_batch=None, fixed={},
                                 searches_attention=True)
            keep.append(config)
        except Exception as error:  # a rule refused it: say why once
            reasons.append(f"{config.label()}: {error}")
    return keep, sorted(set(reasons))


def measure(entry: str, config: Any, facts: Any, hardware: Any, world_size: int, timeout_s: float) -> dict[str, Any]:
    from autofit.cost_model import Coefficients, predict
    from autofit.probe.run import run_probe
    from autofit.probe.spec import probe_spec

    predicted = predict(config, facts, hardware, world_size, Coefficients.for_hardware(hardware))
    spec = probe_spec(entry, config, hardware, world_size, steps=5, warmup_steps=2, facts=facts)
    result = run_probe(spec, timeout_s=timeout_s)
    memory = result.device_memory
    allocator = (memory.get("max_memory_reserved_bytes") or 0) + (memory.get("context_bytes") or 0)
    return {
        "config": config.to_dict(),
        "label": config.label(),
        "status": result.status,
        "message": result.message,
        "predicted_peak_bytes": predicted.peak_bytes,
        "measured_peak_bytes": result.peak_bytes,
        "nvml_peak_bytes": memory.get("nvml_peak_bytes"),
        "reserved_plus_context_bytes": allocator,
        "predicted_samples_per_s": predicted.samples_per_s,
        "measured_samples_per_s": result.samples_per_s,
        "peak_error": _error(predicted.peak_bytes, result.peak_bytes),
        "throughput_error": _error(predicted.samples_per_s, result.samples_per_s),
        "wall_s": result.wall_s,
    }


def _error(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured else None


def table(rows: list[dict[str, Any]]) -> list[str]:
    gib = 2**30
    lines = [
        "| model | config | predicted GiB | NVML peak GiB | reserved+context GiB | error | predicted samples/s "
        "| measured samples/s | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['label']} | {r['predicted_peak_bytes'] / gib:.2f} | {r['status']} "
                         f"| | | | | {str(r['message'])[:80]} |")
            continue
        nvml = f"{r['nvml_peak_bytes'] / gib:.2f}" if r["nvml_peak_bytes"] is not None else "n/a"
        lines.append(
            f"| {r['model']} | {r['label']} | {r['predicted_peak_bytes'] / gib:.2f} | {nvml} | "
            f"{r['reserved_plus_context_bytes'] / gib:.2f} | {r['peak_error']:+.1%} | {r['predicted_samples_per_s']:.3g} | "
            f"{r['measured_samples_per_s']:.3g} | {r['throughput_error']:+.1%} |"
        )
    return lines


def summary(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return "no row ran"
    peak = [abs(r["peak_error"]) for r in ok]
    speed = [abs(r["throughput_error"]) for r in ok if r["throughput_error"] is not None]
    return (f"{len(ok)} of {len(rows)} rows ran: peak median |error| {statistics.median(peak):.1%}, worst "
            f"{max(peak):.1%}; throughput median |error| {statistics.median(speed):.1%}, worst {max(speed):.1%}")


#: seconds a part may run: a 10-minute command less the machine's start and the transfers
PART_BUDGET_S = 540.0
#: what a row is reckoned to take before one has run in this command (a 0.7 B probe: start, 7 steps)
FIRST_ROW_S = 150.0


@dataclass(frozen=True)
class Part:
    """One part of the benchmark: one model in one precision, its configs (the ZeRO stages)."""

    number: int
    model: str
    precision: str
    configs: tuple[Any, ...]


def parts_of(models: list[str], quick: bool) -> list[Part]:
    """The parts, numbered from 1 in model then precision order; together they are the whole grid, once."""
    parts: list[Part] = []
    for model in models:
        configs = configs_for(MODELS[model][1], quick)
        for precision in PRECISIONS:
            chosen = tuple(c for c in configs if c.precision == precision)
            parts.append(Part(len(parts) + 1, model, precision, chosen))
    return parts


def row_key(model: str, label: str) -> str:
    return f"{model}/{label}"


def load_results(path: Path, device: str, world_size: int) -> dict[str, Any]:
    """The results file as far as it goes (a new one where there is none); one line (SystemExit) where it
    was measured on another device or world size: rows of two machines never share a table."""
    if not path.exists():
        return {"device": device, "world_size": world_size, "rows": [], "pruned": []}
    try:
        results = json.loads(path.read_text())
    except ValueError as exc:
        raise SystemExit(f"cuda_accuracy: {path} is not JSON ({exc}); move it away to start again") from None
    if (results.get("device"), results.get("world_size")) != (device, world_size):
        raise SystemExit(f"cuda_accuracy: {path} holds rows of {results.get('device')} x {results.get('world_size')}, "
                         f"this is {device} x {world_size}; give another --out")
    results.setdefault("rows", [])
    results.setdefault("pruned", [])
    return results


def pending(part: Part, results: dict[str, Any], retry_failed: bool = False) -> list[Any]:
    """The part's configs the results file does not hold yet (with ``retry_failed``: nor as a success or an oom)."""
    kept = {"ok", "oom"} if retry_failed else {"ok", "oom", "error", "timeout"}
    done = {row_key(r["model"], r["label"]) for r in results["rows"] if r["status"] in kept}
    return [c for c in part.configs if row_key(part.model, c.label()) not in done]


def add_row(path: Path, results: dict[str, Any], row: dict[str, Any]) -> None:
    """Put ``row`` in the results (replacing a failed one of the same key) and write the file atomically."""
    key = row_key(row["model"], row["label"])
    results["rows"] = [r for r in results["rows"] if row_key(r["model"], r["label"]) != key] + [row]
    write_json(path, results)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def room_for_a_row(elapsed_s: float, row_walls_s: list[float], budget_s: float) -> float:
    """Seconds a next row may take within the budget (0: start none), reckoned from the slowest row so far."""
    expected = max(row_walls_s, default=FIRST_ROW_S)
    left = budget_s - elapsed_s
    return left if left >= expected else 0.0


def listing(parts: list[Part], results: dict[str, Any] | None) -> list[str]:
    lines = []
    for part in parts:
        left = len(pending(part, results)) if results is not None else len(part.configs)
        labels = ", ".join(c.label() for c in part.configs)
        lines.append(f"part {part.number}: {part.model} {part.precision}, {len(part.configs)} rows "
                     f"({len(part.configs) - left} measured): {labels}")
    return lines


def write_table(out: Path, results: dict[str, Any]) -> list[str]:
    rows, pruned = results["rows"], results["pruned"]
    lines = [f"{results['device']} x {results['world_size']} ({time.strftime('%Y-%m-%d')})", "", *table(rows), "",
             summary(rows)]
    lines += ["", "pruned:", *pruned] if pruned else []
    (out / "cuda_accuracy.md").write_text("\n".join(lines) + "\n")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds per probe.")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda"), help="Folder for the table and JSON.")
    parser.add_argument("--parts", action="store_true", help="List the parts and what each has measured; run nothing.")
    parser.add_argument("--part", type=int, action="append", default=None, metavar="K",
                        help="Run part K only (repeatable); rows the results file holds are skipped.")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"Seconds this run may take (default with --part: {PART_BUDGET_S:g}; else none).")
    parser.add_argument("--retry-failed", action="store_true", help="Re-run the error and timeout rows too.")
    args = parser.parse_args(argv)
    parts = parts_of(args.models, args.quick)
    out = Path(args.out)
    path = out / "cuda_accuracy.json"
    if args.parts:
        existing = json.loads(path.read_text()) if path.exists() else None
        print("\n".join(listing(parts, existing)))
        return 0
    unknown = sorted(set(args.part or []) - {p.number for p in parts})
    if unknown:
        print(f"cuda_accuracy: no part {unknown[0]}; there are {len(parts)} (--parts lists them)")
        return 2
    import torch

    if not torch.cuda.is_available():
        print("cuda_accuracy: no CUDA device on this machine; run it where `nvidia-smi` lists a GPU (H100/H200)")
        return 1
    from autofit.machine.device import get_hardware
    from autofit.planning.plan import trace_for
    from autofit.probe.ops import prepare_ops
    from autofit.workload.entry import load_workload

    started = time.monotonic()
    budget = args.budget if args.budget is not None else (PART_BUDGET_S if args.part else float("inf"))
    hardware, world_size = get_hardware("auto"), torch.cuda.device_count()
    device = torch.cuda.get_device_name(0)
    print(f"{device} x {world_size}, hardware {hardware.name}", flush=True)
    results = load_results(path, device, world_size)
    walls: list[float] = []
    chosen = [p for p in parts if not args.part or p.number in args.part]
    for part in chosen:
        entry, _ = MODELS[part.model]
        configs, reasons = runnable(list(part.configs), hardware, world_size)
        results["pruned"] = sorted(set(results["pruned"]) | {f"{part.model}: {line}" for line in reasons})
        configs = [c for c in configs if c in pending(part, results, args.retry_failed)]
        if not configs:
            continue
        prepare_ops(configs, hardware)
        facts = trace_for(load_workload(entry), configs)
        for config in configs:
            room = room_for_a_row(time.monotonic() - started, walls, budget)
            if room <= 0:
                print(f"cuda_accuracy: the budget ({budget:g} s) has no room for another row; run the same command "
                      "again to go on", flush=True)
                write_table(out, results)
                return 0
            row = {"model": part.model} | measure(str(ROOT / entry), config, facts, hardware, world_size,
                                                  min(args.timeout, room))
            walls.append(row["wall_s"])
            add_row(path, results, row)
            print(table([row])[-1], flush=True)
    write_json(path, results)
    lines = write_table(out, results)
    print("\n".join(lines[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
