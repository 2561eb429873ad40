"""Predicted vs measured on a CUDA machine: peak device memory and throughput, 4 architectures of 0.6-0.8 B.

    python benchmarks/cuda_accuracy.py                       # every model x bf16/fp8 x ZeRO 0-3
    python benchmarks/cuda_accuracy.py --quick               # ZeRO 0 and 3 only
    python benchmarks/cuda_accuracy.py --models llama t5 --out benchmarks/results/cuda

One command, unchanged on an H100 or H200: the world size is the number of GPUs present, the
hardware is detected (``--hardware auto``), fp8 rows run where the device and torchao have it (else
they are listed as pruned, with the reason). Each row is one config through a real probe (5 timed
steps after 2 warm-up): the measured peak is NVML's per-process figure (docs/design.md, "Memory, measured"), shown beside
``max_memory_reserved`` + the CUDA context; throughput is samples/s of the slowest rank. Predictions
are the uncalibrated cost model's (``Coefficients.for_hardware``). Writes ``cuda_accuracy.md``
(the table) and ``cuda_accuracy.json`` (every row, with the device's name) into ``--out``.

Without a CUDA device it prints one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: model name -> (entry, micro-batch per GPU); micro-batches sized to leave ZeRO-0 bf16 room on 80 GB
MODELS = {
    "llama": ("benchmarks/models/gpu_large.py:llama", 4),
    "gpt2": ("benchmarks/models/gpu_large.py:gpt2", 4),
    "t5": ("benchmarks/models/gpu_large.py:t5", 8),
    "vit": ("benchmarks/models/gpu_large.py:vit", 32),
}
PRECISIONS = ("bf16", "fp8")


def configs_for(micro_batch: int, quick: bool) -> list[Any]:
    from autofit.config import Config

    stages = (0, 3) if quick else (0, 1, 2, 3)
    return [
        Config(micro_batch_size=micro_batch, precision=p, zero_stage=z, optimizer="adamw", attention="sdpa")
        for p in PRECISIONS
        for z in stages
    ]


def runnable(configs: list[Any], hardware: Any, world_size: int) -> tuple[list[Any], list[str]]:
    """The configs the space's rules let run here, and one line per pruned group (fp8 below sm89 ...)."""
    from autofit.space import SearchSpace, enumerate_candidates

    keep, reasons = [], []
    for config in configs:
        values = {k: (v,) for k, v in config.to_dict().items() if k != "grad_accum_steps"}
        space = SearchSpace(name="cuda_accuracy", description="one config", values=values)
        try:
            enumerate_candidates(space, hardware=hardware, world_size=world_size, global_batch=None, fixed={},
                                 searches_attention=True)
            keep.append(config)
        except Exception as error:  # a rule refused it: say why once
            reasons.append(f"{config.label()}: {error}")
    return keep, sorted(set(reasons))


def measure(entry: str, config: Any, facts: Any, hardware: Any, world_size: int, timeout_s: float) -> dict[str, Any]:
    from autofit.cost_model import Coefficients, predict
    from autofit.probe import run_probe

    predicted = predict(config, facts, hardware, world_size, Coefficients.for_hardware(hardware))
    result = run_probe(entry, config, hardware, world_size, steps=5, warmup_steps=2, timeout_s=timeout_s,
                       hidden_size=facts.hidden_size)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds per probe.")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda"), help="Folder for the table and JSON.")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("cuda_accuracy: no CUDA device on this machine; run it where `nvidia-smi` lists a GPU (H100/H200)")
        return 1
    from autofit.hardware import get_hardware
    from autofit.plan import trace_for
    from autofit.probe.ops import prepare_ops
    from autofit.workload import load_workload

    hardware, world_size = get_hardware("auto"), torch.cuda.device_count()
    device = torch.cuda.get_device_name(0)
    print(f"{device} x {world_size}, hardware {hardware.name}", flush=True)
    rows: list[dict[str, Any]] = []
    pruned: list[str] = []
    for name in args.models:
        entry, micro_batch = MODELS[name]
        configs, reasons = runnable(configs_for(micro_batch, args.quick), hardware, world_size)
        pruned += [f"{name}: {line}" for line in reasons]
        prepare_ops(configs, hardware)
        facts = trace_for(load_workload(entry), configs)
        for config in configs:
            row = {"model": name} | measure(str(ROOT / entry), config, facts, hardware, world_size, args.timeout)
            rows.append(row)
            print(table([row])[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{device} x {world_size} ({time.strftime('%Y-%m-%d')})", "", *table(rows), "", summary(rows)]
    lines += ["", "pruned:", *pruned] if pruned else []
    (out / "cuda_accuracy.md").write_text("\n".join(lines) + "\n")
    (out / "cuda_accuracy.json").write_text(json.dumps({"device": device, "world_size": world_size,
                                                        "hardware": hardware.to_dict(), "rows": rows,
                                                        "pruned": pruned}, indent=1))
    print("\n".join(lines[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
