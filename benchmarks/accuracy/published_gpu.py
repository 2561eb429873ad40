"""The prior against published GPU training throughput: what ``autofit estimate`` predicts (no probe) for the
configuration a published run used, beside the throughput that run measured.

    python -m benchmarks.accuracy.published_gpu                       # every row; writes published_gpu_rows.json
    python -m benchmarks.accuracy.published_gpu --label before --out /tmp/before.json   # one column only
    python -m benchmarks.accuracy.published_gpu --merge before.json after.json        # both columns into the results

Each row is one published measurement: the model (its shape rebuilt with Hugging Face ``transformers`` on the
meta device, never allocated), the GPU and how many, the micro-batch, the accumulation and the activation
checkpointing the run used, and the tokens per second per GPU it reports, with its source (URL and table).
autofit prices that configuration with the device's prior coefficients (:meth:`Coefficients.for_hardware`), as
``autofit estimate`` does: bf16, AdamW, ZeRO-3 (what FSDP's ``FULL_SHARD`` shards: parameters, gradients and
optimizer states), the same micro-batch, accumulation and checkpointed layers; where the knobs exist, with
``overlap_comm`` off and on and buckets 1x and 4x, the fastest predicted of them (what ``autofit estimate``
picks with the rest fixed; FSDP overlaps its collectives with compute, and an expert's DeepSpeed JSON turns
``overlap_comm`` on). 8 GPUs a node, as every source ran them.

error = (predicted - published) / published, on tokens/s per GPU. Nothing here is fitted to these rows.

None of these sources publishes memory next to its throughput, so there is no memory column.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from autofit.core.config import CONFIG_KEYS, Config
from autofit.core.hardware import Hardware
from autofit.cost_model import Coefficients, predict
from autofit.machine.device import get_hardware
from autofit.planning.plan import trace_for
from autofit.workload.types import Workload
from benchmarks import common as cc

LLM_FOUNDRY = ("https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md")
TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
#: what every MosaicML row differs in from a DeepSpeed run
FOUNDRY_DIFFERS = ("Composer + PyTorch FSDP FULL_SHARD (not DeepSpeed ZeRO-3); MPT with ALiBi and "
                   "flash/triton attention (autofit prices MPT's shape as HF's GPT-2 with SDPA: STAND_IN); "
                   "LionW/decoupled AdamW; torch 1.13-2.0")
TITAN_DIFFERS = ("torchtitan FSDP2 (not DeepSpeed ZeRO-3); its own model code and kernels (whether torch.compile was "
                 "on is not published: autofit prices eager kernels); selective layer AC = every 2nd layer "
                 "(autofit: the first half)")

#: (d_model, n_heads, n_layers) of the MPT sizes (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml; the
#: published NumParams agree within 0.5 %: 12 L d^2 + 50368 d), vocabulary 50368, expansion 4
MPT = {"1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
       "30b": (7168, 64, 48), "70b": (8192, 64, 80)}
#: how the MPT rows are traced: Hugging Face's ``MptForCausalLM`` computes attention eagerly (its scores, mask and
#: softmax in memory, fp32), where llm-foundry's runs used flash or triton kernels, so its memory-bound bytes are
#: not what ran. GPT-2 at MPT's width, heads, depth, 4x GELU MLP, vocabulary and tied embeddings, dropout 0 (the
#: pretrain yamls'), with SDPA, is the same matmuls (FLOPs within its biases and learned positions: < 0.1 %)
STAND_IN = "GPT-2 module at MPT's shape"
#: (hidden, layers, intermediate, heads, kv heads, vocabulary) of the Llama models torchtitan trains
LLAMA = {"llama3-8b": (4096, 32, 14336, 32, 8, 128256), "llama3-70b": (8192, 80, 28672, 64, 8, 128256),
         "llama2-13b": (5120, 40, 13824, 40, 40, 32000), "llama2-70b": (8192, 80, 28672, 64, 8, 32000),
         "llama2-7b": (4096, 32, 11008, 32, 32, 32000),
         # the 34B of the Llama 2 paper was never released; its published shape is Code Llama 34B's
         "llama2-34b": (8192, 48, 22016, 64, 8, 32000)}


def _foundry(row_id: str, gpu: str, table: str, model: str, gpus: int, micro: int, accum: int, ac: bool,
             tokens_per_gpu: float, mfu: float) -> dict[str, Any]:
    return {"id": row_id, "model": f"mpt-{model}", "seq_len": 2048, "gpu": gpu, "gpus": gpus, "micro_batch": micro,
            "grad_accum": accum, "checkpoint_ratio": 1.0 if ac else 0.0, "published_tokens_per_gpu": tokens_per_gpu,
            "published_mfu": mfu, "source": LLM_FOUNDRY, "table": table, "framework": "Composer / PyTorch FSDP",
            "differs": FOUNDRY_DIFFERS}


def _titan(row_id: str, model: str, seq: int, micro: int, ratio: float, ac: str, tokens_per_gpu: float,
           mfu: float) -> dict[str, Any]:
    return {"id": row_id, "model": model, "seq_len": seq, "gpu": "a100-80gb", "gpus": 64, "micro_batch": micro,
            "grad_accum": 1, "checkpoint_ratio": ratio, "published_tokens_per_gpu": tokens_per_gpu,
            "published_mfu": mfu, "source": TORCHTITAN,
            "table": f"{'Llama 3' if 'llama3' in model else 'Llama 2'} performance numbers ({ac})",
            "framework": "torchtitan / FSDP2", "differs": TITAN_DIFFERS}


IBM_FSDP = "https://pytorch.org/blog/maximizing-training/"
IBM_DIFFERS = ("PyTorch FSDP (not DeepSpeed ZeRO-3), IBM's Foundation Model Stack Llama with SDPA flash attention, "
               "torch nightlies of early 2024; 'selective' checkpointing = every n-th block, n unpublished "
               "(autofit: half the layers)")


def _ibm(row_id: str, gpu: str, model: str, gpus: int, ac: float, node_gbps: int, tokens_per_gpu: float,
         mfu: float) -> dict[str, Any]:
    return {"id": row_id, "model": model, "seq_len": 4096, "gpu": gpu, "gpus": gpus, "micro_batch": 2,
            "grad_accum": 1, "checkpoint_ratio": ac, "published_tokens_per_gpu": tokens_per_gpu,
            "published_mfu": mfu, "source": IBM_FSDP, "inter_node_gbps": node_gbps,
            "table": "Table 1: Model and Hardware FLOPS utilization of various model sizes on A100 and H100 GPUs",
            "framework": "PyTorch FSDP (IBM fms-fsdp)", "differs": IBM_DIFFERS}


H100 = "H100 80GB BF16"
A100_80 = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
A100_40 = "A100 40GB with 1600 Gbps node-node interconnect (RoCE)"
#: every row, as published (tokens/s per GPU is the table's "Throughput (T/s/GPU)" or torchtitan's WPS, per GPU)
ROWS: tuple[dict[str, Any], ...] = (
    _foundry("foundry-h100-1b-8", "h100-80gb", H100, "1b", 8, 14, 1, False, 45455, 41.82),
    _foundry("foundry-h100-1b-64", "h100-80gb", H100, "1b", 64, 20, 1, False, 44402, 40.85),
    _foundry("foundry-h100-3b-16", "h100-80gb", H100, "3b", 16, 10, 3, False, 24142, 43.73),
    _foundry("foundry-h100-3b-64", "h100-80gb", H100, "3b", 64, 6, 3, False, 22525, 40.8),
    _foundry("foundry-h100-7b-8", "h100-80gb", H100, "7b", 8, 6, 1, False, 10643, 46.44),
    _foundry("foundry-h100-13b-8", "h100-80gb", H100, "13b", 8, 2, 1, False, 4792, 39.79),
    _foundry("foundry-h100-13b-64", "h100-80gb", H100, "13b", 64, 2, 1, False, 4800, 39.86),
    _foundry("foundry-h100-30b-32", "h100-80gb", H100, "30b", 32, 14, 3, True, 2308, 43.92),
    _foundry("foundry-h100-70b-64", "h100-80gb", H100, "70b", 64, 8, 4, True, 1039, 42.57),
    _foundry("foundry-a100-1b-8", "a100-80gb", A100_80, "1b", 8, 14, 4, False, 20513, 59.86),
    _foundry("foundry-a100-3b-8", "a100-80gb", A100_80, "3b", 8, 10, 2, False, 10811, 62.11),
    _foundry("foundry-a100-7b-8", "a100-80gb", A100_80, "7b", 8, 6, 2, False, 4641, 64.23),
    _foundry("foundry-a100-13b-8", "a100-80gb", A100_80, "13b", 8, 2, 3, False, 2262, 59.57),
    _foundry("foundry-a100-30b-8", "a100-80gb", A100_80, "30b", 8, 3, 21, True, 916, 55.3),
    _foundry("foundry-a100-40gb-7b-64", "a100-40gb", A100_40, "7b", 64, 18, 1, True, 3665, 50.73),
    _foundry("foundry-a100-40gb-13b-32", "a100-40gb", A100_40, "13b", 32, 14, 1, True, 1998, 52.62),
    _titan("titan-llama3-8b-64", "llama3-8b", 8192, 1, 0.5, "selective layer", 2904, 56.8),
    _titan("titan-llama2-13b-64", "llama2-13b", 4096, 2, 0.0, "no AC", 2162, 61.1),
    _titan("titan-llama3-70b-64", "llama3-70b", 8192, 1, 1.0, "full", 331, 51.7),
    _titan("titan-llama2-70b-64", "llama2-70b", 4096, 2, 1.0, "full", 353, 50.5),
    # IBM / PyTorch: A100 80GB, 128 GPUs, 400 Gbps a node; H100 80GB, 96 GPUs, 800 Gbps a node; batch 2 a GPU
    _ibm("ibm-a100-7b-128", "a100-80gb", "llama2-7b", 128, 0.0, 400, 3700, 57),
    _ibm("ibm-a100-13b-128", "a100-80gb", "llama2-13b", 128, 0.5, 400, 1800, 51),
    _ibm("ibm-a100-34b-128", "a100-80gb", "llama2-34b", 128, 1.0, 400, 700, 47),
    _ibm("ibm-a100-70b-128", "a100-80gb", "llama2-70b", 128, 1.0, 400, 370, 50),
    _ibm("ibm-h100-7b-96", "h100-80gb", "llama2-7b", 96, 0.0, 800, 7500, 37),
    _ibm("ibm-h100-13b-96", "h100-80gb", "llama2-13b", 96, 0.5, 800, 3800, 35),
    _ibm("ibm-h100-34b-96", "h100-80gb", "llama2-34b", 96, 1.0, 800, 1550, 32),
    _ibm("ibm-h100-70b-96", "h100-80gb", "llama2-70b", 96, 1.0, 800, 800, 34),
)


def workload(model: str, seq_len: int) -> Workload:
    """The model's shape as a Hugging Face model (built on the meta device by the trace)."""

    def batch(n: int) -> Any:
        import torch

        ids = torch.zeros((n, seq_len), dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    if model.startswith("mpt-"):
        d, heads, layers = MPT[model.removeprefix("mpt-")]

        def build() -> Any:  # MPT's shape as a module with SDPA attention (STAND_IN)
            from transformers import GPT2Config, GPT2LMHeadModel

            return GPT2LMHeadModel(GPT2Config(n_embd=d, n_head=heads, n_layer=layers, n_inner=4 * d,
                                              n_positions=seq_len, vocab_size=50368, activation_function="gelu",
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                              attn_implementation="sdpa"))
    else:
        hidden, layers, inter, heads, kv, vocab = LLAMA[model]

        def build() -> Any:
            from transformers import LlamaConfig, LlamaForCausalLM

            return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                                                num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                                max_position_embeddings=seq_len, attn_implementation="sdpa"))

    return Workload(model=build, batch=batch, tokens_per_sample=seq_len, name=model)


