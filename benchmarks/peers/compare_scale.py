"""How ``autofit estimate``'s planning time grows: with the number of candidates, and with model size.

    python -m benchmarks.peers.compare_scale                   # both series (about 10 min on 2 cores)
    python -m benchmarks.peers.compare_scale --series candidates --sizes 1b,7b

Times the library functions ``autofit estimate`` runs (``autofit.planning.plan.Plan.make``: enumerate the space's
candidates and trace the model on fake tensors; ``autofit.planning.estimate.estimate``: price and rank every candidate,
each with its DeepSpeed JSON):

- **candidates**: the example GPT (``examples/gpt.py``; pricing a candidate costs the same whatever the model,
  the trace is what grows with it) on ``h100-80gb`` x 8, the space grown one
  dimension at a time from micro-batch alone to ``search_spaces/default.yaml`` and past it (accumulation
  1-8, micro-batch up to 128, checkpoint ratios in fifths): ~100,000 candidates. The trace is done once
  and timed apart; each step's "enumerate + price" is ``estimate(Plan.make(..., facts=traced))``, median of
  :data:`REPEATS` (one run past 50,000 configs).
- **model size**: LLaMA shapes from 1.1 B to 69 B parameters (random weights, never allocated), the whole
  ``estimate`` (trace included) over ``search_spaces/single_gpu.yaml`` with ``--set precision=bf16
  attention=sdpa`` on ``h100-80gb`` x 8, global batch 256; each size in its own process, so its peak RSS is its own.

Writes ``compare_scale.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from autofit.core.space import enumerate_candidates, load_space, space_from_dict
from autofit.machine.device import get_hardware
from autofit.machine.software import detect_software
from autofit.planning.estimate import estimate
from autofit.planning.plan import Plan, trace_for
from autofit.workload.entry import load_workload
from autofit.workload.types import Workload
from benchmarks import common as cc

HARDWARE = "h100-80gb"
WORLD_SIZE = 8
REPEATS = 3
#: (name, dimensions added to the space at this step); the steps are cumulative
LADDER: list[tuple[str, dict[str, list[Any]]]] = [
    ("micro-batch", {"micro_batch_size": [1, 2, 4, 8, 16, 32, 64]}),
    ("+ checkpoint ratio", {"checkpoint_ratio": [0.0, 0.25, 0.5, 0.75, 1.0]}),
    ("+ precision", {"precision": ["fp32", "bf16", "fp16", "fp8"]}),
    ("+ optimizer", {"optimizer": ["adamw", "adamw8bit", "lion", "adafactor", "sgd"]}),
    ("+ ZeRO stage", {"zero_stage": [0, 1, 2, 3]}),
    ("+ offload (optimizer, params)", {"offload_optimizer": ["none", "cpu", "nvme"], "offload_params": ["none", "cpu", "nvme"]}),
    ("+ attention (= default.yaml)", {"attention": ["eager", "sdpa", "flash"]}),
    ("+ accumulation 1-8", {"grad_accum_steps": [1, 2, 4, 8]}),
    ("+ micro-batch 128, ckpt in fifths", {"micro_batch_size": [1, 2, 4, 8, 16, 32, 64, 128],
                                           "checkpoint_ratio": [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]}),
]
#: LLaMA shapes: hidden, layers, intermediate, heads, kv heads (TinyLlama 1.1B, LLaMA-2 7B/13B, LLaMA-1 33B, LLaMA-2 70B)
SIZES = {
    "1b": (2048, 22, 5632, 32, 4),
    "7b": (4096, 32, 11008, 32, 32),
    "13b": (5120, 40, 13824, 40, 40),
    "33b": (6656, 60, 17920, 52, 52),
    "70b": (8192, 80, 28672, 64, 8),
}
VOCAB_SIZE, SEQ_LEN = 32000, 2048
#: ``--set`` for the size series: one precision and kernel, so one trace per checkpoint ratio (the other
#: dimensions of the space stay open)
SIZE_FIXED = {"precision": "bf16", "attention": "sdpa"}


def ladder_spaces() -> list[tuple[str, Any]]:
    """The cumulative spaces of :data:`LADDER`; keys not yet added take the Config default."""
    data: dict[str, Any] = {"description": "compare_scale ladder", "global_batch_size": None}
    out = []
    for name, added in LADDER:
        data = data | added
        out.append((name, space_from_dict(data, name=f"ladder-{len(out)}")))
    return out


def candidate_series(entry: str = "examples/gpt.py:workload") -> list[dict[str, Any]]:
    """Trace once (timed), then for each ladder space the median time of ``estimate`` given the trace."""
    hardware, workload = get_hardware(HARDWARE), load_workload(entry)
    spaces = ladder_spaces()
    largest = spaces[-1][1]
    every = enumerate_candidates(largest, software=detect_software(),
                                 hardware=hardware, world_size=WORLD_SIZE, global_batch=None, fixed={},
                                 searches_attention=workload.searches_attention).candidates
    t0 = time.monotonic()
    facts = trace_for(workload, every)
    trace_s = time.monotonic() - t0
    rows = []
    for name, space in spaces:
        times, n = [], 0
        for _ in range(REPEATS if space.size() < 50_000 else 1):
            t1 = time.monotonic()
            result = estimate(Plan.make(entry, workload, hardware, space, world_size=WORLD_SIZE, facts=facts))
            times.append(time.monotonic() - t1)
            n = len(result.candidates)
        rows.append({"step": name, "space_size": space.size(), "candidates": n, "dimensions": sum(len(v) > 1 for v in
                     space.values.values()) + (len(space.grad_accum_steps) > 1), "price_s": statistics.median(times),
                     "price_s_all": times, "trace_s": trace_s, "us_per_candidate": 1e6 * statistics.median(times) / n})
        print(f"  {name}: {n} candidates, {rows[-1]['price_s']:.2f} s", file=sys.stderr, flush=True)
    return rows


def llama_workload(size: str) -> Workload:
    hidden, layers, intermediate, heads, kv_heads = SIZES[size]

    def build(attention: str = "sdpa") -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate, num_attention_heads=heads,
            num_key_value_heads=kv_heads, vocab_size=VOCAB_SIZE, max_position_embeddings=SEQ_LEN,
            attn_implementation=attention if attention != "flash" else "flash_attention_2",
        ))

    def batch(n: int) -> Any:
        import torch

        ids = torch.randint(0, VOCAB_SIZE, (n, SEQ_LEN))
        return {"input_ids": ids, "labels": ids}

    return Workload(model=build, batch=batch, tokens_per_sample=SEQ_LEN, name=f"llama-{size}")


def one_size(size: str) -> dict[str, Any]:
    """The whole ``autofit estimate`` for one LLaMA size, in this process (see :func:`size_series`)."""
    hardware = get_hardware(HARDWARE)
    t0 = time.monotonic()
    result = estimate(Plan.make(f"llama-{size}", llama_workload(size), hardware, load_space("single_gpu"),
                                world_size=WORLD_SIZE, global_batch=256, fixed=SIZE_FIXED))
    wall_s = time.monotonic() - t0
    assert result.facts is not None
    return {"size": size, "params": result.facts.n_params, "candidates": len(result.candidates),
            "fitting": len(result.fitting), "estimate_s": wall_s,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def one_size_in_child(size: str) -> dict[str, Any]:
    """:func:`one_size` in a child process of this script (``--one-size``), so peak RSS is that size's own."""
    out = subprocess.run([sys.executable, __file__, "--one-size", size], check=True, capture_output=True,
                         text=True, env=os.environ | {"PYTHONPATH": str(cc.ROOT)}, cwd=cc.ROOT)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  {size}: {row}", file=sys.stderr, flush=True)
    return row


