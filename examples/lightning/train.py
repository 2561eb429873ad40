"""Train an autofit workload with Lightning's ``DeepSpeedStrategy`` and the DeepSpeed JSON autofit emitted.

    autofit run examples/mlp.py:workload --hardware cpu --memory 1GiB --global-batch 8 --space cpu --out ds_config.json
    DS_ACCELERATOR=cpu python examples/lightning/train.py examples/mlp.py:workload --deepspeed ds_config.json --max-steps 3

(``pip install -e '.[lightning]'``.) Lightning fills no ``"auto"``, and the JSON holds one for each optimizer
hyperparameter the user gave autofit none of: :func:`autofit.ds.launchers.fill_auto` fills them with the script's own
(``--learning-rate``, ``--weight-decay``, ``--adam-beta1/2``, ``--adam-epsilon``; defaults: torch.optim.AdamW's),
the client optimizer's included; a number in the JSON is the user's, as given to autofit, and stays.
:func:`autofit.ds.launchers.lightning_arguments` then splits the JSON into
``DeepSpeedStrategy(config=...)`` and the ``Trainer`` keywords Lightning wants instead: it sets
``gradient_accumulation_steps`` itself from ``accumulate_grad_batches`` and refuses the key in the config,
and its ``precision`` must name the JSON's bf16/fp16. What DeepSpeed's JSON cannot say (the ``"autofit"``
section) is applied as :mod:`autofit.ds.apply` describes: the model is built in ``configure_model`` (under
``deepspeed.zero.Init`` with ZeRO-3, as Lightning's strategy arranges), checkpointing and fp8 on it, and a
client optimizer from ``configure_optimizers`` (Lightning uses it only when the JSON has no ``optimizer``
section).

On the CPU. Lightning 2.x's ``DeepSpeedStrategy`` is CUDA-only as shipped (lightning/pytorch/strategies/
deepspeed.py): ``setup_environment`` raises "The DeepSpeed strategy is only supported on CUDA GPUs" for any
other accelerator; ``setup_distributed`` requires each device's index to equal its process's local rank, and
a CPU device has no index; ``_setup_model_and_optimizer`` passes ``device_rank=root_device.index`` to
``deepspeed.initialize``, None for the CPU, which DeepSpeed compares with 0 (deepspeed/runtime/engine.py,
``_set_distributed_vars``). :func:`cpu_deepspeed_strategy` lifts those three, nothing else: with
``DS_ACCELERATOR=cpu`` DeepSpeed runs its CPU accelerator over gloo. Tested on the CPU: fp32 with ZeRO 0
and 1 (tests/examples/test_lightning.py). Not tried there: ZeRO-3 (Lightning's ``zero.Init`` path),
offload, bf16. DeepSpeed's own CPU limits apply: no fused CUDA optimizers (the JSON says ``torch_adam``;
Lion goes as a client optimizer), fp16 only where oneDNN has it
(deepspeed/accelerator/cpu_accelerator.py, ``is_fp16_supported``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from autofit.ds import launchers


def cpu_deepspeed_strategy(config: dict[str, Any]) -> Any:
    """Lightning's ``DeepSpeedStrategy(config=config)``, let onto the CPU (see the module's docstring)."""
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            # DeepSpeedStrategy's override only refuses a non-CUDA accelerator before calling DDP's
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            # DeepSpeedStrategy's, less _validate_device_index_selection: a CPU device has no index to match the rank
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
            import deepspeed

            # lightning/pytorch/strategies/deepspeed.py, with the local rank for the device index the CPU lacks
            engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False)
            return engine, deepspeed_optimizer

    return CPUDeepSpeedStrategy(config=config, process_group_backend="gloo")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entry", help="An autofit entry point, path/to/file.py:function.")
    parser.add_argument("--deepspeed", default="ds_config.json", help="The DeepSpeed JSON autofit wrote.")
    parser.add_argument("--max-steps", type=int, default=3, help="Optimizer steps.")
    launchers.add_hyperparameter_arguments(parser)
    args = parser.parse_args(argv)
    import lightning.pytorch as pl

    from autofit.ds.apply import apply_to_model, client_optimizer
    from autofit.ds.launchers import fill_auto, lightning_arguments
    from autofit.workload.entry import load_workload

    ds = fill_auto(json.loads(Path(args.deepspeed).read_text()), **launchers.hyperparameters_from(args))
    workload = load_workload(args.entry)
    config, trainer_kwargs = lightning_arguments(ds)

    class WorkloadModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:  # built once, inside the strategy's deepspeed.zero.Init under ZeRO-3
                self.model = workload.build_model(ds.get("autofit", {}).get("attention"))
                apply_to_model(self.model, ds, workload.repeated_layers(self.model), workload.attention_of)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = workload.compute_loss(self.model, batch)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            # called only when the JSON has no optimizer section: the client optimizer autofit chose
            return client_optimizer(self.model, ds)

    module = WorkloadModule()
    micro = int(ds["train_micro_batch_size_per_gpu"])
    n_samples = micro * trainer_kwargs.get("accumulate_grad_batches", 1) * args.max_steps
    loader = torch.utils.data.DataLoader(launchers.BatchSamples(workload.batch(n_samples)), batch_size=micro)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=cpu_deepspeed_strategy(config), max_steps=args.max_steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_kwargs)
    trainer.fit(module, loader)
    engine = trainer.strategy.deepspeed_engine  # type: ignore[attr-defined]
    print(json.dumps({"global_step": trainer.global_step, "deepspeed_global_steps": engine.global_steps,
                      "micro_batches": len(module.losses), "first_loss": module.losses[0],
                      "last_loss": module.losses[-1]}))


if __name__ == "__main__":
    main()
