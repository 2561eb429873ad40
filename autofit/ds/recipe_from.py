"""The recipe read from what the user already has: their DeepSpeed JSON, or the Trainer's ``TrainingArguments``.

``--recipe-from FILE`` (and :func:`read_recipe`) takes either a DeepSpeed JSON (the one a script is given with
``--deepspeed_config``) or ``TrainingArguments.to_json_string()``'s output; :func:`from_training_arguments` also
takes the object itself. Each gives a :class:`ReadRecipe`: the optimizer, the precision and the hyperparameters the
source states (None where it states nothing), which :func:`autofit.core.recipe.recipe_for` merges with the flags.
Names autofit has no model of (DeepSpeed's 1-bit optimizers, LAMB, GaLore, ...) are one :class:`AutofitError`
saying which name and how to state the recipe instead. docs/recipe.md, "Reading the recipe", gives the mapping.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autofit.core.errors import AutofitError
from autofit.core.recipe import HYPERPARAMETER_OPTIMIZERS

#: DeepSpeed's optimizer ``type`` -> autofit's optimizer. DeepSpeed lower-cases its own names (adam, adamw, lion,
#: ...; deepspeed/runtime/config.py, DEEPSPEED_OPTIMIZERS) and looks any other up in ``torch.optim`` as written
#: (deepspeed/runtime/engine.py, ``_configure_basic_optimizer``). ``adam`` is AdamW unless ``adam_w_mode`` is false.
DEEPSPEED_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "lion": "lion", "SGD": "sgd", "Adafactor": "adafactor"}
#: the names DeepSpeed lower-cases (its own); any other is a ``torch.optim`` class name, case and all
DEEPSPEED_OWN = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
#: DeepSpeed names autofit refuses, with the reason
DEEPSPEED_REFUSED = {
    "onebitadam": "DeepSpeed's 1-bit Adam compresses the gradients' communication (removed from recent DeepSpeed)",
    "zerooneadam": "DeepSpeed's 0/1 Adam compresses the gradients' communication (removed from recent DeepSpeed)",
    "onebitlamb": "DeepSpeed's 1-bit LAMB compresses the gradients' communication (removed from recent DeepSpeed)",
    "lamb": "LAMB (FusedLamb) has its own update and states",
    "adagrad": "Adagrad has its own update and states",
    "muadam": "MuAdam (mup) scales each layer's rate", "muadamw": "MuAdamW (mup) scales each layer's rate",
    "musgd": "MuSGD (mup) scales each layer's rate", "muon": "Muon orthogonalizes the updates of 2-D weights",
}
#: ``TrainingArguments.optim`` -> autofit's optimizer (transformers/trainer_optimizer.py, _OPTIMIZER_HANDLERS):
#: torch's and bitsandbytes' AdamW in 32 bits are AdamW; bitsandbytes' 8-bit AdamW (paged or not) is adamw8bit;
#: bitsandbytes' 32-bit Lion is Lion; paging moves states to the host under memory pressure, the update is the same
TRAINER_OPTIMIZERS = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_torch_xla": "adamw", "adamw_torch_npu_fused": "adamw",
    "paged_adamw_32bit": "adamw", "adamw_bnb_8bit": "adamw8bit", "adamw_8bit": "adamw8bit",
    "paged_adamw_8bit": "adamw8bit", "lion_32bit": "lion", "paged_lion_32bit": "lion", "adafactor": "adafactor",
    "sgd": "sgd",
}


@dataclass(frozen=True)
class ReadRecipe:
    """What a source states of the recipe; None (or a hyperparameter left out) where it states nothing."""

    source: str
    """Where it was read: ``ds_config.json (DeepSpeed JSON)``, ``TrainingArguments``, ..."""
    optimizer: str | None = None
    """autofit's name of the optimizer the source trains with."""
    precision: str | None = None
    """autofit's name of the precision the source trains in."""
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    """``lr``, ``weight_decay``, ``betas``, ``eps``, ``momentum`` as the source gives them (``"auto"`` left out)."""

    def stated(self) -> str:
        """``optimizer, precision, lr, betas``: the parts the source states, for the report's line."""
        parts = [k for k in ("optimizer", "precision") if getattr(self, k) is not None]
        return ", ".join([*parts, *self.hyperparameters]) or "nothing"


