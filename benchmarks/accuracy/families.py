"""Model families used nowhere else in the project, planned at full size and probed small (issue 39).

Each family's published ``config.json`` is in ``benchmarks/models/families/<name>/`` (transcribed from the Hugging Face
model page in :data:`FAMILIES`). For each:

- **The plain command first**: ``autofit estimate hf:FOLDER`` on 8 H100-80GB at ``--seq-len 2048``, global batch 64,
  nothing fixed (the default space, attention kernel and length handling a new user meets), traced cold: planned or
  refused in one line, its wall time against :data:`PLAIN_GOAL_S`.
- **Full size**: ``autofit estimate`` on 8 H100-80GB at ``--seq-len 2048``, global batch 64, one layout fixed
  (bf16 AdamW, ZeRO-3, micro-batch 1, every layer checkpointed) and the attention kernel left to the plan: the
  parameter count against the published one, the wall time and the kernel chosen (the fastest that fits among
  those the model's class can be built with, ``autofit/workload/hf_tasks.py``).
- **A small copy** (the same architecture: 2 layers, hidden 256, a few experts; 512 tokens) probed on this CPU at two configs,
  ZeRO-0 without checkpointing and ZeRO-2 with it (a mixture of experts at ZeRO-2 and ZeRO-3, both checkpointed):
  predicted against measured peak. Each config is probed ``--repeats`` times (3), each a fresh process that
  measures the model's CPU footprint again: the median run is the config's figure and every run is kept (until the
  probe mapped every allocation of a page or more, a model whose activations came from glibc's heap, the Mamba
  copy, moved by 12 MiB from process to process; docs/results/families.md).

Usage: ``python -m benchmarks.accuracy.families [--only NAME,...] [--workers 2] [--repeats 3] [--probes-only | --plans-only]``;
writes ``benchmarks/results/families.json`` and ``families.md``. ``--probes-only`` probes the small copies again and
keeps each family's plans as the last results file has them; ``--plans-only`` plans again and keeps the probes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "benchmarks" / "models" / "families"
RESULTS = ROOT / "benchmarks" / "results"
HF = "https://huggingface.co"
#: the plain command a user types first: nothing fixed, traced cold (the wall time is a first plan's)
PLAIN = ("--hardware", "h100-80gb", "--gpus", "8", "--seq-len", "2048", "--global-batch", "64", "--no-cache")
#: the plain command's goal on the 2-core machine, cold (issue 52)
PLAIN_GOAL_S = 60.0
#: the full-size plan: one layout, the kernel left to the plan, traced cold
FULL = (*PLAIN, "--set", "micro_batch_size=1", "--set", "zero_stage=3", "--set", "checkpoint_ratio=1.0",
        "--set", "precision=bf16", "--set", "compile=off", "--set", "offload_optimizer=none",
        "--set", "offload_params=none", "--set", "overlap_comm=true", "--set", "bucket_scale=1",
        "--set", "contiguous_gradients=true", "--set", "checkpoint_granularity=block")
#: the small copies' probes: one CPU rank, fp32 AdamW, 512 tokens, micro-batch 2
PROBE = ("--hardware", "cpu", "--seq-len", "512", "--global-batch", "2", "--set", "micro_batch_size=2",
         "--set", "compile=off", "--set", "offload_optimizer=none", "--set", "offload_params=none", "--steps", "2")
#: what every small copy shares: two layers of width 256 (2-3.4 M parameters; peaks of 120-310 MiB at 512 tokens)
SMALL = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "head_dim": 64, "vocab_size": 4096, "pad_token_id": 0, "layer_types": None}
#: this machine is a CPU; nothing else set: the commands run as a user types them
ENV = {"DS_ACCELERATOR": "cpu"}
#: where families run side by side (``--workers`` over 1): one trace process per command, or they fight for cores
SIDE_BY_SIDE = {"AUTOFIT_TRACE_WORKERS": "1"}
#: a full-size step of the reference scan runs minutes (autofit/trace/step.py): refused after this many seconds
SLOW_STEP_S = "60"


@dataclass(frozen=True)
class Family:
    """One published model of a family, and how its small copy differs from :data:`SMALL`."""

    name: str
    """Its folder under :data:`MODELS`."""
    repo: str
    """The Hugging Face repository whose ``config.json`` it is."""
    published_params: float
    """The parameter count the model page gives (its safetensors' "Model size")."""
    small: dict[str, Any] = field(default_factory=dict)
    """The small copy's own values beside :data:`SMALL` (None: drop the key)."""
    moe: bool = False
    """A mixture of experts: probed at ZeRO-2 and ZeRO-3."""


FAMILIES = (
    Family("gemma2-9b", "google/gemma-2-9b-it", 9.24e9,
           {"num_key_value_heads": 2, "query_pre_attn_scalar": 64, "sliding_window": 128}),
    Family("starcoder2-3b", "bigcode/starcoder2-3b", 3.03e9, {"num_key_value_heads": 2}),
    Family("falcon-7b", "tiiuae/falcon-7b", 7.22e9, {"head_dim": None, "ffn_hidden_size": 512, "num_kv_heads": 4}),
    Family("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 30.5e9,
           {"num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
           moe=True),
    Family("phi-3-mini-4k", "microsoft/Phi-3-mini-4k-instruct", 3.82e9, {"num_key_value_heads": 4}),
    Family("olmo-2-7b", "allenai/OLMo-2-1124-7B", 7.30e9, {"num_key_value_heads": 4}),
    Family("granite-3.0-2b", "ibm-granite/granite-3.0-2b-base", 2.53e9, {"num_key_value_heads": 2}),
    Family("stablelm-2-1.6b", "stabilityai/stablelm-2-1_6b", 1.64e9, {"num_key_value_heads": 4, "head_dim": None}),
    Family("command-r-35b", "CohereForAI/c4ai-command-r-v01", 35.0e9, {"num_key_value_heads": 4}),
    Family("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", 15.7e9,
           {"num_key_value_heads": 4, "head_dim": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "moe_intermediate_size": 64}, moe=True),
    Family("mamba-130m", "state-spaces/mamba-130m-hf", 129e6,
           {"num_attention_heads": None, "head_dim": None, "intermediate_size": None, "state_size": 8,
            "time_step_rank": 4}),
    Family("smollm3-3b", "HuggingFaceTB/SmolLM3-3B", 3.08e9, {"num_key_value_heads": 2, "no_rope_layer_interval": 2}),
    Family("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924", 6.92e9,
           {"num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
           moe=True),
)


def autofit(*args: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any] | None, str, float]:
    """``autofit ARGS --json`` in a fresh process: its JSON (None where it failed), its last stderr line, seconds."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", "from autofit.cli import main; main()", *args, "--json"],
                          capture_output=True, text=True, cwd=ROOT, env=ENV | os.environ | (env or {}))
    lines = [line for line in done.stderr.splitlines() if line.startswith("autofit")]
    out = json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else None
    return out, (lines[-1] if lines else ""), time.perf_counter() - started


def parameters(folder: Path) -> int:
    """The model's parameters, from a build on the meta device."""
    import torch

    from autofit.workload.hf import hf_workload

    with torch.device("meta"):
        model = hf_workload(str(folder), seq_len=8).build_model()
    return sum(p.numel() for p in model.parameters())


def full_size(family: Family) -> dict[str, Any]:
    """The full-size plans of ``family``: the plain command's (:func:`plain_plan`), then the fixed layout's:
    parameters, wall time, the kernel chosen (or the one line that refused)."""
    folder = MODELS / family.name
    plain = plain_plan(folder)
    out, line, seconds = autofit("estimate", f"hf:{folder}", *FULL, env={"AUTOFIT_TRACE_STEP_S": SLOW_STEP_S})
    row: dict[str, Any] = {"params": parameters(folder), "published_params": family.published_params,
                           "source": f"{HF}/{family.repo}/blob/main/config.json", "plain": plain,
                           "plan_s": round(seconds, 1)}
    if out is None:
        return row | {"refused": line}
    best = _best(out)
    return row | {"kernel": best["config"].get("attention", "none (no attention)"),
                  "kernels": out["attention"]["kernels"], "kernel_note": out["attention"]["note"],
                  "peak_gib": round(best["predicted"]["peak_bytes"] / 2**30, 2), "fits": best["fits"],
                  "attention_traces": out["attention_traces"]}


def plain_plan(folder: Path) -> dict[str, Any]:
    """``autofit estimate hf:FOLDER`` with nothing fixed (:data:`PLAIN`): its wall time and the fastest config that
    fits, or the one line that refused it."""
    out, line, seconds = autofit("estimate", f"hf:{folder}", *PLAIN)
    row: dict[str, Any] = {"plan_s": round(seconds, 1), "within_goal": seconds <= PLAIN_GOAL_S}
    if out is None:
        return row | {"refused": line}
    best = _best(out)
    return row | {"config": best["config"], "fits": best["fits"], "n_fitting": sum(c["fits"] for c in out["candidates"]),
                  "n_candidates": len(out["candidates"]), "peak_gib": round(best["predicted"]["peak_bytes"] / 2**30, 2),
                  "tokens_per_s": best["predicted"]["tokens_per_s"], "attention_traces": out["attention_traces"]}


def _best(out: dict[str, Any]) -> dict[str, Any]:
    """The estimate's fastest fitting candidate (its first), else its first."""
    fitting = [c for c in out["candidates"] if c["fits"]]
    return fitting[0] if fitting else out["candidates"][0]


def small_copy(family: Family, where: Path) -> Path:
    """``family``'s config shrunk to :data:`SMALL` (and its own values), written to a folder under ``where``."""
    config = json.loads((MODELS / family.name / "config.json").read_text())
    for key, value in (SMALL | family.small).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    folder = where / family.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def probes(family: Family, folder: Path, repeats: int) -> list[dict[str, Any]]:
    """The small copy probed at its two configs, each ``repeats`` times (a fresh ``autofit probe`` each: the
    prediction's CPU footprint is measured again in each, :mod:`autofit.probe.footprint`): predicted against
    measured peak, the median run's and every run's."""
    layouts = ([(2, 1.0), (3, 1.0)] if family.moe else [(0, 0.0), (2, 1.0)])
    rows = []
    for zero, ratio in layouts:
        row: dict[str, Any] = {"zero_stage": zero, "checkpoint_ratio": ratio, "runs": []}
        for _ in range(repeats):
            out, line, seconds = autofit("probe", f"hf:{folder}", *PROBE, "--set", f"zero_stage={zero}",
                                         "--set", f"checkpoint_ratio={ratio}")
            if out is None or out["status"] != "ok":
                row["runs"].append({"error": line or (out or {}).get("message"), "probe_s": round(seconds, 1)})
                continue
            measured, predicted = out["peak_bytes"], out["predicted"]["peak_bytes"]
            row["runs"].append({"attention": out["config"]["attention"], "measured_bytes": measured,
                                "predicted_bytes": predicted, "probe_s": round(seconds, 1),
                                "error_pct": round(100 * (predicted / measured - 1), 2)})
        rows.append(row | _median_run(row["runs"]))
    return rows


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median error (of those that ran; the first error where none did)."""
    ran = sorted((r for r in runs if "error_pct" in r), key=lambda r: r["error_pct"])
    if not ran:
        return {"error": runs[0]["error"]}
    keys = ("attention", "measured_bytes", "predicted_bytes", "error_pct")
    return {key: ran[(len(ran) - 1) // 2][key] for key in keys}


def run_family(family: Family, where: Path, repeats: int, full: dict[str, Any] | None = None,
               probed: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``family`` planned at full size and its small copy probed (``full``, ``probed``: as an earlier run left them)."""
    print(f"{family.name}: {'kept its full-size plans' if full else 'planning at full size'}, "
          f"{'kept its probes' if probed else 'probing a small copy'}", file=sys.stderr, flush=True)
    return {"name": family.name, "moe": family.moe, "full": full or full_size(family),
            "probes": probed or probes(family, small_copy(family, where), repeats)}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst |error|, and the worst under-prediction, over every config's median run; the worst of every
    single run beside them."""
    errors = [p["error_pct"] for r in rows for p in r["probes"] if "error_pct" in p]
    runs = [run["error_pct"] for r in rows for p in r["probes"] for run in p.get("runs", [p]) if "error_pct" in run]
    if not errors:
        return {}
    return {"n_configs": len(errors), "n_probes": len(runs),
            "median_abs_error_pct": round(statistics.median(abs(e) for e in errors), 2),
            "worst_abs_error_pct": round(max(abs(e) for e in errors), 2), "worst_under_pct": round(min(errors), 2),
            "single_runs": {"worst_over_pct": round(max(runs), 2), "worst_under_pct": round(min(runs), 2)}}


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the results page."""
    lines = ["| family | params (published) | plain command | fixed layout | kernel | small copy: predicted vs measured |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        full = r["full"]
        params = f"{full['params'] / 1e9:.2f} B ({full['published_params'] / 1e9:.2f} B)"
        plain = _plain_cell(full.get("plain"))
        kernel = full.get("kernel") or f"refused: {full.get('refused', '')}"
        probed = "; ".join(
            f"ZeRO-{p['zero_stage']}{' ckpt' if p['checkpoint_ratio'] else ''} "
            + (f"{p['predicted_bytes'] / 2**20:.1f} vs {p['measured_bytes'] / 2**20:.1f} MiB ({p['error_pct']:+.1f}%"
               + _spread(p) + ")" if "error_pct" in p else f"error: {p.get('error')}") for p in r["probes"])
        lines.append(f"| [{r['name']}]({full['source']}) | {params} | {plain} | {full['plan_s']:.0f} s | {kernel} "
                     f"| {probed} |")
    return "\n".join(lines) + "\n"


def _plain_cell(plain: dict[str, Any] | None) -> str:
    """The plain command's cell: planned (its time, the fastest fitting config) or refused (its line)."""
    if plain is None:
        return "not run"
    took = f"{plain['plan_s']:.0f} s" + ("" if plain["within_goal"] else f" (over {PLAIN_GOAL_S:.0f} s)")
    if "refused" in plain:
        return f"{took}, refused: {plain['refused']}"
    config = plain["config"]
    label = (f"mb{config['micro_batch_size']}x{config['grad_accum_steps']} z{config['zero_stage']} "
             f"ckpt{config['checkpoint_ratio']:g} {config.get('attention', 'no attention')}")
    return f"{took}, plans: {label}" + ("" if plain["fits"] else " (nothing fits)")


def _spread(probe: dict[str, Any]) -> str:
    """``; runs -0.4..+0.2%`` where the config ran more than once."""
    errors = sorted(run["error_pct"] for run in probe.get("runs", []) if "error_pct" in run)
    return f"; runs {errors[0]:+.1f}..{errors[-1]:+.1f}%" if len(errors) > 1 else ""


def _at_least_one(text: str) -> int:
    """``--repeats``: a whole number of probes, one or more (argparse's one line otherwise)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of probes (1 or more)")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated family names (default: all)")
    parser.add_argument("--workers", type=int, default=2, help="families run at once")
    parser.add_argument("--repeats", type=_at_least_one, default=3,
                        help="probes of each config, each a fresh process (its footprint measured again): the median "
                             "run is reported, every run kept")
    kept = parser.add_mutually_exclusive_group()
    kept.add_argument("--probes-only", action="store_true",
                      help="probe the small copies only; keep the full-size plans of the last results file")
    kept.add_argument("--plans-only", action="store_true",
                      help="plan at full size only; keep the small copies' probes of the last results file")
    args = parser.parse_args()
    chosen = [f for f in FAMILIES if not args.only or f.name in args.only.split(",")]
    last = {r["name"]: r for r in json.loads((RESULTS / "families.json").read_text())["rows"]} \
        if args.probes_only or args.plans_only else {}
    plans = {name: r["full"] for name, r in last.items()} if args.probes_only else {}
    probed = {name: r["probes"] for name, r in last.items()} if args.plans_only else {}
    started = time.perf_counter()
    if args.workers > 1:
        ENV.update(SIDE_BY_SIDE)
    with tempfile.TemporaryDirectory() as where, ThreadPoolExecutor(args.workers) as pool:
        rows = list(pool.map(lambda f: run_family(f, Path(where), args.repeats, plans.get(f.name), probed.get(f.name)),
                             chosen))
    result = {"rows": rows, "summary": summary(rows), "total_s": round(time.perf_counter() - started, 1),
              "setup": {"plain": " ".join(PLAIN), "full": " ".join(FULL), "probe": " ".join(PROBE), "repeats": args.repeats}}
    RESULTS.mkdir(exist_ok=True)
    if args.only and (RESULTS / "families.json").is_file():  # the others as the last full run left them
        kept = json.loads((RESULTS / "families.json").read_text())["rows"]
        ran = {r["name"]: r for r in rows}
        rows = [ran.pop(r["name"], r) for r in kept] + list(ran.values())
        result |= {"rows": rows, "summary": summary(rows)}
    (RESULTS / "families.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "families.md").write_text(table(rows) + f"\n{json.dumps(result['summary'])}\n")
    print(table(rows), json.dumps(result["summary"]), f"{result['total_s']:.0f} s", sep="\n")


if __name__ == "__main__":
    main()
