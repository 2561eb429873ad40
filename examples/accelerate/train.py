"""Train an autofit workload with Hugging Face Accelerate, DeepSpeed run from the JSON autofit emitted.

    autofit run examples/mlp.py:workload --hardware cpu --memory 1GiB --global-batch 8 --space cpu --out ds_config.json
    python -c "from autofit.ds.launchers import accelerate_config, write_accelerate_config; import json; \\
        write_accelerate_config('accelerate.yaml', accelerate_config(json.load(open('ds_config.json')), 'ds_config.json'))"
    DS_ACCELERATOR=cpu accelerate launch --config_file accelerate.yaml examples/accelerate/train.py \\
        examples/mlp.py:workload --deepspeed ds_config.json --max-steps 3

``accelerate launch`` reads the YAML :func:`autofit.ds.launchers.accelerate_config` wrote: ``distributed_type:
DEEPSPEED`` and the JSON's path (``ACCELERATE_DEEPSPEED_CONFIG_FILE``, also this script's default
``--deepspeed``). The optimizer's hyperparameters the user gave autofit none of are ``"auto"`` in the JSON;
Accelerate fills only ``lr`` and ``weight_decay`` of them (from its ``DummyOptim``: ``Accelerator._prepare_deepspeed``
in accelerate/accelerator.py) and stops at an ``"auto"`` ``betas`` or ``eps``. So the script fills them all with
its own (``--learning-rate``, ``--weight-decay``, ``--adam-beta1/2``, ``--adam-epsilon``; defaults: torch.optim.AdamW's)
through :func:`autofit.ds.launchers.fill_auto`, and hands Accelerate that filled copy as its DeepSpeed plugin's config
(``DeepSpeedPlugin(hf_ds_config=<dict>)``; the plugin's other settings come from ``accelerate launch`` as before).
A number in the JSON is the user's, as given to autofit, and stays. The script reads the same JSON for what
DeepSpeed's JSON cannot say (its ``"autofit"`` section: attention, checkpointing, fp8, a client optimizer), as
:mod:`autofit.ds.apply` describes. Where the JSON has an ``optimizer`` section DeepSpeed builds the optimizer and the
script hands ``accelerator.prepare`` a ``DummyOptim`` (accelerate refuses a real one beside the section).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from autofit.ds import launchers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entry", help="An autofit entry point, path/to/file.py:function.")
    parser.add_argument("--deepspeed", default=os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_config.json"),
                        help="The DeepSpeed JSON autofit wrote (default: the one the accelerate YAML names).")
    parser.add_argument("--max-steps", type=int, default=3, help="Optimizer steps.")
    launchers.add_hyperparameter_arguments(parser)
    args = parser.parse_args(argv)
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    from autofit.ds.apply import apply_to_model, build_context, client_optimizer
    from autofit.ds.launchers import fill_auto
    from autofit.workload.entry import load_workload

    ds = fill_auto(json.loads(Path(args.deepspeed).read_text()), **launchers.hyperparameters_from(args))
    workload = load_workload(args.entry)
    accumulation = int(ds["gradient_accumulation_steps"])
    # the plugin `accelerate launch` would make reads the file, "auto" and all; this one takes the filled copy and
    # reads the rest (ZeRO-3 init, ...) from the launcher's environment as that one would (DeepSpeedPlugin.__post_init__).
    # accelerate learns the JSON's accumulation only in prepare(), so it is given here too: the loop's boundaries
    # follow it from the first batch
    accelerator = Accelerator(gradient_accumulation_steps=accumulation, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
    with build_context(ds):
        model = workload.build_model(ds.get("autofit", {}).get("attention"))
    apply_to_model(model, ds, workload.repeated_layers(model), workload.attention_of)
    optimizer = client_optimizer(model, ds)
    if optimizer is None:
        # DeepSpeed builds it from the JSON's optimizer section, "auto" already filled: its lr and weight decay fill
        # nothing more and a number there wins (prepare() calls deepspeed_config_process with must_match=False)
        optimizer = DummyOptim(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    micro = int(ds["train_micro_batch_size_per_gpu"])
    n_micro = args.max_steps * accumulation
    loader = torch.utils.data.DataLoader(launchers.BatchSamples(workload.batch(micro * n_micro)), batch_size=micro)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        with accelerator.accumulate(engine):
            loss = workload.compute_loss(engine, batch)
            accelerator.backward(loss)  # DeepSpeed's backward and, at the accumulation boundary, its step
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    if accelerator.is_main_process:
        print(json.dumps({"global_step": engine.global_steps, "micro_batches": len(losses),
                          "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
                          "first_loss": losses[0], "last_loss": losses[-1]}))


if __name__ == "__main__":
    main()
