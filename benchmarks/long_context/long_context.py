"""The longest sequence the prior predicts Llama-3.1-8B trains at, beside DeepSpeed's published ALST figures.

    python -m benchmarks.long_context.long_context [--out benchmarks/results/long_context.json]

For 1, 8 and 32 H100 80GB (32: 4 nodes of 8) runs ``autofit estimate hf:examples/hf_configs/llama3_1_8b --seq-len max``
(:func:`autofit.planning.longest.longest_sequence`, the default space, bf16 AdamW, no global batch: micro-batch 1),
first as typed (the 10% margin), then with ``--margin 0``, the whole device, where ALST's runs found their edge,
and sets its answer beside ALST's (Arctic Long Sequence Training; Bekman et al., arXiv 2506.13996, abstract: "500K
sequence length on a single H100 GPU, 3.7M on a single 8xH100 GPU node, and over 15M on a 4 node cluster"; the
DeepSpeed tutorial https://www.deepspeed.ai/tutorials/ulysses-alst-sequence-parallelism/) and beside the rung with
no long-context technique, which is what autofit without the long-context keys could plan (the same cost model;
the old main stopped near 32K on 8 H100). The goal: within 15% of the published figure.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import subprocess
import time
from pathlib import Path

from autofit.cost_model.budget import DEFAULT_MARGIN
from autofit.planning.longest import longest_sequence
from autofit.planning.target import Target

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "hf:" + str(ROOT / "examples" / "hf_configs" / "llama3_1_8b")
#: (GPUs per node, nodes) -> ALST's published longest sequence (arXiv 2506.13996; ArcticTraining's recipes
#: run-h100-sp{1,8,32}-llama-8b.yml use max_length 500000, 3800000 and 15500000)
PUBLISHED = {(1, 1): 500_000, (8, 1): 3_700_000, (8, 4): 15_000_000}
#: the plain command's margin first, then the whole device: ALST's figures are the longest its runs found to train,
#: the device's own edge
MARGINS = (DEFAULT_MARGIN, 0.0)
SOURCE = "arXiv 2506.13996 (ALST) abstract; https://www.deepspeed.ai/tutorials/ulysses-alst-sequence-parallelism/"


def measure(gpus: int, nodes: int, margin: float = DEFAULT_MARGIN) -> dict:
    started = time.perf_counter()
    answer = longest_sequence(Target(entry=ENTRY, hardware="h100-80gb", gpus=gpus, nodes=nodes, seq_len="max",
                                     margin=margin))
    published = PUBLISHED[(gpus, nodes)]
    row = answer.to_dict()
    bounded = int32_bounded(answer.seq_len, row["int32_tokens_per_rank"], row["config"]["sequence_parallel"])
    row.update({"gpus": gpus * nodes, "margin": margin, "published": published, "published_source": SOURCE,
                "error": round((answer.seq_len - published) / published, 3),
                "int32_bounded_seq_len": bounded, "int32_bounded_error": round((bounded - published) / published, 3),
                "without_long_context": answer.rungs[0].seq_len, "seconds": round(time.perf_counter() - started, 1)})
    return row


def int32_bounded(seq_len: int, int32_tokens_per_rank: int | None, sp: int) -> int:
    """The answer where ALST's own kernels would stop: a rank's ``[1, s / sp, hidden]`` hidden state (and Ulysses'
    ``[1, s, heads / sp, head_dim]`` attention input, as many elements) past 2^31 elements fails in int32-indexed
    kernels (Liger's RMSNorm in Triton, flash-attn 2: Liger-Kernel issue #803, from ALST's authors), which ALST's
    recipes run (``model.type: liger``, ``flash_attention_2``)."""
    return seq_len if int32_tokens_per_rank is None else min(seq_len, int32_tokens_per_rank * sp)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "long_context.json")
    args = parser.parse_args()
    rows = []
    for (gpus, nodes), margin in itertools.product(PUBLISHED, MARGINS):
        row = measure(gpus, nodes, margin)
        rows.append(row)
        print(f"{row['gpus']:>3} H100, margin {margin:.0%}: autofit {row['seq_len']:>12,} ({row['label']})  "
              f"published {row['published']:>12,}"
              f"  error {row['error']:+.1%}  int32-bounded {row['int32_bounded_seq_len']:,} "
              f"({row['int32_bounded_error']:+.1%})  without long-context keys {row['without_long_context']:,}",
              flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    args.out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "commit": commit.strip(),
                                    "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