def markdown(data: dict[str, list[dict[str, Any]]]) -> str:
    parts = []
    if data.get("candidates"):
        rows = data["candidates"]
        parts += [f"Candidates (examples/gpt.py, {HARDWARE} x {WORLD_SIZE}; its trace, done once: {rows[0]['trace_s']:.1f} s):", "",
                  cc.markdown_table(["space", "dimensions", "configs before rules", "candidates priced", "enumerate + price s",
                                     "µs per candidate"],
                                    [[r["step"], r["dimensions"], f"{r['space_size']:,}", f"{r['candidates']:,}",
                                      f"{r['price_s']:.2f}", f"{r['us_per_candidate']:.0f}"] for r in rows]), ""]
    if data.get("sizes"):
        title = (f"Model size (whole `estimate`, trace included; `single_gpu.yaml` with bf16 and sdpa fixed, {HARDWARE} x "
                 f"{WORLD_SIZE}, global batch 256):")
        parts += [title, "",
                  cc.markdown_table(["model", "parameters", "candidates", "fit 80 GB", "estimate s", "peak RSS MiB"],
                                    [[r["size"], f"{r['params'] / 1e9:.2f} B", f"{r['candidates']:,}", f"{r['fitting']:,}",
                                      f"{r['estimate_s']:.1f}", f"{r['peak_rss_bytes'] / cc.MIB:.0f}"] for r in data["sizes"]])]
    return "\n".join(parts)


def chart(data: dict[str, list[dict[str, Any]]]) -> Any:
    fig, axes = cc.new_figure(2, width=5.5, height=4.0)
    left, right = axes[0]
    if data.get("candidates"):
        rows = data["candidates"]
        left.loglog([r["candidates"] for r in rows], [r["price_s"] for r in rows], "o-", label="enumerate + price")
        left.axhline(rows[0]["trace_s"], color="grey", ls="--", label="trace (once)")
        left.set(xlabel="candidates priced", ylabel="seconds", title="autofit estimate vs space size")
        left.legend(fontsize=8)
    if data.get("sizes"):
        rows = data["sizes"]
        right.plot([r["params"] / 1e9 for r in rows], [r["estimate_s"] for r in rows], "o-", label="estimate s")
        right.set(xlabel="parameters (billions, fake tensors)", ylabel="seconds", title="autofit estimate vs model size")
        twin = right.twinx()
        twin.plot([r["params"] / 1e9 for r in rows], [r["peak_rss_bytes"] / cc.MIB for r in rows], "s--", color="tab:red")
        twin.set_ylabel("peak RSS (MiB)", color="tab:red")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", default="candidates,sizes")
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--out-dir", type=cc.Path, default=cc.RESULTS)
    parser.add_argument("--one-size", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--render-only", action="store_true", help="re-draw the table and chart from --out-dir's JSON")
    args = parser.parse_args()
    os.chdir(cc.ROOT)
    if args.one_size:
        print(json.dumps(one_size(args.one_size)))
        return
    series = args.series.split(",")
    if args.render_only:
        data = json.loads((args.out_dir / "compare_scale.json").read_text())
        cc.write_results("compare_scale", data, markdown(data), chart(data), args.out_dir)
        return
    # written after every step: a long run that is stopped keeps what it measured
    data: dict[str, list[dict[str, Any]]] = {"candidates": candidate_series() if "candidates" in series else [], "sizes": []}
    cc.write_results("compare_scale", data, markdown(data), chart(data), args.out_dir)
    for size in args.sizes.split(",") if "sizes" in series else []:
        data["sizes"].append(one_size_in_child(size))
        cc.write_results("compare_scale", data, markdown(data), chart(data), args.out_dir)


if __name__ == "__main__":
    main()
