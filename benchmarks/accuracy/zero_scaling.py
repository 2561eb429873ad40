"""Per-rank memory of ZeRO 0-3 at world size 1 and 2 on the CPU: predicted vs measured.

    python -m benchmarks.accuracy.zero_scaling [--model examples/gpt.py:workload] [--micro-batch 2]

World size 2 runs two gloo ranks on loopback (real sharding and communication); each
rank's peak is measured as docs/design.md ("Memory, measured") says. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from autofit.core.config import Config
from autofit.cost_model import predict
from autofit.machine.device import get_hardware
from autofit.planning.plan import trace_for
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec
from autofit.workload.entry import load_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="examples/gpt.py:workload")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--optimizer", default="adamw")
    args = parser.parse_args()
    hardware = get_hardware("cpu")
    workload = load_workload(args.model)
    configs = [Config(micro_batch_size=args.micro_batch, zero_stage=z, optimizer=args.optimizer) for z in (0, 1, 2, 3)]
    facts = trace_for(workload, configs)
    print(f"{workload.name}: {facts.n_params / 1e6:.2f} M parameters, fp32 {args.optimizer}, micro-batch {args.micro_batch}\n")
    print("| ZeRO | ranks | predicted MiB/rank | measured MiB/rank (each rank) | error |")
    print("|---|---:|---:|---|---:|")
    for world_size in (1, 2):
        for config in configs:
            spec = probe_spec(args.model, config, hardware, world_size, steps=1, warmup_steps=1)
            measured = run_probe(spec, timeout_s=900)
            if measured.status != "ok":
                print(f"| {config.zero_stage} | {world_size} | - | {measured.status}: {measured.message} | - |")
                continue
            predicted = predict(config, facts, hardware, world_size).peak_bytes
            ranks = ", ".join(f"{b / 2**20:.1f}" for b in measured.per_rank_peak_bytes)
            error = (predicted - measured.peak_bytes) / measured.peak_bytes
            print(f"| {config.zero_stage} | {world_size} | {predicted / 2**20:.1f} | {ranks} | {error:+.1%} |",
                  flush=True)


if __name__ == "__main__":
    main()
