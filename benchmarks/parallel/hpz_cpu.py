"""ZeRO++'s hierarchical partitioning (hpZ) on CPU ranks: four gloo ranks as two simulated nodes of two, ZeRO-3 with
``zero_hpz_partition_size`` 2 against 1: the loss, the secondary partition DeepSpeed holds, and autofit's prior against
its probes.

    DS_ACCELERATOR=cpu python -m benchmarks.parallel.hpz_cpu [--out benchmarks/results/hpz_cpu.json]

First the plain command a user types (``autofit estimate hf:MODEL --seq-len 128 --hardware cpu --gpus 2 --nodes 2``:
its best candidate and the hpZ sizes its candidates hold). Then, for each model, the emitted JSON's ZeRO-3 section
driven through ``deepspeed.initialize`` directly on four ranks (``torch.distributed.run``, the same seeded weights and
batches at hpz 1 and 2): each step's loss, and the parameters holding a secondary partition after each forward and
backward. Then ``autofit probe`` of hpz 1 and 2 (micro-batch 2, global batch 8, fp32, SDPA, AdamW, no checkpointing):
the measured peak of the largest rank against the prediction. The models: the repository's tiny grouped-query Llama
and a wider one (hidden 512, vocabulary 8,192) written here. Results: docs/results/hpz_cpu.md.
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
from pathlib import Path
from typing import Any

from benchmarks.parallel.autotp_probe import autofit

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "hpz_cpu.json"
LLAMA = ROOT / "examples" / "hf_configs" / "llama_gqa"
WIDER = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192, "hidden_size": 512,
         "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "max_position_embeddings": 512, "tie_word_embeddings": False, "use_cache": False}
COMMON = ("--seq-len", "128", "--hardware", "cpu", "--gpus", "2", "--nodes", "2", "--global-batch", "8")
FIXED = ("--set", "micro_batch_size=2", "--set", "precision=fp32", "--set", "attention=sdpa", "--set",
         "optimizer=adamw", "--set", "zero_stage=3", "--set", "checkpoint_ratio=0")
STEPS = 3


def rank_main(model_dir: str, hpz: int, out: str) -> None:
    """One rank: the model from its config under the emitted JSON's ZeRO-3 (HfDeepSpeedConfig + from_config, as the
    Trainer builds it), seeded, ``STEPS`` steps on seeded batches; rank 0 writes what it saw."""
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from autofit.core.config import Config
    from autofit.ds.emit import deepspeed_config

    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    ds = deepspeed_config(Config(zero_stage=3, micro_batch_size=2, hpz_partition_size=hpz), world_size=4)
    keep = HfDeepSpeedConfig(ds)  # noqa: F841 (transformers holds it weakly)
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=AutoModelForCausalLM.from_config(config), config=ds)
    batches = torch.Generator().manual_seed(1 + rank)

    def secondaries() -> int:
        return sum(getattr(p, "ds_secondary_tensor", None) is not None for p in engine.module.parameters())

    rows = []
    for _ in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (2, 128), generator=batches)
        loss = engine(input_ids=ids, labels=ids).loss
        after_forward = secondaries()
        engine.backward(loss)
        rows.append({"loss": loss.item(), "secondary_after_forward": after_forward,
                     "secondary_after_backward": secondaries()})
        engine.step()
    if rank == 0:
        Path(out).write_text(json.dumps({"steps": rows, "parameters": sum(1 for _ in engine.module.parameters())}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def direct(model_dir: Path, hpz: int) -> dict[str, Any]:
    """:func:`rank_main` on four ranks; rank 0's steps, or the error's last line."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
                               "29631", "-m", "benchmarks.parallel.hpz_cpu", "--rank", str(model_dir), str(hpz), str(out)],
                              capture_output=True, text=True, cwd=ROOT, timeout=600,
                              env={**os.environ, "DS_ACCELERATOR": "cpu", "MALLOC_MMAP_THRESHOLD_": "4096"})
        if done.returncode != 0 or not out.exists():
            return {"hpz_partition_size": hpz, "error": (done.stderr.strip().splitlines() or [""])[-1]}
        return {"hpz_partition_size": hpz, **json.loads(out.read_text())}


def probe(entry: str, hpz: int) -> dict[str, Any]:
    out, line, seconds = autofit("probe", entry, *COMMON, *FIXED, "--set", f"hpz_partition_size={hpz}")
    row: dict[str, Any] = {"hpz_partition_size": hpz, "probe_s": round(seconds, 1)}
    if out is None or out["status"] != "ok":
        return row | {"error": line or (out or {}).get("message")}
    measured, predicted = out["peak_bytes"], out["predicted"]["peak_bytes"]
    return row | {"measured_bytes": measured, "predicted_bytes": predicted, "predicted": out["predicted"]["breakdown"],
                  "per_rank_build_bytes": out["per_rank_build_bytes"], "step_time_s": out["step_time_s"],
                  "error_pct": round(100 * (predicted / measured - 1), 2)}


def plain(entry: str) -> dict[str, Any]:
    out, line, seconds = autofit("estimate", entry, *COMMON)
    if out is None:
        return {"error": line}
    fitting = [c for c in out["candidates"] if c["fits"]]
    return {"best": fitting[0]["config"] if fitting else None, "candidates": len(out["candidates"]),
            "hpz_sizes": sorted({c["config"]["hpz_partition_size"] for c in out["candidates"]}),
            "seconds": round(seconds, 1)}


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpz_cpu_") as tmp:
        wider = Path(tmp) / "llama_wider"
        wider.mkdir()
        (wider / "config.json").write_text(json.dumps(WIDER))
        for name, path in {"llama_gqa": LLAMA, "llama_wider": wider}.items():
            row: dict[str, Any] = {"model": name, "plain": plain(f"hf:{path}")}
            row["direct"] = [direct(path, hpz) for hpz in (1, 2)]
            losses = [[s["loss"] for s in d.get("steps", [])] for d in row["direct"]]
            row["loss_max_abs_diff"] = max((abs(a - b) for a, b in zip(*losses, strict=False)), default=None)
            row["probes"] = [probe(f"hf:{path}", hpz) for hpz in (1, 2)]
            print(json.dumps({k: row[k] for k in ("model", "loss_max_abs_diff")}),
                  [p.get("error_pct", p.get("error")) for p in row["probes"]], flush=True)
            rows.append(row)
    result = {"command": "python -m benchmarks.parallel.hpz_cpu",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "wider_config": WIDER, "models": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