#: keys only ``TrainingArguments.to_json_string()`` writes (every one of them, whatever was set)
TRAINING_ARGUMENTS_KEYS = ("output_dir", "optim", "learning_rate", "per_device_train_batch_size")
#: top-level keys of a DeepSpeed JSON that say something of the recipe or the batch (deepspeed/runtime/constants.py)
DEEPSPEED_KEYS = ("optimizer", "bf16", "bfloat16", "fp16", "torch_autocast", "zero_optimization", "train_batch_size",
                  "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "scheduler", "gradient_clipping")


def read_recipe(path: str | Path) -> ReadRecipe:
    """The recipe in the JSON file ``path``: ``TrainingArguments.to_json_string()``'s output (any of
    :data:`TRAINING_ARGUMENTS_KEYS`) or a DeepSpeed JSON (any of :data:`DEEPSPEED_KEYS`); a file that is neither, or
    unreadable, is one :class:`AutofitError`."""
    path = Path(path)
    data = _read_json_object(path, f"--recipe-from {path}")
    if any(key in data for key in TRAINING_ARGUMENTS_KEYS):
        return from_training_arguments(data, source=f"{path.name} (TrainingArguments)", base=path.parent)
    if any(key in data for key in DEEPSPEED_KEYS):
        return from_deepspeed(data, source=f"{path.name} (DeepSpeed JSON)")
    raise AutofitError(f"--recipe-from {path}: neither a DeepSpeed JSON (none of {', '.join(DEEPSPEED_KEYS)}) nor a "
                       f"TrainingArguments JSON (none of {', '.join(TRAINING_ARGUMENTS_KEYS)})")


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in the file ``path``; anything else is one :class:`AutofitError` that starts with ``what``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AutofitError(f"{what}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise AutofitError(f"{what}: expected a JSON object, but got {type(data).__name__}")
    return data


def from_deepspeed(ds: Mapping[str, Any], source: str = "the DeepSpeed JSON") -> ReadRecipe:
    """The recipe a DeepSpeed JSON states, read with DeepSpeed's own config getters: the ``optimizer`` section's
    type and params, and ``bf16``/``fp16`` (neither enabled: fp32, DeepSpeed's default). No optimizer section
    (the script builds its own) and ``"auto"`` values state nothing."""
    from deepspeed.runtime.config import get_optimizer_name, get_optimizer_params

    ds = dict(ds)
    _check_optimizer_section(ds.get("optimizer"), source)
    name = get_optimizer_name(ds)
    params = dict(get_optimizer_params(ds) or {})
    optimizer = None if name is None else deepspeed_optimizer(name, params, source)
    return ReadRecipe(source=source, optimizer=optimizer, precision=deepspeed_precision(ds, source),
                      hyperparameters=_taken(optimizer, {k: params[k] for k in HYPERPARAMETER_OPTIMIZERS if k in params}))


def _check_optimizer_section(section: Any, source: str) -> None:
    """A DeepSpeed ``optimizer`` section as DeepSpeed reads it: a mapping with a string ``type`` and, if any, a
    mapping of ``params`` (its getters fail with a bare TypeError otherwise)."""
    if section is None:
        return
    if not isinstance(section, Mapping) or not isinstance(section.get("type"), str):
        raise AutofitError(f'{source}: "optimizer" must be an object with a string "type", but got {section!r}')
    if not isinstance(section.get("params", {}), Mapping):
        raise AutofitError(f'{source}: "optimizer.params" must be an object, but got {section["params"]!r}')


def deepspeed_optimizer(name: str, params: Mapping[str, Any], source: str) -> str:
    """autofit's optimizer for DeepSpeed's ``type`` ``name`` (and its ``adam_w_mode``); an error for one it has none of."""
    key = name.lower() if name.lower() in DEEPSPEED_OWN or name.lower() in DEEPSPEED_REFUSED else name
    if key in DEEPSPEED_REFUSED:
        raise AutofitError(f"{source}: optimizer type {name!r} is not one autofit models ({DEEPSPEED_REFUSED[key]}); "
                           f"state the recipe with --optimizer (one of adamw, adamw8bit, lion, adafactor, sgd, adam_mini)")
    if key == "adam" and params.get("adam_w_mode", True) is False and params.get("weight_decay", 0) not in (0, 0.0):
        raise AutofitError(f"{source}: optimizer {name!r} with adam_w_mode false applies weight decay as L2 in the "
                           "gradient, which autofit's adamw (decoupled decay) does not compute; set adam_w_mode true "
                           "or weight_decay 0, or state the recipe with --optimizer")
    if key not in DEEPSPEED_OPTIMIZERS:
        raise AutofitError(f"{source}: optimizer type {name!r} is not one autofit models (known: "
                           f"{', '.join(sorted(set(DEEPSPEED_OPTIMIZERS)))}); state the recipe with --optimizer")
    return DEEPSPEED_OPTIMIZERS[key]


def deepspeed_precision(ds: Mapping[str, Any], source: str) -> str | None:
    """``bf16``/``fp16`` where DeepSpeed's section enables it, ``fp32`` where neither is, None where one is ``"auto"``
    (the Hugging Face Trainer fills it). ``torch_autocast`` (fp32 weights, 16-bit compute) is refused: autofit
    prices DeepSpeed's bf16/fp16 modes, which keep 16-bit weights."""
    from deepspeed.runtime.config import get_torch_autocast_enabled
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    sections = {"bf16": ds.get("bf16", ds.get("bfloat16")), "fp16": ds.get("fp16")}
    if any(isinstance(s, Mapping) and s.get("enabled") == "auto" for s in sections.values()):
        return None
    if get_torch_autocast_enabled(dict(ds)):
        raise AutofitError(f"{source}: torch_autocast (fp32 weights, 16-bit compute) is not a precision autofit "
                           "prices; state the recipe with --precision bf16 or fp32")
    try:
        bf16, fp16 = get_bfloat16_config(dict(ds)).enabled, get_float16_config(dict(ds)).enabled
    except Exception as exc:  # DeepSpeed's pydantic models reject a malformed section
        raise AutofitError(f"{source}: DeepSpeed rejects its bf16/fp16 section: {str(exc).splitlines()[0]}") from None
    if bf16 and fp16:
        raise AutofitError(f"{source}: bf16 and fp16 are both enabled, which DeepSpeed refuses: enable the one you train in")
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def from_training_arguments(args: Any, source: str = "TrainingArguments", base: Path | None = None) -> ReadRecipe:
    """The recipe the Hugging Face Trainer trains with, from a ``TrainingArguments`` (or its ``to_dict()`` /
    ``to_json_string()`` output): ``optim`` (:data:`TRAINER_OPTIMIZERS`), ``learning_rate``, ``weight_decay``,
    ``adam_beta1/2`` and ``adam_epsilon`` where the optimizer takes them, SGD's ``momentum`` from ``optim_args``,
    and ``bf16``/``fp16`` (neither: fp32). Where ``deepspeed`` names a JSON with an ``optimizer`` section, the
    Trainer trains with that section, its ``"auto"`` values filled from these arguments (transformers/integrations/
    deepspeed.py, ``trainer_config_process``): so does this. ``base``: the folder a relative ``deepspeed`` path is in."""
    get = args.get if isinstance(args, Mapping) else lambda key, default=None: getattr(args, key, default)
    optim = get("optim") if get("optim") is not None else _trainer_default_optim()
    optim = str(getattr(optim, "value", optim))
    precision = "bf16" if get("bf16") else "fp16" if get("fp16") else "fp32"
    given = {"lr": get("learning_rate"), "weight_decay": get("weight_decay"),
             "betas": (get("adam_beta1"), get("adam_beta2")), "eps": get("adam_epsilon"),
             "momentum": _optim_args(get("optim_args")).get("momentum")}
    given = {k: v for k, v in given.items() if v is not None and v != (None, None)}
    for key, value in given.items():
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in _values(value)):
            raise AutofitError(f"{source}: {key} must be a number, but got {value!r}")
    ds = _deepspeed_section(get("deepspeed"), base)
    if ds is not None and "optimizer" in ds:
        read = from_deepspeed(ds, source=f"{source}'s DeepSpeed JSON")
        params = dict(ds["optimizer"].get("params", {}))
        auto = {k: v for k, v in given.items() if params.get(k) == "auto"}
        return ReadRecipe(source=f"{source} and its DeepSpeed JSON", optimizer=read.optimizer,
                          precision=read.precision or precision,
                          hyperparameters=_taken(read.optimizer, {**auto, **read.hyperparameters}))
    if optim not in TRAINER_OPTIMIZERS:
        raise AutofitError(f"{source}: optim {optim!r} is not one autofit models (known: "
                           f"{', '.join(TRAINER_OPTIMIZERS)}); state the recipe with --optimizer")
    optimizer = TRAINER_OPTIMIZERS[optim]
    return ReadRecipe(source=source, optimizer=optimizer, precision=precision,
                      hyperparameters=_taken(optimizer, given))


def _trainer_default_optim() -> str:
    """``TrainingArguments``' own default ``optim`` (a JSON that leaves it out trains with it)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        raise AutofitError("a TrainingArguments JSON without optim trains with transformers' default optimizer, and "
                           "transformers is not installed: state optim in the file or the recipe with --optimizer") from None
    default = TrainingArguments.__dataclass_fields__["optim"].default
    return str(getattr(default, "value", default))


def _values(value: Any) -> tuple[Any, ...]:
    """A hyperparameter's numbers (``betas`` is a pair; a value may be partly None)."""
    return tuple(v for v in (value if isinstance(value, (list, tuple)) else (value,)) if v is not None)


def _taken(optimizer: str | None, values: Mapping[str, Any]) -> dict[str, Any]:
    """The ``values`` ``optimizer`` takes (:data:`~autofit.core.recipe.HYPERPARAMETER_OPTIMIZERS`), ``"auto"`` left out."""
    out = {}
    for key, value in values.items():
        if value == "auto" or (isinstance(value, (list, tuple)) and "auto" in value):
            continue
        if optimizer is None or optimizer in HYPERPARAMETER_OPTIMIZERS[key]:
            out[key] = tuple(value) if isinstance(value, list) else value
    return out


def _optim_args(text: Any) -> dict[str, float]:
    """``TrainingArguments.optim_args`` (``"momentum=0.9,nesterov=True"``): its numeric values."""
    out = {}
    for pair in str(text or "").replace(" ", "").split(","):
        key, _, value = pair.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def _deepspeed_section(value: Any, base: Path | None) -> dict[str, Any] | None:
    """``TrainingArguments.deepspeed`` as a dict: itself, or the JSON file it names (None: none given)."""
    if value is None or value == "":
        return None
    if isinstance(value, Mapping):
        return dict(value)
    path = Path(str(value))
    if not path.is_absolute() and base is not None and not path.exists():
        path = base / path
    return _read_json_object(path, f"TrainingArguments.deepspeed {value!r}")
