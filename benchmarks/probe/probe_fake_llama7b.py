"""Fake-mode probe of a 7B LLaMA-shaped model at full size, on a machine far too small for it.

    python -m benchmarks.probe.probe_fake_llama7b [--seq 2048] [--micro 1] [--set key=value ...]

Builds ``transformers.LlamaForCausalLM(LlamaConfig(hidden_size=4096,
intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
vocab_size=32000))`` under ``FakeTensorMode`` (no weight is allocated), runs one
forward/backward with the config's precision, optimizer, checkpointing and ZeRO
sharding, and prints a markdown table: the simulated device peak, its breakdown,
and the wall time.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from autofit.core.config import Config, parse_set
from autofit.core.units import format_bytes
from autofit.machine.device import get_hardware

SEQ = int(os.environ.get("AUTOFIT_BENCH_SEQ", "2048"))


def llama7b():  # the entry point the probe loads (AUTOFIT_BENCH_SEQ sets the sequence length)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import autofit

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000
    )

    def model(attention: str = "sdpa") -> torch.nn.Module:
        config._attn_implementation = attention
        return LlamaForCausalLM(config)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 32000, (n, SEQ))
        return {"input_ids": ids, "labels": ids}

    return autofit.Workload(
        model=model, batch=batch, layers=lambda m: m.model.layers, tokens_per_sample=SEQ, name="llama-7b"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (tokens per sample)")
    parser.add_argument("--micro", type=int, default=1, help="micro-batch size")
    parser.add_argument("--gpus", type=int, default=1, help="world size the ZeRO sharding is simulated for")
    parser.add_argument("--hardware", default="h100-80gb", help="device whose context is added (a preset, or cpu)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="fix a config key, e.g. --set precision=bf16 (default: bf16, adamw, ckpt 1.0, ZeRO 0)",
    )
    args = parser.parse_args()
    os.environ["AUTOFIT_BENCH_SEQ"] = str(args.seq)
    from autofit.probe.run import run_probe
    from autofit.probe.spec import probe_spec

    values = {"precision": "bf16", "checkpoint_ratio": 1.0, "attention": "sdpa"} | parse_set(args.set)
    config = Config.from_dict(values | {"micro_batch_size": args.micro})
    t0 = time.time()
    spec = probe_spec(f"{Path(__file__).resolve()}:llama7b", config, get_hardware(args.hardware), args.gpus, mode="fake")
    result = run_probe(spec, timeout_s=1800)
    wall = time.time() - t0
    print("| config | world | status | peak | breakdown | wall s | simulate s |")
    print("|---|---|---|---|---|---|---|")
    sim = result.phases_s.get("steps_s", 0.0) + result.phases_s.get("initialize_s", 0.0)
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in result.breakdown.items())
    if result.status != "ok":
        parts = str(result.message)
    print(
        f"| {config.label()} seq{args.seq} | {args.gpus} | {result.status} | {format_bytes(result.peak_bytes)} "
        f"| {parts} | {wall:.1f} | {sim:.1f} |"
    )


if __name__ == "__main__":
    main()
