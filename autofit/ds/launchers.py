"""The emitted DeepSpeed JSON, handed to the ecosystem's launchers: the HF Trainer, Accelerate, Lightning.

Each launcher checks its own arguments against the JSON, or refuses keys it sets itself, so the
arguments are derived here from the JSON rather than typed twice:

* :func:`trainer_arguments` -- ``transformers.TrainingArguments`` keywords. The Trainer compares
  micro-batch, accumulation, clipping, precision and the optimizer's hyperparameters with the JSON
  (``HfTrainerDeepSpeedConfig.trainer_config_process`` in transformers/integrations/deepspeed.py) and
  fills a value written ``"auto"`` from its own arguments;
* :func:`accelerate_config` / :func:`write_accelerate_config` -- the YAML ``accelerate launch
  --config_file`` takes (``ClusterConfig`` in accelerate/commands/config/config_args.py), pointing
  the DeepSpeed plugin at the JSON file;
* :func:`lightning_arguments` -- ``lightning.pytorch.strategies.DeepSpeedStrategy(config=...)`` and the
  ``lightning.pytorch.Trainer`` keywords that go with it (Lightning sets ``gradient_accumulation_steps``
  from ``accumulate_grad_batches`` and refuses it in the config: strategies/deepspeed.py,
  ``_format_batch_size_and_grad_accum_config``).

The optimizer's hyperparameters (learning rate, weight decay, betas, eps) are the user's recipe:
they are never copied from the JSON into a launcher's arguments. Where the JSON holds a number the
launcher will compare, a disagreeing argument is an :class:`AutofitError` here rather than the
launcher's own error after the model is built. Where it holds ``"auto"`` (the user gave autofit none),
the Trainer fills it; for Accelerate and Lightning, which do not fill them all, :func:`fill_auto` writes
the script's own values into a copy of the JSON first.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from autofit.core.errors import AutofitError
from autofit.ds.apply import AUTO, compiles
from autofit.ds.apply import fill_auto as fill_auto  # the launchers' step, documented here too
from autofit.ds.apply import lookup as _lookup
from autofit.ds.emit import write_text_atomic
from autofit.ds.sequence_parallel import accelerate_parallelism, sp_degree, trainer_parallelism_config

#: a client optimizer class in the JSON's "autofit" section -> the Trainer's ``optim`` name for the same optimizer
TRAINER_OPTIM = {"bitsandbytes.optim.AdamW8bit": "adamw_bnb_8bit"}

#: DeepSpeed JSON key (dotted) -> the ``TrainingArguments`` keyword the Trainer checks it against and that this
#: module sets from it (HfTrainerDeepSpeedConfig.trainer_config_process)
TRAINER_FROM_JSON = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "bf16.enabled": "bf16",
    "fp16.enabled": "fp16",
}

#: optimizer hyperparameters the Trainer checks against the JSON but that stay the user's: never copied
TRAINER_HYPERPARAMETERS = {
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.weight_decay": "weight_decay",
    "optimizer.params.eps": "adam_epsilon",
}
#: ``optimizer.params.betas`` is checked against the pair (adam_beta1, adam_beta2)
TRAINER_BETAS = ("adam_beta1", "adam_beta2")

#: ``accelerate launch`` refuses these under ``deepspeed_config`` beside ``deepspeed_config_file`` (they are the
#: JSON's to say: DeepSpeedPlugin._deepspeed_config_checks in accelerate/utils/dataclasses.py)
ACCELERATE_DS_FIELDS_IN_JSON = (
    "gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
    "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path", "zero3_save_16bit_model",
    "mixed_precision",
)


def _uses_16bit(ds: Mapping[str, Any], section: str) -> bool | str:
    """A precision section's ``enabled``: True/False, or ``"auto"`` for the launcher to fill."""
    enabled = _lookup(ds, f"{section}.enabled")
    if enabled == AUTO:
        return AUTO
    return bool(enabled)


def checkpointing_by_trainer(ds: Mapping[str, Any]) -> bool:
    """Whether the Trainer's own activation checkpointing is the JSON's: every layer, whole blocks.

    The Trainer checkpoints every layer or none; a partial ratio, or attention-only (selective)
    checkpointing, is applied to the model with :func:`autofit.ds.apply.apply_checkpointing` instead.
    """
    section = ds.get("autofit", {})
    return float(section.get("checkpoint_ratio", 0.0)) == 1.0 and section.get("checkpoint_granularity", "block") == "block"


