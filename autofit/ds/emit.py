"""The DeepSpeed JSON of a candidate: every DeepSpeed key is written here, once.

DeepSpeed's JSON cannot say everything a config means: the checkpoint ratio and granularity, the
attention kernel, ``compile`` (``engine.compile()`` is a call, not a JSON field) and a bitsandbytes
optimizer go in an ``"autofit"`` section that DeepSpeed ignores and :func:`autofit.ds.apply.apply_to_model` (or the user, see the
README) applies. ``train_batch_size``, the micro-batch and the accumulation are
all written, so DeepSpeed checks the global batch itself.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from autofit.core.config import WORKING_BYTES, Config
from autofit.core.errors import AutofitError
from autofit.core.recipe import AUTO_NOTE, Recipe, differences, measuring_params
from autofit.core.software import Software, uses_torch_adam
from autofit.ds.buckets import zero_buckets
from autofit.ds.fp8 import FP8_RECIPE
from autofit.ds.swap_buffers import PARAM_SWAP_BUFFER_COUNT, param_swap_buffer_elements
from autofit.ds.tensor_parallel import with_tensor_parallel
from autofit.machine.software import detect_software

#: optimizer key -> DeepSpeed "optimizer.type"; DeepSpeed falls back to ``getattr(torch.optim, type)``
#: for names outside its own list (deepspeed/runtime/engine.py, _configure_basic_optimizer)
DEEPSPEED_OPTIMIZER_TYPE = {"adamw": "AdamW", "lion": "Lion", "adafactor": "Adafactor", "sgd": "SGD"}
#: optimizers DeepSpeed's JSON cannot name: the training script passes them as a client optimizer
CLIENT_OPTIMIZERS = ("adamw8bit", "adam_mini")
#: client optimizer classes, by import path: what ``autofit.ds.apply.client_optimizer`` builds
CLIENT_OPTIMIZER_CLASS = {
    "adamw8bit": "bitsandbytes.optim.AdamW8bit",
    "lion": "autofit.ds.optim.make_lion",
    "adam_mini": "autofit.ds.optim.make_adam_mini",
}
#: client optimizers built from the model rather than its parameters (Adam-mini partitions by parameter name)
MODEL_CLIENT_OPTIMIZERS = ("adam_mini",)


def deepspeed_config(
    config: Config, world_size: int = 1, device_kind: str = "cuda", software: Software | None = None,
    recipe: Recipe | None = None, largest_param_numel: int | None = None, hidden_size: int = 0,
    has_attention: bool = True,
) -> dict[str, Any]:
    """The exact DeepSpeed config ``config`` runs with on ``world_size`` data-parallel ranks.

    ``recipe``: the user's (:class:`autofit.core.recipe.Recipe`), for a JSON the user trains with: its
    hyperparameters go into the optimizer's params (``"auto"`` where it gives none, which the Hugging Face
    Trainer fills) and the ``autofit`` section says what ``config`` changes of it. None: a probe's JSON,
    whose optimizer gets :data:`autofit.core.recipe.MEASURING_HYPERPARAMETERS` (memory and step time do not
    depend on them) and which no user should train with.

    ``device_kind`` is ``cuda`` or ``cpu``: on the CPU DeepSpeed has no Lion kernel
    (FusedLion is CUDA-only) unless the optimizer is offloaded, so Lion goes as a client optimizer.
    ``software`` (default: this machine's) decides ``torch_adam`` where FusedAdam cannot be built,
    the NVMe path and whether offload buffers are pinned.
    ``largest_param_numel``: the traced model's largest parameter, which sizes NVMe parameter offload's swap
    buffers (:func:`with_param_swap_buffers`); None leaves DeepSpeed's default (100,000,000 elements, which a
    7B's embedding overflows). ``hidden_size``: the model's
    (:attr:`autofit.cost_model.facts.ModelFacts.hidden_size`), which ZeRO's bucket sizes are derived from
    (:mod:`autofit.ds.buckets`); 0: unknown. ``has_attention`` False (a model with no attention: a state-space
    model): the ``autofit`` section names no kernel.
    """
    software = software if software is not None else detect_software()
    ds: dict[str, Any] = {
        "train_batch_size": config.samples_per_step(world_size),
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
        "zero_optimization": _zero_section(config, software, hidden_size),
    }
    if largest_param_numel:
        ds = with_param_swap_buffers(ds, largest_param_numel, world_size, WORKING_BYTES[config.precision])
    if config.precision in ("bf16", "fp8"):
        ds["bf16"] = {"enabled": True}
    elif config.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    client = uses_client_optimizer(config, device_kind)
    if not client:
        params = optimizer_params(config, recipe)
        if uses_torch_adam(config.optimizer, config.offload_optimizer, device_kind, software):
            params["torch_adam"] = True  # torch.optim.AdamW: no nvcc to build FusedAdam (engine.py, TORCH_ADAM_PARAM)
        ds["optimizer"] = {"type": DEEPSPEED_OPTIMIZER_TYPE[config.optimizer], "params": params}
    if config.zero_stage > 0 or client or config.optimizer not in ("adamw", "lion"):
        ds["zero_allow_untested_optimizer"] = True
    ds = with_model_parallel(ds, config)
    ds["autofit"] = autofit_section(config, client, recipe, software)
    if not has_attention:  # a model with no attention (a state-space model): no kernel to name
        ds["autofit"].pop("attention")
        ds["autofit"]["config"].pop("attention")
    return ds


def with_model_parallel(ds: dict[str, Any], config: Config) -> dict[str, Any]:
    """``ds`` with ``config``'s AutoTP (:func:`autofit.ds.tensor_parallel.with_tensor_parallel`) and Ulysses SP degrees,
    where they are above 1."""
    if config.tensor_parallel > 1:
        ds = with_tensor_parallel(ds, config.tensor_parallel)
    if config.sequence_parallel > 1:
        # DeepSpeed derives the data-parallel size from it where no mpu is given (runtime/config.py); bf16 all-to-alls
        # as the ALST recipes run them
        ds["sequence_parallel_size"] = config.sequence_parallel
        if config.precision in ("bf16", "fp8"):
            ds["seq_parallel_communication_data_type"] = "bf16"
    return ds


def bare_engine_config(precision: str) -> dict[str, Any]:
    """The least DeepSpeed config ``deepspeed.initialize`` takes for a model in ``precision``: one sample a step,
    ZeRO off, no optimizer; 16-bit precisions as bf16 (what the CPU kernel footprint is measured beyond,
    :func:`autofit.probe.footprint.measure`)."""
    ds: dict[str, Any] = {"train_batch_size": 1, "zero_optimization": {"stage": 0}}
    if precision != "fp32":
        ds["bf16"] = {"enabled": True}
    return ds


def uses_client_optimizer(config: Config, device_kind: str) -> bool:
    """Whether the training script must build the optimizer itself (DeepSpeed's JSON cannot name it here)."""
    if config.optimizer in CLIENT_OPTIMIZERS:
        return True
    return config.optimizer == "lion" and device_kind == "cpu" and config.offload_optimizer == "none"


def optimizer_params(config: Config, recipe: Recipe | None) -> dict[str, Any]:
    """The optimizer's hyperparameters: the recipe's (``"auto"`` where it gives none), or a probe's measuring values
    where ``recipe`` is None. A substitute (AdamW8bit, Adam-mini for AdamW) takes the recipe's own values."""
    return measuring_params(config.optimizer) if recipe is None else recipe.optimizer_params(config.optimizer)


def autofit_section(config: Config, client: bool, recipe: Recipe | None = None,
                    software: Software | None = None) -> dict[str, Any]:
    """What DeepSpeed's JSON cannot express; DeepSpeed ignores unknown top-level keys.

    With the user's ``recipe``: the recipe, what ``config`` changes of it (``differs_from_recipe``, empty for the
    exact recipe) and, where a hyperparameter is ``"auto"``, who fills it. Without: ``"hyperparameters":
    "measuring"`` marks a probe's JSON. ``software``: what was assumed of the target's software
    (:meth:`autofit.core.software.Software.to_dict`; docs/design.md, "The target's software")."""
    section: dict[str, Any] = {
        "config": config.to_dict(),
        "checkpoint_ratio": config.checkpoint_ratio,
        "checkpoint_granularity": config.checkpoint_granularity,
        "attention": config.attention,
        # DeepSpeed's own "compile" section configures DeepCompile (deepspeed/compile/config.py) and compiles
        # nothing by itself: the script calls engine.compile() (autofit.ds.apply.compile_engine reads this)
        "compile": config.compile,
        # long context (docs/design.md, "Config keys"): applied by autofit.ds.apply with DeepSpeed's Ulysses SP,
        # TiledMLP (ceil((seq/sp)/hidden) tiles), sequence_tiled_compute (ceil(vocab/hidden) tiles) and its
        # checkpoint offload; SP is ZeRO-3 only (rules.sp_needs_zero3: the all_gather loss aggregation's gradient)
        "sequence_parallel": config.sequence_parallel,
        "tiled_mlp": config.tiled_mlp,
        "tiled_loss": config.tiled_loss,
        "offload_activations": config.offload_activations,
    }
    params = optimizer_params(config, recipe)
    if recipe is None:
        section["hyperparameters"] = "measuring"
    else:
        section["recipe"] = recipe.to_dict()
        section["differs_from_recipe"] = [d.to_dict() for d in differences(recipe, config)]
        if "auto" in params.values():
            section["hyperparameters"] = AUTO_NOTE
    if client:
        section["client_optimizer"] = {
            "class": CLIENT_OPTIMIZER_CLASS[config.optimizer],
            "params": params,
        }
        if config.optimizer in MODEL_CLIENT_OPTIMIZERS:
            section["client_optimizer"]["takes"] = "model"
    if config.precision == "fp8":
        # torchao.float8.convert_to_float8_training swaps nn.Linear for Float8Linear; DeepSpeed runs bf16 around it
        section["fp8"] = {"library": "torchao", "recipe": FP8_RECIPE}
    if software is not None:
        section["software"] = software.to_dict()
    return section


def _zero_section(config: Config, software: Software, hidden_size: int = 0) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage == 0:
        return zero
    buckets = zero_buckets(hidden_size, config.bucket_scale)
    zero |= {
        "reduce_bucket_size": buckets.reduce_bucket_size,
        "allgather_bucket_size": buckets.allgather_bucket_size,
        "overlap_comm": config.overlap_comm,
        "contiguous_gradients": config.contiguous_gradients,
        "reduce_scatter": True,
    }
    if config.zero_stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": buckets.stage3_prefetch_bucket_size,
            "stage3_max_live_parameters": buckets.stage3_max_live_parameters,
            "stage3_max_reuse_distance": buckets.stage3_max_reuse_distance,
            "stage3_param_persistence_threshold": buckets.stage3_param_persistence_threshold,
            "stage3_gather_16bit_weights_on_model_save": True,
        }
        if config.hpz_partition_size > 1:  # ZeRO++'s hpZ (runtime/zero/config.py, zero_hpz_partition_size)
            zero["zero_hpz_partition_size"] = config.hpz_partition_size
        if config.quantized_weights:  # ZeRO++'s qwZ and qgZ (runtime/zero/config.py)
            zero["zero_quantized_weights"] = True
        if config.quantized_gradients:
            zero["zero_quantized_gradients"] = True
    if config.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(config.offload_optimizer, software)
    if config.offload_params != "none":
        zero["offload_param"] = _offload(config.offload_params, software)
    return zero


def _offload(device: str, software: Software) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": software.pin_memory}
    if device == "nvme":
        if not software.nvme_path:
            raise AutofitError("NVMe offload needs --nvme-path DIR (a writable directory on the NVMe drive)")
        section["nvme_path"] = software.nvme_path
    return section


def with_param_swap_buffers(ds: dict[str, Any], largest_param_numel: int, world_size: int,
                            element_bytes: int) -> dict[str, Any]:
    """``ds`` with NVMe parameter offload's ``buffer_count`` and ``buffer_size`` sized for the largest parameter's
    partition (:func:`autofit.ds.swap_buffers.param_swap_buffer_elements`); ``ds`` itself where no parameter goes
    to NVMe. DeepSpeed's default ``buffer_size`` (1e8 elements) fails ``get_buffer``'s check on a 7 B model."""
    offload = ds.get("zero_optimization", {}).get("offload_param")
    if not offload or offload.get("device") != "nvme":
        return ds
    sized = {**offload, "buffer_count": PARAM_SWAP_BUFFER_COUNT,
             "buffer_size": param_swap_buffer_elements(largest_param_numel, world_size, element_bytes)}
    return {**ds, "zero_optimization": {**ds["zero_optimization"], "offload_param": sized}}


def check_with_deepspeed(ds: dict[str, Any]) -> None:
    """Let DeepSpeed's own ``DeepSpeedConfig`` parse ``ds``; raises its error if it refuses (an
    :class:`AutofitError` for a value JSON cannot hold, a NaN or an infinity).

    Outside a distributed run DeepSpeedConfig assumes one rank, so a multi-rank
    config is checked with ``train_batch_size`` left for DeepSpeed to derive (as a TP config leaves it:
    :func:`with_tensor_parallel`).
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    try:  # a NaN or an infinity is no JSON DeepSpeed can read (write_json_atomic refuses it too)
        json.dumps(ds, allow_nan=False)
    except ValueError as exc:
        raise AutofitError(f"the DeepSpeed JSON has a value that is not a finite number ({exc})") from exc
    checked = dict(ds)
    per_rank = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    if ds.get("train_batch_size", per_rank) != per_rank:
        # DeepSpeed would check train = micro x accum x world; with world unknown here, check divisibility
        if ds["train_batch_size"] % per_rank:
            raise AutofitError(
                f"train_batch_size {ds['train_batch_size']} is not micro-batch x accumulation {per_rank} "
                "x a whole number of ranks"
            )
        checked.pop("train_batch_size")
    DeepSpeedConfig(checked)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to a temporary file beside ``path`` and rename it into place."""
    try:  # allow_nan=False: a NaN or an infinity is no JSON DeepSpeed can read, never written
        text = json.dumps(data, indent=2, allow_nan=False)
    except ValueError as exc:
        raise AutofitError(f"the JSON for {path} has a value that is not a finite number ({exc})") from exc
    write_text_atomic(path, text + "\n")


def write_text_atomic(path: Path, text: str, *, private: bool = False) -> None:
    """Write ``text`` to a temporary file beside ``path``, flushed to disk, and rename it into place: a reader
    never sees half a file, and a failure leaves the old one as it was. The file keeps the mode of the one it
    replaces; a new one gets the umask's (``private``: 0600, a cache entry). A ``path`` that exists and is no
    regular file (a folder, a FIFO, a device) is refused, never replaced."""
    mode = 0o600 if private else existing_mode(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def existing_mode(path: Path) -> int:
    """The permission bits a file written at ``path`` gets: those of the regular file there, else ``0666`` less
    the umask (as ``open`` would); an :class:`AutofitError` where ``path`` is something else."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return 0o666 & ~current_umask()
    if not stat.S_ISREG(found.st_mode):
        kind = "a folder" if stat.S_ISDIR(found.st_mode) else "not a regular file"
        raise AutofitError(f"{path} is {kind}: name a file to write (it is never replaced)")
    return stat.S_IMODE(found.st_mode)


def current_umask() -> int:
    """This process's umask (read by setting it and back: there is no other portable way)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
