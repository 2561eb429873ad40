"""What a real probe costs before its first step: process start, imports, model build, deepspeed.initialize.

    python -m benchmarks.probe.probe_overhead [--models mlp,gpt] [--steps 3]

Runs one real CPU probe (fp32, AdamW, ZeRO-0, world size 1) of each model in
benchmarks/probe/probe_models.py and prints a markdown table of the phases, as the
probe's rank 0 measured them, next to the median step time and the wall time
the caller saw. Run it once before to let DeepSpeed JIT-build its op (cached).
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from autofit.core.config import Config  # noqa: E402
from autofit.core.units import format_bytes  # noqa: E402
from autofit.machine.device import get_hardware  # noqa: E402
from autofit.probe.run import run_probe  # noqa: E402
from autofit.probe.spec import probe_spec  # noqa: E402

MODELS_FILE = Path(__file__).resolve().parent / "probe_models.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,gpt", help="comma-separated names from probe_models.py")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage")
    args = parser.parse_args()
    from benchmarks.probe.probe_models import MODELS

    print("| model | start s | imports s | build s | ds.initialize s | overhead s | step s | wall s | peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        config = Config(micro_batch_size=MODELS[name], zero_stage=args.zero)
        r = run_probe(probe_spec(f"{MODELS_FILE}:{name}", config, get_hardware("cpu"), steps=args.steps), timeout_s=600)
        p = r.phases_s
        if r.status != "ok":
            print(f"| {name} | {r.status}: {r.message} |")
            continue
        print(
            f"| {name} | {p.get('process_start_s', 0):.2f} | {p.get('imports_s', 0):.2f} "
            f"| {p.get('model_build_s', 0):.2f} | {p.get('initialize_s', 0):.2f} "
            f"| {r.overhead_s:.2f} | {r.step_time_s:.3f} | {r.wall_s:.1f} | {format_bytes(r.peak_bytes)} |"
        )


if __name__ == "__main__":
    main()