def trainer_optim(ds: Mapping[str, Any]) -> str | None:
    """The Trainer's ``optim`` name for the JSON's client optimizer, or None (DeepSpeed's ``optimizer``
    section builds it, or the script hands the Trainer the optimizer :func:`autofit.ds.apply.client_optimizer` builds)."""
    client = ds.get("autofit", {}).get("client_optimizer")
    if "optimizer" in ds or not client:
        return None
    return TRAINER_OPTIM.get(str(client["class"]))


def _trainer_defaults() -> dict[str, Any]:
    """``TrainingArguments``' own defaults for the hyperparameters the Trainer compares with the JSON."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return {name: fields[name].default for name in (*TRAINER_HYPERPARAMETERS.values(), *TRAINER_BETAS)}


def _trainer_field_names() -> frozenset[str]:
    from transformers import TrainingArguments

    return frozenset(TrainingArguments.__dataclass_fields__)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def check_trainer_hyperparameters(ds: Mapping[str, Any], arguments: Mapping[str, Any],
                                  defaults: Mapping[str, Any]) -> None:
    """Raise where a number in the JSON's ``optimizer.params`` differs from the Trainer's argument for it.

    ``arguments`` are the user's ``TrainingArguments`` keywords, ``defaults`` the Trainer's values for the
    ones not given. ``"auto"`` (or no such key) is filled by the Trainer and never differs.
    """
    def given(name: str) -> tuple[Any, str]:
        if name in arguments:
            return arguments[name], f"{name}={arguments[name]!r}"
        return defaults[name], f"{name}={defaults[name]!r} (the Trainer's default)"

    for dotted, name in TRAINER_HYPERPARAMETERS.items():
        value = _lookup(ds, dotted)
        if value is None or value == AUTO:
            continue
        ours, said = given(name)
        if float(value) != float(ours):
            raise AutofitError(f"the DeepSpeed JSON's {dotted} is {value!r} but the Trainer's {said}: pass "
                               f"{name}={value!r} (your recipe) or emit {dotted} as \"auto\"")
    betas = _lookup(ds, "optimizer.params.betas")
    if betas is not None and betas != AUTO:
        pair = [given(name) for name in TRAINER_BETAS]
        if [float(b) for b in betas] != [float(value) for value, _ in pair]:
            raise AutofitError(f"the DeepSpeed JSON's optimizer.params.betas is {list(betas)!r} but the Trainer's "
                               f"{', '.join(said for _, said in pair)}: pass adam_beta1/adam_beta2 or emit \"auto\"")


def trainer_keywords(ds: Mapping[str, Any], user_kwargs: Mapping[str, Any], *, cuda_available: bool,
                     field_names: frozenset[str] | None = None) -> dict[str, Any]:
    """The pure part of :func:`trainer_arguments`: this machine's facts passed in.

    ``field_names`` are ``TrainingArguments``' fields (None: transformers 4's names); from transformers 5
    the Trainer's checkpointing is ``activation_checkpointing``, ``gradient_checkpointing`` its deprecated alias.
    """
    kwargs: dict[str, Any] = {}
    for dotted, name in TRAINER_FROM_JSON.items():
        value = _uses_16bit(ds, dotted.split(".")[0]) if dotted.endswith(".enabled") else _lookup(ds, dotted)
        if value is None or value == AUTO:
            continue  # the Trainer fills "auto" from its own (the user's) arguments
        if name in user_kwargs and user_kwargs[name] != value:
            raise AutofitError(f"{name}={user_kwargs[name]!r} disagrees with the DeepSpeed JSON's {dotted} "
                               f"{value!r} (the Trainer refuses the mismatch): drop {name} or emit \"auto\"")
        kwargs[name] = value
    # without a GPU the Trainer refuses bf16 unless told it trains on the CPU ("Your setup doesn't support
    # bf16/gpu. You need to assign use_cpu"), and autofit emits bf16 where a CPU measured it fastest
    kwargs["use_cpu"] = not cuda_available
    checkpointing, checkpointing_kwargs = "gradient_checkpointing", "gradient_checkpointing_kwargs"
    if field_names is not None and "activation_checkpointing" in field_names:
        checkpointing, checkpointing_kwargs = "activation_checkpointing", "activation_checkpointing_kwargs"
    kwargs[checkpointing] = checkpointing_by_trainer(ds)
    # non-reentrant: what autofit's cost model and probe price (torch.utils.checkpoint, use_reentrant=False)
    kwargs[checkpointing_kwargs] = {"use_reentrant": False}
    optim = trainer_optim(ds)
    if optim is not None:
        kwargs["optim"] = optim
    if compiles(ds):
        # the Trainer hands torch_compile to accelerate's dynamo plugin, which calls DeepSpeed's engine.compile()
        # after deepspeed.initialize (accelerate/accelerator.py): what autofit.ds.apply.compile_engine calls
        kwargs["torch_compile"] = True
    if "deepspeed" not in user_kwargs:
        # the Trainer fills "auto" in place: hand it a copy, not the caller's mapping
        kwargs["deepspeed"] = copy.deepcopy(dict(ds))
    return kwargs | dict(user_kwargs)


def trainer_arguments(ds_config: Mapping[str, Any], /, **user_kwargs: Any) -> dict[str, Any]:
    """``TrainingArguments`` keywords that agree with the DeepSpeed JSON ``ds_config``.

    From the JSON: ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``max_grad_norm``,
    ``bf16``/``fp16`` (a value written ``"auto"`` is left to the Trainer), ``use_cpu`` where this machine
    has no GPU, the Trainer's own checkpointing when the ``"autofit"`` section checkpoints every layer
    (non-reentrant), ``optim`` for a client optimizer the Trainer knows (bitsandbytes' AdamW8bit), and
    ``deepspeed`` (a copy of the JSON) unless the caller passes a path. ``user_kwargs`` (output_dir,
    max_steps, learning_rate, ...) are added as they are; one that contradicts the JSON raises an
    :class:`AutofitError`, and so does a learning rate, weight decay, betas or eps that differ from a
    number in the JSON's ``optimizer`` section (the Trainer would refuse them after building the model).

    What the JSON's ``"autofit"`` section asks of the model is not a Trainer argument: the attention
    kernel (``attn_implementation`` when building it), partial or attention-only checkpointing
    (:func:`autofit.ds.apply.apply_checkpointing`), fp8 (:func:`autofit.ds.apply.apply_fp8`) and an optimizer
    the Trainer cannot name (:func:`autofit.ds.apply.client_optimizer`, given as ``optimizers=(opt, None)``).
    """
    check_trainer_hyperparameters(ds_config, user_kwargs, _trainer_defaults())
    use_cpu = user_kwargs.get("use_cpu")
    cuda_available = _cuda_available() if use_cpu is None else not use_cpu
    keywords = trainer_keywords(ds_config, user_kwargs, cuda_available=cuda_available,
                                field_names=_trainer_field_names())
    if sp_degree(ds_config) > 1 and "parallelism_config" not in user_kwargs:  # Ulysses SP (ds/sequence_parallel.py)
        keywords["parallelism_config"] = trainer_parallelism_config(ds_config)
    return with_sp_batch_left_to_accelerate(keywords, ds_config)


def with_sp_batch_left_to_accelerate(keywords: dict[str, Any], ds_config: Mapping[str, Any]) -> dict[str, Any]:
    """Under sequence parallelism the Trainer gets the JSON as a dict with ``train_batch_size: "auto"``: transformers
    checks it against ``world x micro x accumulation`` (``HfTrainerDeepSpeedConfig.trainer_config_process``, SP ranks
    counted as data-parallel), and accelerate then sets ``micro x accumulation x world / sp`` before
    ``deepspeed.initialize`` (``Accelerator._prepare_deepspeed``, accelerate/accelerator.py). A path the caller
    passed is replaced by the JSON it names (``ds_config``)."""
    if sp_degree(ds_config) == 1:
        return keywords
    given = keywords.get("deepspeed")
    config = copy.deepcopy(dict(given if isinstance(given, Mapping) else ds_config))
    config["train_batch_size"] = AUTO
    return keywords | {"deepspeed": config}


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AutofitError(f"{name} must be an integer >= 1, but got {name}={value!r}")


def _check_machines(num_processes: int, num_machines: int, machine_rank: int, main_process_ip: str | None) -> None:
    """One error line where accelerate's machine options cannot describe a launch."""
    _positive("num_processes", num_processes)
    _positive("num_machines", num_machines)
    if num_processes % num_machines:
        raise AutofitError(f"num_processes={num_processes} is not a whole number per machine over "
                           f"num_machines={num_machines}")
    if isinstance(machine_rank, bool) or not isinstance(machine_rank, int) or not 0 <= machine_rank < num_machines:
        raise AutofitError(f"machine_rank must be within 0 ... {num_machines - 1}, but got {machine_rank=}")
    if num_machines > 1 and not main_process_ip:
        raise AutofitError(f"num_machines={num_machines} needs main_process_ip (the address of machine 0)")


def _check_batch(ds_config: Mapping[str, Any], num_processes: int) -> None:
    """One error line where accelerate (or DeepSpeed, before any process starts) would refuse the JSON."""
    if not isinstance(ds_config.get("zero_optimization"), Mapping):
        # DeepSpeedPlugin: "Please specify the ZeRO optimization config in the DeepSpeed config."
        raise AutofitError("the DeepSpeed JSON has no zero_optimization section, which accelerate requires")
    train, micro, accumulation = (ds_config.get(key) for key in
                                  ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
    data_parallel = num_processes // sp_degree(ds_config)  # each SP group trains one micro-batch
    if isinstance(train, int) and isinstance(micro, int) and isinstance(accumulation, int) \
            and train != micro * accumulation * data_parallel:
        # DeepSpeed's own check (runtime/config.py, _batch_assertion), before any process starts
        ranks = f"num_processes={num_processes}" if sp_degree(ds_config) == 1 else \
            f"data-parallel size {data_parallel} (num_processes={num_processes} / sequence_parallel_size {sp_degree(ds_config)})"
        raise AutofitError(f"the DeepSpeed JSON's train_batch_size {train} is not micro-batch {micro} x "
                           f"accumulation {accumulation} x {ranks}")



def accelerate_config(ds_config: Mapping[str, Any], path_to_json: str | os.PathLike[str], *, num_processes: int = 1,
                      num_machines: int = 1, machine_rank: int = 0, main_process_ip: str | None = None,
                      main_process_port: int | None = None) -> dict[str, Any]:
    """The mapping ``accelerate launch --config_file`` reads, running the DeepSpeed JSON at ``path_to_json``.

    ``distributed_type: DEEPSPEED`` with ``deepspeed_config: {deepspeed_config_file: ...}``; everything
    DeepSpeed's JSON says (accumulation, clipping, ZeRO stage, offload, precision) stays in the JSON:
    accelerate refuses those fields, ``mixed_precision`` included, beside a config file
    (``DeepSpeedPlugin._deepspeed_config_checks``), and takes bf16/fp16 from the JSON. ``use_cpu`` stays
    false even on a CPU: ``accelerate launch`` with it set skips the DeepSpeed launcher (commands/launch.py,
    ``launch_command``); DeepSpeed runs on the CPU where ``DS_ACCELERATOR=cpu``. ``num_processes`` counts all
    processes of all machines, as accelerate's does. The JSON's path is made absolute: the launched script
    may run from another directory. Several machines use torchrun's rendezvous (``deepspeed_multinode_launcher:
    standard``), which needs no pdsh or hostfile.
    """
    _check_machines(num_processes, num_machines, machine_rank, main_process_ip)
    _check_batch(ds_config, num_processes)
    deepspeed: dict[str, Any] = {
        "deepspeed_config_file": os.path.abspath(os.fspath(path_to_json)),
        # deepspeed.zero.Init while the model is built: what the probe does under ZeRO-3 (autofit.ds.apply.build_context)
        "zero3_init_flag": _lookup(ds_config, "zero_optimization.stage") == 3,
    }
    if num_machines > 1:
        deepspeed["deepspeed_multinode_launcher"] = "standard"
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": deepspeed,
        "num_processes": num_processes,
        "num_machines": num_machines,
        "machine_rank": machine_rank,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
        "debug": False,
    }
    if accelerate_parallelism(ds_config):
        config["parallelism_config"] = accelerate_parallelism(ds_config)
    if compiles(ds_config):
        # accelerate's dynamo plugin calls DeepSpeed's engine.compile(backend="inductor") after deepspeed.initialize
        config["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    if main_process_ip is not None:
        config["main_process_ip"] = main_process_ip
    if main_process_port is not None:
        config["main_process_port"] = main_process_port
    return config


def write_accelerate_config(path: str | os.PathLike[str], config: Mapping[str, Any]) -> Path:
    """Write ``config`` (from :func:`accelerate_config`) as YAML, atomically (:func:`autofit.ds.emit.write_text_atomic`:
    a launcher never reads half a file). Returns the path written."""


    target = Path(path)
    write_text_atomic(target, yaml.safe_dump(dict(config), sort_keys=False))
    return target


def lightning_precision(ds: Mapping[str, Any]) -> str:
    """Lightning's ``precision`` for the JSON: ``bf16-mixed``/``16-mixed`` are DeepSpeed's bf16/fp16 sections
    (lightning/pytorch/plugins/precision/deepspeed.py casts the inputs to match), else ``32-true``."""
    bf16, fp16 = _uses_16bit(ds, "bf16"), _uses_16bit(ds, "fp16")
    if AUTO in (bf16, fp16):
        raise AutofitError("Lightning fills no \"auto\" in a DeepSpeed JSON: bf16.enabled / fp16.enabled must be "
                           "true or false")
    if bf16 and fp16:
        raise AutofitError("the DeepSpeed JSON enables both bf16 and fp16")
    return "bf16-mixed" if bf16 else "16-mixed" if fp16 else "32-true"


def lightning_arguments(ds_config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, trainer_kwargs)``: ``DeepSpeedStrategy(config=config)`` and ``lightning.pytorch.Trainer(**trainer_kwargs)``.

    Lightning sets ``gradient_accumulation_steps`` itself from ``accumulate_grad_batches`` and refuses it in
    the config; the micro-batch stays in the config (it must equal the DataLoader's ``batch_size``), and so
    does ``gradient_clipping`` (DeepSpeed clips; Lightning's ``gradient_clip_val`` only fills it when absent).
    Lightning fills no ``"auto"``: an ``"auto"`` batch key is dropped (Lightning takes the DataLoader's batch
    size and its Trainer's accumulation), an ``"auto"`` in the optimizer is an :class:`AutofitError`: fill the
    script's hyperparameters in first (:func:`fill_auto`).
    """
    config = copy.deepcopy(dict(ds_config))
    accumulation = config.pop("gradient_accumulation_steps", None)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping"):
        if config.get(key) == AUTO:
            del config[key]
    for key, value in (_lookup(config, "optimizer.params") or {}).items():
        if value == AUTO:
            raise AutofitError(f"Lightning fills no \"auto\" in a DeepSpeed JSON: optimizer.params.{key} is \"auto\"; "
                               f"fill it with the script's own first, fill_auto(ds, {key}=...)")
    trainer_kwargs: dict[str, Any] = {"precision": lightning_precision(config)}
    if accumulation is not None and accumulation != AUTO:
        _positive("gradient_accumulation_steps", accumulation)
        trainer_kwargs["accumulate_grad_batches"] = accumulation
    return config, trainer_kwargs


def add_hyperparameter_arguments(parser: argparse.ArgumentParser) -> None:
    """A training script's own optimizer hyperparameters, which fill the JSON's ``"auto"`` ones
    (:func:`fill_auto`), under the Hugging Face Trainer's names; defaults: ``torch.optim.AdamW``'s own."""
    adamw = _adamw_defaults()
    parser.add_argument("--learning-rate", type=float, default=adamw["lr"], help="Fills the JSON's \"auto\" lr.")
    parser.add_argument("--weight-decay", type=float, default=adamw["weight_decay"],
                        help="Fills the JSON's \"auto\" weight_decay.")
    parser.add_argument("--adam-beta1", type=float, default=adamw["betas"][0], help="Fills the JSON's \"auto\" betas.")
    parser.add_argument("--adam-beta2", type=float, default=adamw["betas"][1], help="Fills the JSON's \"auto\" betas.")
    parser.add_argument("--adam-epsilon", type=float, default=adamw["eps"], help="Fills the JSON's \"auto\" eps.")


def hyperparameters_from(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments of :func:`add_hyperparameter_arguments`, parsed, as :func:`fill_auto` takes them."""
    return {"lr": args.learning_rate, "weight_decay": args.weight_decay, "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon}


def _adamw_defaults() -> dict[str, Any]:
    """``torch.optim.AdamW``'s defaults, from its signature."""

    import torch

    return {name: p.default for name, p in inspect.signature(torch.optim.AdamW).parameters.items()}


class BatchSamples:
    """The samples of one workload batch (``Workload.batch(n)``: a dict, tuple or tensor of ``n`` rows), one at a
    time: what a ``torch.utils.data.DataLoader`` takes (any object with ``__len__`` and ``__getitem__``) and
    re-batches by the micro-batch, as Accelerate and Lightning feed a model."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __len__(self) -> int:
        first = next(iter(self.batch.values())) if isinstance(self.batch, dict) else self.batch
        return len(first[0] if isinstance(first, (tuple, list)) else first)

    def __getitem__(self, i: int) -> Any:
        if isinstance(self.batch, dict):
            return {key: value[i] for key, value in self.batch.items()}
        if isinstance(self.batch, (tuple, list)):
            return tuple(value[i] for value in self.batch)
        return self.batch[i]
