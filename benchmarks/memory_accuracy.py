"""Predicted peak memory vs a real probe (DESIGN.md's measurement), on several architectures.

    python benchmarks/memory_accuracy.py                 # the full table (about 30-40 min on 2 cores)
    python benchmarks/memory_accuracy.py --quick         # a few configs per model
    python benchmarks/memory_accuracy.py --models benchmarks/models/vit.py:workload --json out.json

Each row: one config through ``deepspeed.initialize`` with its own JSON, CPU, world size 1,
2 steps (1 warm-up); error = (predicted - measured) / measured. Prints a markdown table and
the summary: median |error|, worst |error|, worst under-prediction.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from autofit.config import Config  # noqa: E402
from autofit.cost_model import predict  # noqa: E402
from autofit.hardware import get_hardware  # noqa: E402
from autofit.plan import trace_for  # noqa: E402
from autofit.probe import run_probe  # noqa: E402
from autofit.workload import load_workload  # noqa: E402

MODELS = [
    "examples/gpt.py:workload",
    "benchmarks/models/t5_encdec.py:workload",
    "benchmarks/models/vit.py:workload",
    "benchmarks/models/gqa_llama.py:workload",
    "benchmarks/models/moe.py:workload",
    "benchmarks/models/cnn.py:workload",
]


def configs_for(quick: bool) -> list[Config]:
    """A spread over ZeRO stage, precision, optimizer, checkpoint ratio and micro-batch."""
    if quick:
        grid = [
            (0, "fp32", "adamw", 0.0, 4),
            (1, "fp32", "adamw", 1.0, 2),
            (2, "fp32", "adamw8bit", 0.5, 4),
            (3, "fp32", "adamw", 0.0, 2),
            (0, "bf16", "adamw", 0.5, 2),
            (2, "bf16", "adamw", 0.0, 4),
        ]
    else:
        stages, precisions, optimizers, ratios = (0, 1, 2, 3), ("fp32", "bf16"), ("adamw", "adamw8bit"), (0.0, 0.5, 1.0)
        grid = [
            (z, p, o, r, 2 if (z + len(o)) % 2 else 4)
            for z, p, o, r in itertools.product(stages, precisions, optimizers, ratios)
            if (z + int(r * 2) + (p == "bf16") + (o == "adamw8bit")) % 3 == 0  # a balanced third of the grid
        ]
    return [
        Config(micro_batch_size=mb, zero_stage=z, precision=p, optimizer=o, checkpoint_ratio=r, attention="sdpa")
        for z, p, o, r, mb in grid
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    hardware = get_hardware("cpu")
    configs = configs_for(args.quick)
    rows = []
    print("| model | config | predicted MiB | measured MiB | error |")
    print("|---|---|---:|---:|---:|")
    for entry in args.models:
        workload = load_workload(entry)
        facts = trace_for(workload, configs)
        for config in configs:
            started = time.time()
            measured = run_probe(entry, config, hardware, 1, steps=1, warmup_steps=1, timeout_s=900)
            if measured.status != "ok":
                print(f"| {workload.name} | {config.label()} | - | - | {measured.status}: {measured.message} |")
                continue
            predicted = predict(config, facts, hardware, 1).peak_bytes
            error = (predicted - measured.peak_bytes) / measured.peak_bytes
            rows.append({"model": workload.name, "config": config.to_dict(), "predicted": predicted,
                         "measured": measured.peak_bytes, "error": error, "probe_s": time.time() - started})
            print(f"| {workload.name} | {config.label()} | {predicted / 2**20:.1f} | "
                  f"{measured.peak_bytes / 2**20:.1f} | {error:+.1%} |", flush=True)
    errors = [r["error"] for r in rows]
    if errors:
        print(f"\n{len(rows)} configs, {len(args.models)} models: median |error| "
              f"{statistics.median(abs(e) for e in errors):.1%}, worst |error| {max(abs(e) for e in errors):.1%}, "
              f"worst under-prediction {min(min(errors), 0):.1%}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