def configs_of(row: dict[str, Any]) -> list[Config]:
    """The published run as autofit configs: bf16 AdamW ZeRO-3, its micro-batch, accumulation and checkpointing;
    where this autofit has ZeRO's communication keys, each value the ``cluster`` space tries (``overlap_comm`` off
    and on, buckets 1x and 4x): ``autofit estimate`` with the rest fixed picks the fastest of them."""
    keys: dict[str, Any] = {"micro_batch_size": row["micro_batch"], "grad_accum_steps": row["grad_accum"],
                            "checkpoint_ratio": row["checkpoint_ratio"], "precision": "bf16", "optimizer": "adamw",
                            "zero_stage": 3, "attention": "sdpa"}
    if "overlap_comm" not in CONFIG_KEYS:
        return [Config(**keys)]
    return [Config(**keys, overlap_comm=o, bucket_scale=s) for o in (False, True) for s in (1, 4)]


#: the rows the CUDA presets' ``step_efficiency`` is taken from (one per GPU: :data:`autofit.core.hardware.STEP_EFFICIENCY_SOURCE`),
#: left out of the errors
ANCHORS = ("ibm-a100-7b-128", "ibm-h100-7b-96")


def hardware_of(row: dict[str, Any], step_efficiency: float | None = None) -> Hardware:
    """The row's GPU with its 8 GPUs a node (every source ran 8-GPU nodes): what ``--gpus 8 --nodes N`` gives; a
    row that publishes its network (``inter_node_gbps``, a node's) shares it among the node's 8 GPUs."""
    hardware = replace(get_hardware(row["gpu"]), devices_per_node=min(8, row["gpus"]))
    if "inter_node_gbps" in row:
        hardware = replace(hardware, inter_node_bytes_per_s=row["inter_node_gbps"] * 1e9 / 8 / 8)
    if step_efficiency is not None and hasattr(hardware, "step_efficiency"):
        hardware = replace(hardware, step_efficiency=step_efficiency)
    return hardware


