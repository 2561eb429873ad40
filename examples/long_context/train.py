"""Train a tiny Llama with the long-context keys of the JSON autofit emitted: Ulysses SP, TiledMLP, the tiled loss.

    autofit estimate hf:examples/long_context/tiny_llama --seq-len 256 --hardware cpu --gpus 2 \\
        --set zero_stage=3 --set sequence_parallel=2 --set attention=sdpa --set tiled_mlp=true --json > est.json
    # or: python -c "..." writing autofit.ds.emit.deepspeed_config(Config(...), 2, 'cpu') to ds_config.json
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/long_context/train.py --deepspeed ds_config.json \\
        --loop trainer --max-steps 3

Two ways, the same JSON:

* ``--loop trainer``: the Hugging Face ``Trainer``. ``autofit.ds.launchers.trainer_arguments`` adds
  ``parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N, ...)`` (accelerate then registers
  DeepSpeed's Ulysses attention, passes its ``mpu`` to ``deepspeed.initialize``, wraps the training DataLoader in
  ``UlyssesSPDataLoaderAdapter`` and aggregates the loss over the SP group); the model is built with the JSON's
  attention and ``autofit.apply.apply_to_model`` patches its MLPs (TiledMLP) and its loss (tiled) before the
  Trainer sees it; ``autofit.ds.collate.SequenceCollator`` pads each batch to a multiple of N and adds
  ``position_ids``, which the adapter requires.
* ``--loop deepspeed``: a script of its own, through ``autofit.apply`` (:mod:`autofit.ds.apply`):
  ``sequence_parallel_mpu`` before ``deepspeed.initialize(mpu=...)``, ``shard_batch`` and ``causal_lm_loss`` each
  step, forward and backward inside ``activation_offload_context``.

A JSON with DeepSpeed's AutoTP (``--set tensor_parallel=2``: ``tensor_parallel.autotp_size``) runs either way too:
``deepspeed.initialize`` (or the Trainer through it) splits the model's Linear layers, and every rank of a TP group
takes the same batches (the samples are seeded).

Each rank prints one ``RESULT {json}`` line and writes the same JSON to ``<output-dir>/result-rank<N>.json``: its
losses (and grad norms), so that runs at different SP degrees can be compared (every SP group sees the same batches:
data-parallel size is world / sp). Read the files: the ranks share one stdout, where two lines can interleave.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from autofit import apply
from autofit.ds import launchers
from autofit.ds.collate import SequenceCollator

HERE = Path(__file__).resolve().parent
#: lengths of the random samples: not all a multiple of the SP degree, so the collator pads. All pad to one length:
#: the Trainer's SP loader adapter all_gathers every SP rank's batch, which gloo (the CPU's backend) allows only for
#: equal shapes (``UlyssesSPDataLoaderAdapter.refill``: "ProcessGroupGloo::allgather: invalid tensor size")
LENGTHS = (255, 256, 255)


def build_model(ds: dict[str, Any]) -> torch.nn.Module:
    """The tiny Llama of ``tiny_llama/config.json`` (random weights, seed 0) with the JSON's attention kernel."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from autofit.workload.hf import ATTN_IMPLEMENTATION

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(HERE / "tiny_llama")
    attention = ATTN_IMPLEMENTATION[ds.get("autofit", {}).get("attention", "sdpa")]
    with torch.device("meta"):  # imports the modeling code (torch._dynamo among it) before zero.Init patches torch
        AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    with apply.build_context(ds):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)


def samples(n: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """``n`` random token sequences (seed 1234), of :data:`LENGTHS` in turn."""
    generator = torch.Generator().manual_seed(1234)
    return [{"input_ids": torch.randint(0, vocab, (LENGTHS[i % len(LENGTHS)],), generator=generator)}
            for i in range(n)]


def train_deepspeed(ds: dict[str, Any], max_steps: int) -> dict[str, Any]:
    """A loop of its own: one micro-batch a step (every SP group the same), through ``autofit.apply``."""
    import deepspeed

    model = build_model(ds)
    apply.apply_to_model(model, ds, model.model.layers)
    mpu = apply.sequence_parallel_mpu(model, ds)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=ds,
                                      mpu=mpu)
    collate = SequenceCollator.for_json(ds)
    micro = int(ds["train_micro_batch_size_per_gpu"])
    data = samples(micro * max_steps, model.config.vocab_size)
    losses, norms = [], []
    for step in range(max_steps):
        shard = apply.shard_batch(collate(data[step * micro:(step + 1) * micro]), mpu)
        with apply.activation_offload_context(ds):
            loss = apply.causal_lm_loss(engine, shard, ds, mpu)
            engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    return {"losses": losses, "grad_norms": norms, "local_tokens": int(shard["input_ids"].shape[1])}


def train_trainer(ds: dict[str, Any], max_steps: int, output_dir: str) -> dict[str, Any]:
    """The Hugging Face Trainer with the JSON and the keywords ``autofit.ds.launchers.trainer_arguments`` derives."""
    from transformers import Trainer, TrainingArguments

    model = build_model(ds)
    apply.apply_to_model(model, ds, model.model.layers)
    params = ds.get("optimizer", {}).get("params", {})  # the JSON's own numbers, this script's where "auto"
    recipe = {trainer_key: params[key] if isinstance(params.get(key), (int, float)) else default
              for key, trainer_key, default in (("lr", "learning_rate", 1e-4), ("weight_decay", "weight_decay", 0.0))}
    kwargs = launchers.trainer_arguments(ds, output_dir=output_dir, max_steps=max_steps, logging_steps=1,
                                         save_strategy="no", report_to="none", dataloader_num_workers=0,
                                         use_cpu=not torch.cuda.is_available(), **recipe)
    args = TrainingArguments(**kwargs)  # deepspeed: the JSON, its train_batch_size left to accelerate under SP
    n = args.world_size * int(ds["train_micro_batch_size_per_gpu"]) * int(ds["gradient_accumulation_steps"])
    trainer = Trainer(model=model, args=args, train_dataset=samples(n * max_steps, model.config.vocab_size),
                      data_collator=SequenceCollator.for_json(ds))
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"global_step": result.global_step, "train_loss": result.training_loss, "losses": losses}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", default="ds_config.json", help="The DeepSpeed JSON autofit wrote.")
    parser.add_argument("--loop", choices=("trainer", "deepspeed"), default="trainer")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--output-dir", default="long-context-out")
    args = parser.parse_args(argv)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)  # what a launcher sets; one process without one
    path = Path(args.deepspeed)
    ds = json.loads(path.read_text())
    if args.loop == "trainer":
        out = train_trainer(ds, args.max_steps, args.output_dir)
    else:
        out = train_deepspeed(ds, args.max_steps)
    rank = int(os.environ["RANK"])
    line = json.dumps({"rank": rank, **out})
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / f"result-rank{rank}.json").write_text(line + "\n")
    print("RESULT " + line, flush=True)
    if torch.distributed.is_initialized():  # every rank done, then the group's threads end before the interpreter's
        torch.distributed.barrier()         # teardown (left to exit, gloo can abort: "terminate called without an
        torch.distributed.destroy_process_group()  # active exception")


if __name__ == "__main__":
    main()
