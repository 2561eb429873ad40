"""A plain DeepSpeed training script with an HF-style ``--deepspeed CONFIG`` argument, for DeepSpeed's autotuner.

    DS_ACCELERATOR=cpu deepspeed --autotuning tune --num_gpus 1 benchmarks/peers/ds_autotune_train.py \
        --model vit --deepspeed benchmarks/results/ds_autotune_config.json

``benchmarks/peers/compare_search.py --autotuner`` runs exactly that. The autotuner launches this script once
per experiment with its own config in place of ``--deepspeed``; the engine writes the experiment's
metric (throughput) where that config's ``autotuning.metric_path`` says.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from autofit.workload.entry import load_workload  # noqa: E402

MODELS = {
    "vit": "benchmarks/models/vit.py:workload",
    "cnn": "benchmarks/models/cnn.py:workload",
    "gqa_llama": "benchmarks/models/gqa_llama.py:workload",
}


def main() -> None:
    # The autotuner marks an experiment failed when any line of its stderr contains "error"
    # (deepspeed/autotuning/utils.py:search_error); torch 2.13 logs "... will be an error in a future
    # release" when torchao registers its enums at import. Quiet that logger before DeepSpeed imports it.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit", choices=sorted(MODELS))
    parser.add_argument("--deepspeed", required=True, help="DeepSpeed JSON (the autotuner replaces it per experiment)")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    # an absolute entry: the autotuner's experiment paths are relative to the directory it was started in
    workload = load_workload(str(ROOT / MODELS[args.model]))
    model = workload.build_model(attention="sdpa")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed)
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        loss = workload.compute_loss(engine, workload.batch(engine.train_micro_batch_size_per_gpu()))
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    main()