def predict_rows(rows: tuple[dict[str, Any], ...], step_efficiency: float | None = None) -> list[dict[str, Any]]:
    """Each row's prediction; one trace per model and sequence length, for every config its rows use
    (``step_efficiency``: the device's in place of its preset's, 1.0 for the anchors)."""
    out: list[dict[str, Any]] = []
    by_model: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        by_model.setdefault((row["model"], row["seq_len"]), []).append(row)
    for (model, seq_len), group in by_model.items():
        started = time.monotonic()
        facts = trace_for(workload(model, seq_len), [c for r in group for c in configs_of(r)])
        print(f"  traced {model} at {seq_len} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        for row in group:
            hardware = hardware_of(row, step_efficiency)
            priced = [(c, predict(c, facts, hardware, row["gpus"], Coefficients.for_hardware(hardware)))
                      for c in configs_of(row)]
            fitting = [cp for cp in priced if cp[1].fits] or priced
            config, p = max(fitting, key=lambda cp: cp[1].samples_per_s)
            predicted = p.tokens_per_s / row["gpus"] if p.tokens_per_s else 0.0
            out.append(row | {"config": config.label(), "params": facts.n_params,
                              "predicted_tokens_per_gpu": predicted,
                              "error": cc.relative_error(predicted, row["published_tokens_per_gpu"]),
                              "predicted_fits": p.fits, "time_breakdown": p.time_breakdown})
    order = {r["id"]: i for i, r in enumerate(rows)}
    return sorted(out, key=lambda r: order[r["id"]])


def summary(rows: list[dict[str, Any]], key: str = "error") -> dict[str, Any]:
    """Median and worst error over the rows but the anchors (:data:`ANCHORS`)."""
    held_out = [r[key] for r in rows if r.get(key) is not None and r["id"] not in ANCHORS]
    return {"n": len(held_out), "median_abs_error": statistics.median(map(abs, held_out)),
            "worst_abs_error": max(map(abs, held_out)), "median_signed_error": statistics.median(held_out)}


def merge(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One results document: each row with its before and after prediction and error."""
    old = {r["id"]: r for r in before["rows"]}
    rows = []
    for r in after["rows"]:
        b = old.get(r["id"], {})
        rows.append({k: v for k, v in r.items() if k not in ("predicted_tokens_per_gpu", "error", "config",
                                                              "time_breakdown", "predicted_fits")}
                    | {"before_config": b.get("config"), "before_predicted_tokens_per_gpu": b.get("predicted_tokens_per_gpu"),
                       "before_error": b.get("error"), "before_time_breakdown": b.get("time_breakdown"),
                       "after_config": r["config"], "after_predicted_tokens_per_gpu": r["predicted_tokens_per_gpu"],
                       "after_error": r["error"], "after_time_breakdown": r["time_breakdown"],
                       "after_predicted_fits": r["predicted_fits"]})
    return {"before": {"commit": before.get("commit"), **summary(rows, "before_error")},
            "after": {"commit": after.get("commit"), **summary(rows, "after_error")},
            "targets": {"median_abs_error": 0.15, "worst_abs_error": 0.30}, "rows": rows}


def markdown(data: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "" if x is None else f"{100 * x:+.0f}%"

    rows = [[r["id"] + (" (anchor)" if r["id"] in ANCHORS else ""), r["model"], r["gpu"], str(r["gpus"]),
             f"{r['micro_batch']}x{r['grad_accum']}", f"{r['checkpoint_ratio']:g}", f"{r['published_tokens_per_gpu']:,.0f}",
             f"{r['before_predicted_tokens_per_gpu']:,.0f}", pct(r["before_error"]),
             f"{r['after_predicted_tokens_per_gpu']:,.0f}", pct(r["after_error"]), r["framework"]] for r in data["rows"]]
    b, a = data["before"], data["after"]
    return "\n".join([
        cc.markdown_table(["row", "model", "GPU", "GPUs", "micro x accum", "ckpt", "published tok/s/GPU",
                           "before", "error", "after", "error", "framework"], rows), "",
        f"Before ({b['commit']}): median |error| {100 * b['median_abs_error']:.1f}%, worst {100 * b['worst_abs_error']:.1f}%"
        f" (median signed {100 * b['median_signed_error']:+.1f}%). After ({a['commit']}): median |error| "
        f"{100 * a['median_abs_error']:.1f}%, worst {100 * a['worst_abs_error']:.1f}% (median signed "
        f"{100 * a['median_signed_error']:+.1f}%). Targets: median 15%, worst 30%. Over {a['n']} rows: the anchors "
        f"({', '.join(ANCHORS)}) are left out.", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after", help="which column this run is (before: the code before a change)")
    parser.add_argument("--out", type=Path, help="where to write this run's rows (JSON)")
    parser.add_argument("--only", help="comma-separated row ids")
    parser.add_argument("--anchors", action="store_true",
                        help="the anchor rows at step efficiency 1.0: measured / predicted is each GPU's step efficiency")
    parser.add_argument("--merge", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="write benchmarks/results/published_gpu.{json,md} from two runs' files")
    args = parser.parse_args()
    if args.merge:
        data = merge(*(json.loads(p.read_text()) for p in args.merge))
        (cc.RESULTS / "published_gpu.json").write_text(json.dumps(data, indent=1) + "\n")
        (cc.RESULTS / "published_gpu.md").write_text(markdown(data))
        print(markdown(data))
        return
    if args.anchors:
        for r in predict_rows(tuple(r for r in ROWS if r["id"] in ANCHORS), step_efficiency=1.0):
            print(f"{r['id']:20s} {r['gpu']:10s} step efficiency = {r['published_tokens_per_gpu']:.0f} / "
                  f"{r['predicted_tokens_per_gpu']:.0f} = {r['published_tokens_per_gpu'] / r['predicted_tokens_per_gpu']:.3f}"
                  f" (preset: {get_hardware(r['gpu']).step_efficiency:g})")
        return
    rows = ROWS if not args.only else tuple(r for r in ROWS if r["id"] in args.only.split(","))
    predicted = predict_rows(rows)
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=cc.ROOT).stdout.strip()
    data = {"label": args.label, "commit": commit, "rows": predicted, **summary(predicted)}
    out = args.out or cc.RESULTS / "published_gpu_rows.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    for r in predicted:
        print(f"{r['id']:28s} published {r['published_tokens_per_gpu']:8.0f} predicted "
              f"{r['predicted_tokens_per_gpu']:8.0f} error {100 * r['error']:+.1f}%")
    print(json.dumps(summary(predicted)))


if __name__ == "__main__":
    main()
