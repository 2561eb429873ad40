"""Train the example LM with the Hugging Face ``Trainer`` and the DeepSpeed JSON autofit emitted.

    autofit run examples/hf_trainer/model.py:workload --hardware cpu --memory 2GiB --global-batch 8 \\
        --space cpu --out ds_config.json
    torchrun --nproc-per-node 1 examples/hf_trainer/train.py --deepspeed ds_config.json --max-steps 3

(``python train.py`` works too: with no launcher it sets the single-process rendezvous variables.)

The JSON goes to ``TrainingArguments(deepspeed=...)`` as it is; the Trainer checks that its own
arguments match the JSON (micro-batch, accumulation, clipping, precision), so
:func:`autofit.ds.launchers.trainer_arguments` derives them from the JSON. The learning rate and weight decay
are this script's own (``--learning-rate``, ``--weight-decay``): the JSON says ``"auto"`` for them unless they
were given to autofit (``--lr``, ``--weight-decay``), and the Trainer fills ``"auto"`` from its arguments; a
value the JSON does carry is the user's, and is used. What DeepSpeed's JSON cannot say is in its
``"autofit"`` section, applied the way the Trainer expects:

* ``attention`` -> ``attn_implementation`` when the model is built;
* ``checkpoint_ratio`` 1.0 -> ``gradient_checkpointing=True`` (non-reentrant; transformers 5 calls it
  ``activation_checkpointing``). The Trainer
  checkpoints every layer or none, so a partial ratio r wraps the first ``round(r x L)`` decoder
  layers with :func:`autofit.ds.apply.apply_checkpointing` before the Trainer sees the model, and
  ``gradient_checkpointing`` stays off;
* the optimizer: when the JSON has an ``optimizer`` section DeepSpeed builds it and ``optim`` is
  not used; ``adamw8bit`` (no ``optimizer`` section) is ``optim="adamw_bnb_8bit"``; Lion on a CPU
  (DeepSpeed's FusedLion is CUDA-only) goes in as the Trainer's ``optimizers=(optimizer, None)``;
* ``fp8``: torchao's float8 conversion (:func:`autofit.ds.apply.apply_fp8`), DeepSpeed's bf16 around it;
* no GPU: ``use_cpu=True`` (the Trainer refuses ``bf16`` without a GPU otherwise, and a CPU with native bf16
  can measure it fastest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model import build_model, make_batch  # noqa: E402

from autofit.ds import launchers  # noqa: E402
from autofit.ds.launchers import TRAINER_OPTIM  # noqa: E402


def trainer_arguments(ds: dict[str, Any], output_dir: str, max_steps: int, learning_rate: float = 5e-5,
                      weight_decay: float = 0.0) -> dict[str, Any]:
    """``TrainingArguments`` keywords that agree with the DeepSpeed JSON ``ds`` (the Trainer checks them):
    :func:`autofit.ds.launchers.trainer_arguments` with this example's run settings.

    ``learning_rate`` and ``weight_decay`` are the script's (defaults: TrainingArguments' own); a number the JSON
    carries (given to autofit by the user) takes their place, an ``"auto"`` one is filled from them."""
    params = ds.get("optimizer", ds.get("autofit", {}).get("client_optimizer", {})).get("params", {})
    recipe: dict[str, Any] = {"learning_rate": learning_rate, "weight_decay": weight_decay}
    for json_key, trainer_key in (("lr", "learning_rate"), ("weight_decay", "weight_decay")):
        if isinstance(params.get(json_key), (int, float)):  # the user's own value, given to autofit
            recipe[trainer_key] = params[json_key]
    return launchers.trainer_arguments(ds, output_dir=output_dir, max_steps=max_steps, logging_steps=1,
                                       save_strategy="no", report_to="none", dataloader_num_workers=0, **recipe)


def prepare_model(ds: dict[str, Any], learning_rate: float = 5e-5, weight_decay: float = 0.0) -> tuple[torch.nn.Module, Any]:
    """The model with the JSON's attention kernel, partial checkpointing and fp8 applied, and the
    optimizer the Trainer must be handed (None when DeepSpeed or ``optim`` builds it; its ``"auto"``
    hyperparameters are the script's ``learning_rate`` and ``weight_decay``)."""
    from autofit.ds.apply import apply_checkpointing, apply_fp8, client_optimizer

    section = ds.get("autofit", {})
    model = build_model(section.get("attention", "sdpa"))
    ratio = float(section.get("checkpoint_ratio", 0.0))
    granularity = section.get("checkpoint_granularity", "block")
    if 0.0 < ratio < 1.0 or (ratio and granularity == "attention"):
        apply_checkpointing(model, model.model.layers, ratio, granularity)
    if isinstance(section.get("fp8"), dict):
        apply_fp8(model, str(section["fp8"].get("recipe", "tensorwise")))
    client = section.get("client_optimizer")
    optimizer = None
    if "optimizer" not in ds and client and client["class"] not in TRAINER_OPTIM:
        optimizer = client_optimizer(model, ds, lr=learning_rate, weight_decay=weight_decay)
    return model, optimizer


class RandomTokens(torch.utils.data.Dataset):
    """``n`` random sequences, one sample at a time, as the Trainer's data collator expects."""

    def __init__(self, n: int) -> None:
        self.batch = make_batch(n)

    def __len__(self) -> int:
        return len(self.batch["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: value[i] for key, value in self.batch.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", default="ds_config.json", help="The DeepSpeed JSON autofit wrote.")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--output-dir", default="hf-trainer-out")
    parser.add_argument("--learning-rate", type=float, default=5e-5, help="Where the JSON says 'auto'.")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="Where the JSON says 'auto'.")
    args = parser.parse_args(argv)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)  # what a launcher sets; one process without one
    from transformers import Trainer, TrainingArguments

    ds = json.loads(Path(args.deepspeed).read_text())
    model, optimizer = prepare_model(ds, args.learning_rate, args.weight_decay)
    kwargs = trainer_arguments(ds, args.output_dir, args.max_steps, args.learning_rate, args.weight_decay)
    training_args = TrainingArguments(**(kwargs | {"deepspeed": args.deepspeed}))
    n_samples = training_args.world_size * ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(n_samples * args.max_steps),
                      optimizers=(optimizer, None))
    result = trainer.train()
    print(json.dumps({"global_step": result.global_step, "train_loss": result.training_loss}))


if __name__ == "__main__":
    main()
