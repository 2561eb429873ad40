"""autofit's AutoTP prior against its own probes on CPU ranks: predicted against measured peak a rank, TP = 2 on two
ranks (gloo over loopback), beside the same layouts without TP.

    DS_ACCELERATOR=cpu python -m benchmarks.parallel.autotp_probe [--out benchmarks/results/autotp_probe.json]

First the plain command a user types (``autofit estimate hf:MODEL --seq-len 128 --hardware cpu --gpus 2``: its best
candidate, and whether the shipped space searched TP); then, for each model, ``autofit probe`` of the fixed layouts
(``--set tensor_parallel=1|2 zero_stage=0|3 checkpoint_ratio=0|1``, micro-batch 4, global batch 8, fp32, SDPA,
AdamW), each a fresh command as a user runs it: the probe's measured peak (the largest rank's, VmHWM less the RSS
after the imports: docs/design.md, "Memory, measured") against the plan's prediction, and the step time. The models:
the repository's tiny grouped-query Llama (``examples/hf_configs/llama_gqa``) and a small Qwen3 (its q and k norms
``replicated_with_grad_allreduce`` in its tp_plan), which the TP pricing was not built on. That the loss under TP is
the unsplit run's is benchmarks/parallel/autotp_cpu.py's (DeepSpeed driven directly, the same seeded weights on every
rank); a probe builds each rank's weights from its own seed. Results: docs/results/autotp_cpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "autotp_probe.json"
LLAMA = ROOT / "examples" / "hf_configs" / "llama_gqa"
#: a small Qwen3 (dense), untied: its tp_plan keeps the q and k norms whole with their gradients all-reduced
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 2048, "hidden_size": 256,
         "intermediate_size": 768, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 32, "max_position_embeddings": 512, "tie_word_embeddings": False, "use_cache": False}
COMMON = ("--seq-len", "128", "--hardware", "cpu", "--gpus", "2", "--global-batch", "8")
FIXED = ("--set", "micro_batch_size=4", "--set", "precision=fp32", "--set", "attention=sdpa", "--set",
         "optimizer=adamw")
LAYOUTS = [(tp, zero, ratio) for tp in (1, 2) for zero in (0, 3) for ratio in (0.0, 1.0)]


def autofit(*args: str) -> tuple[dict[str, Any] | None, str, float]:
    """``autofit ARGS --json`` as a user runs it: its document (None where it failed), its last stderr line, seconds."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autofit", *args, "--json"], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, cwd=ROOT, timeout=900)
    seconds = time.perf_counter() - started
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return (json.loads(done.stdout) if done.returncode == 0 else None), (lines[-1] if lines else ""), seconds


def plain(entry: str) -> dict[str, Any]:
    """The plain estimate: its best fitting candidate and the TP degrees its candidates hold."""
    out, line, seconds = autofit("estimate", entry, *COMMON)
    if out is None:
        return {"error": line, "seconds": round(seconds, 1)}
    fitting = [c for c in out["candidates"] if c["fits"]]
    return {"best": fitting[0]["config"] if fitting else None, "candidates": len(out["candidates"]),
            "tensor_parallel_degrees": sorted({c["config"]["tensor_parallel"] for c in out["candidates"]}),
            "seconds": round(seconds, 1)}


def probe(entry: str, tp: int, zero: int, ratio: float) -> dict[str, Any]:
    """One fixed layout probed: measured against predicted peak, per rank and the largest."""
    out, line, seconds = autofit("probe", entry, *COMMON, *FIXED, "--set", f"tensor_parallel={tp}",
                                 "--set", f"zero_stage={zero}", "--set", f"checkpoint_ratio={ratio:g}")
    row: dict[str, Any] = {"tensor_parallel": tp, "zero_stage": zero, "checkpoint_ratio": ratio,
                           "probe_s": round(seconds, 1)}
    if out is None or out["status"] != "ok":
        return row | {"error": line or (out or {}).get("message")}
    measured, predicted = out["peak_bytes"], out["predicted"]["peak_bytes"]
    return row | {"config": out["config"], "measured_bytes": measured, "predicted_bytes": predicted,
                  "per_rank_peak_bytes": out["per_rank_peak_bytes"], "step_time_s": out["step_time_s"],
                  "predicted_step_time_s": out["predicted"]["step_time_s"],
                  "error_pct": round(100 * (predicted / measured - 1), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="autotp_probe_") as tmp:
        qwen3 = Path(tmp) / "qwen3_small"
        qwen3.mkdir()
        (qwen3 / "config.json").write_text(json.dumps(QWEN3))
        models = {"llama_gqa": f"hf:{LLAMA}", "qwen3_small": f"hf:{qwen3}"}
        rows = []
        for name, entry in models.items():
            model: dict[str, Any] = {"model": name, "plain": plain(entry), "probes": []}
            print(f"{name}: plain {model['plain']}", flush=True)
            for tp, zero, ratio in LAYOUTS:
                row = probe(entry, tp, zero, ratio)
                print(f"  tp {tp} z{zero} ckpt {ratio:g}: {row.get('error_pct', row.get('error'))}", flush=True)
                model["probes"].append(row)
            rows.append(model)
    errors = [p["error_pct"] for m in rows for p in m["probes"] if "error_pct" in p and p["tensor_parallel"] > 1]
    result = {"command": "python -m benchmarks.parallel.autotp_probe",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "models": rows, "qwen3_config": QWEN3,
              "tp_rows": len(errors), "tp_worst_abs_error_pct": max((abs(e) for e in errors), default=None)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}: TP rows {len(errors)}, worst |error| {result['tp_worst_abs_error_pct']}%")


if __name__ == "__main__":
    main()
