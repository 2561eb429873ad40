"""autofit's prior (no probe) against published tensor-parallel training runs of 70 B and more.

    python -m benchmarks.parallel.published_tp [--out benchmarks/results/published_tp.json]

The rows are those of ``benchmarks/results/published_tp_rows.json`` (collected from their sources with a quote each)
that autofit can plan: tensor parallelism with data parallelism, no pipeline or context parallelism, and no async
TP, which DeepSpeed's AutoTP does not have. All are torchtitan's (FSDP2 x TP 8 on H100s of 94-96 GB, HBM2e at 500 W:
not the 700 W H100 SXM whose peak the ``h100-80gb`` preset states, so the prior is expected high there). For each
model and GPU count the plain command runs first (``autofit estimate hf:MODEL --seq-len 8192 --hardware h100-80gb
--memory GB --gpus 8 --nodes N --global-batch G``, the shipped space: no TP), then the published layout fixed
(``--set tensor_parallel=8 micro_batch_size=M zero_stage=3 checkpoint_ratio=1 checkpoint_granularity=block
offload_*=none``, flash attention, bf16 or fp8 as the recipe): its fastest fitting candidate (else the one of least
peak), its predicted tokens/s a GPU against the published, and whether it fits. torchtitan's TP applies
Megatron-style sequence parallelism to the norms and the layer-boundary activations and compiles the model; AutoTP
does neither (autofit refuses compile beside it), which the table's "fits" column shows. fp8 rows are kept as
refused: autofit plans no fp8 beside ZeRO-3 (``fp8_not_with_zero3``), FSDP's equivalent here. Results:
docs/results/autotp_cpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ROWS = ROOT / "benchmarks" / "results" / "published_tp_rows.json"
OUT = ROOT / "benchmarks" / "results" / "published_tp.json"
LLAMA_405B = ROOT / "examples" / "hf_configs" / "llama3_1_405b"
#: Llama 3.1 70B's shape (its config.json): the 405B's config with these values
LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8}


def model_folder(model: str, where: Path) -> Path:
    """The ``hf:`` folder of a published row's model: the 405B's config, or it reshaped to the 70B's."""
    if "405B" in model:
        return LLAMA_405B
    config = json.loads((LLAMA_405B / "config.json").read_text()) | LLAMA_70B
    folder = where / "llama3_1_70b"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def estimate(*args: str) -> tuple[dict[str, Any] | None, str, float]:
    """``autofit estimate ARGS --json`` as a user runs it: its document (None on failure), last stderr line, seconds."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autofit", "estimate", *args, "--json"], capture_output=True,
                          text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}, cwd=ROOT, timeout=1200)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return (json.loads(done.stdout) if done.returncode == 0 else None), (lines[-1] if lines else ""), \
        time.perf_counter() - started


def fastest(out: dict[str, Any], gpus: int) -> dict[str, Any]:
    """The fastest fitting candidate of an estimate (else the one nearest to fitting: the least peak), in tokens/s a
    GPU."""
    fitting = [c for c in out["candidates"] if c["fits"]]
    best = fitting[0] if fitting else min(out["candidates"], key=lambda c: c["predicted"]["peak_bytes"])
    predicted = best["predicted"]
    return {"config": best["config"], "fits": best["fits"], "reason": best["reason"],
            "tokens_per_s_per_gpu": round(predicted["tokens_per_s"] / gpus, 1),
            "peak_gib": round(predicted["peak_bytes"] / 2**30, 1), "time_breakdown": predicted["time_breakdown"],
            "candidates": len(out["candidates"]), "fitting": len(fitting)}


def row_args(row: dict[str, Any], folder: Path) -> list[str]:
    """The request every command of ``row`` shares: model, length, device, GPUs, global batch."""
    return [f"hf:{folder}", "--seq-len", str(row["seq_len"]), "--hardware", "h100-80gb", "--memory",
            f"{row['gpu_memory_gb']}GB", "--gpus", "8", "--nodes", str(row["gpus"] // 8), "--global-batch",
            str(row["dp"] * row["micro_batch"])]


def layout_args(row: dict[str, Any]) -> list[str]:
    """The published layout fixed: TP, micro-batch, ZeRO-3 (FSDP's full sharding), every layer checkpointed."""
    fp8 = str(row["precision"]).startswith("fp8")
    keys = {"tensor_parallel": row["tp"], "micro_batch_size": row["micro_batch"], "zero_stage": 3,
            "checkpoint_ratio": 1.0, "checkpoint_granularity": "block", "offload_optimizer": "none",
            "offload_params": "none", "attention": "flash",
            "precision": "fp8" if fp8 else "bf16"}
    return [arg for key, value in keys.items() for arg in ("--set", f"{key}={value}")]  # the precision is the recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    published = [r for r in json.loads(ROWS.read_text())["rows"]
                 if r["autofit_plannable_today"] and "Async" not in str(r["optimizations"])]
    results, plains = [], {}
    with tempfile.TemporaryDirectory(prefix="published_tp_") as tmp:
        for row in published:
            folder = model_folder(row["model"], Path(tmp))
            request = row_args(row, folder)
            key = " ".join(request)
            if key not in plains:
                out, line, seconds = estimate(*request)
                plains[key] = {"model": row["model"], "gpus": row["gpus"], "seconds": round(seconds, 1),
                               **(fastest(out, row["gpus"]) if out else {"error": line})}
                print(f"plain {row['model']} on {row['gpus']}: {plains[key].get('tokens_per_s_per_gpu')}", flush=True)
            out, line, seconds = estimate(*request, *layout_args(row))
            result: dict[str, Any] = {"id": row["id"], "model": row["model"], "gpus": row["gpus"],
                                      "precision": row["precision"], "published_tokens_per_gpu":
                                      row["published_tokens_per_gpu"], "source": row["source"],
                                      "seconds": round(seconds, 1)}
            if out is None:
                result["error"] = line
            else:
                result |= fastest(out, row["gpus"])
                result["error_pct"] = round(100 * (result["tokens_per_s_per_gpu"] / row["published_tokens_per_gpu"]
                                                   - 1), 1)
            print(f"{row['id']}: {result.get('tokens_per_s_per_gpu')} against {row['published_tokens_per_gpu']} "
                  f"({result.get('error_pct')}%), fits {result.get('fits')}", flush=True)
            results.append(result)
    document = {"command": "python -m benchmarks.parallel.published_tp",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "plain": list(plains.values()), "rows": results}
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
