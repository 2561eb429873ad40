"""The user's training recipe: the optimizer, the numerics and their hyperparameters. Pure, no torch.

A search varies what computes the same training (micro-batch x accumulation at the same global batch,
checkpointing, ZeRO stage and offload, attention kernel); the optimizer and the precision are the user's
(docs/design.md, "The recipe is the user's"). A :class:`Recipe` states them. Substitutes that change the
numerics a little -- the same optimizer's 8-bit states, Adam-mini for AdamW, fp8 or fp16 for bf16,
mixed precision for fp32 -- enter a search only where the recipe allows them by name (``--allow
adamw8bit,fp8``) or by the shortcut ``near``; a different optimizer (Lion, SGD, Adafactor) only as the
recipe itself. docs/recipe.md gives the reasons and the sources.

:func:`differences` says, for any config, what differs from the recipe and what that means; the JSON's
``autofit`` section and the reports carry it. :func:`narrow_space` is what a search searches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from autofit.core.config import OPTIMIZERS, PRECISIONS
from autofit.core.errors import AutofitError

#: (config key, the recipe's value) -> {substitute value: what running it instead means}. Only these may stand
#: in for a recipe's value, and only where allowed; the sources are in docs/recipe.md.
SUBSTITUTES: dict[tuple[str, str], dict[str, str]] = {
    ("optimizer", "adamw"): {
        "adamw8bit": "AdamW with its two moments kept in 8 bits, block-wise quantized (bitsandbytes; Dettmers et al., "
                     "arXiv:2110.02861): the same update up to quantization error, a quarter of the state memory",
        "adam_mini": "Adam-mini (Zhang et al., arXiv:2406.16793): AdamW's first moment, but one second-moment value "
                     "per parameter block instead of per element: a different update rule, about half the state memory",
    },
    ("precision", "bf16"): {
        "fp8": "matmuls in float8 with tensorwise scales (torchao.float8), bf16 around them: matmul inputs keep "
               "3 mantissa bits instead of 7",
        "fp16": "fp16 with dynamic loss scaling instead of bf16: more mantissa, far less range; "
                "overflowing steps are skipped",
    },
    ("precision", "fp32"): {
        "bf16": "bf16 weights, gradients and activations with fp32 master weights and optimizer states instead of "
                "fp32 throughout: 7 mantissa bits in the forward and backward",
        "fp16": "fp16 weights, gradients and activations with fp32 master weights and dynamic loss scaling instead "
                "of fp32 throughout",
    },
    ("precision", "fp16"): {
        "bf16": "bf16 instead of fp16: the range of fp32 (no loss scaling) with 3 fewer mantissa bits",
    },
}
#: ZeRO++'s quantized communication (Wang et al. 2023, arXiv:2306.10209): ``--allow`` name -> (the config key it turns
#: on, what running it means). The recipe's own communication is exact, so these substitute any recipe. Not by
#: default: they change the numbers a step computes with, and DeepSpeed's tracker holds open reports against them
#: (deepspeedai/DeepSpeed#4852, "ZeRO++ is broken: zero_quantized_weights fails"; #6926, a ZeRO++ run whose loss and
#: gradient norm stopped moving).
QUANTIZED_COMMUNICATION: dict[str, tuple[str, str]] = {
    "qwz": ("quantized_weights",
            "ZeRO++'s qwZ: ZeRO-3's parameter all-gathers in int8 blocks with an fp32 scale each (sec. 3.1), so the "
            "forward and backward compute with weights rounded to 8 bits; the optimizer's own copy stays exact"),
    "qgz": ("quantized_gradients",
            "ZeRO++'s qgZ: the gradients averaged across nodes in int4 blocks by two all-to-alls (sec. 3.3) instead "
            "of a reduce-scatter in the working precision, so the optimizer steps on rounded gradients"),
}
#: ``--allow`` shortcuts -> the substitute values they stand for (each applies where it substitutes the recipe's)
SHORTCUTS: dict[str, tuple[str, ...]] = {
    # what the sources report as matching the recipe's training (docs/recipe.md): the same optimizer's 8-bit
    # states, Adam-mini for AdamW, fp8 matmuls for bf16
    "near": ("adamw8bit", "adam_mini", "fp8"),
}
#: hyperparameter -> the optimizers that take it (as DeepSpeed's optimizer params or the client class's keywords)
HYPERPARAMETER_OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "lr": OPTIMIZERS,
    "weight_decay": OPTIMIZERS,
    "betas": ("adamw", "adamw8bit", "adam_mini", "lion"),
    "eps": ("adamw", "adamw8bit", "adam_mini"),
    "momentum": ("sgd",),
}
#: what the Hugging Face Trainer fills in place of ``"auto"`` in the optimizer's params, from its
#: TrainingArguments (transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_process)
HF_AUTO_KEYS = ("lr", "betas", "eps", "weight_decay")
#: what a probe trains with where the user gave nothing: an optimizer step costs the same memory and time at
#: any learning rate or decay, so these only let DeepSpeed build the optimizer; never written into an emitted JSON
MEASURING_HYPERPARAMETERS: dict[str, Any] = {"lr": 1e-4, "weight_decay": 0.01, "momentum": 0.9}
#: the note the JSON's ``autofit`` section carries where a hyperparameter is ``"auto"``
AUTO_NOTE = ("'auto' hyperparameters are filled by the Hugging Face Trainer from its TrainingArguments; under "
             "Accelerate, Lightning or a script that calls deepspeed.initialize itself, replace them with the script's "
             "own (autofit.ds.launchers.fill_auto) or pass --lr, --weight-decay, ... to autofit")


def default_precision(device_kind: str, has_bf16: bool) -> str:
    """The precision a recipe means when the user names none: what the device trains in by default.

    A CPU trains in fp32 (PyTorch computes in the parameters' dtype, fp32, unless told otherwise); a GPU in its
    mixed precision: bf16 where it has it, fp16 with loss scaling where it does not.
    """
    if device_kind == "cpu":
        return "fp32"
    return "bf16" if has_bf16 else "fp16"


@dataclass(frozen=True)
class Recipe:
    """What the user trains: the optimizer, the precision, the substitutes they accept, the hyperparameters."""

    optimizer: str = "adamw"
    """The optimizer the user trains with (a config value of ``optimizer``)."""
    precision: str = "fp32"
    """The numerics the user trains in (a config value of ``precision``; see :func:`default_precision`)."""
    allow: tuple[str, ...] = ()
    """Substitute values the search may try instead (each a key of the recipe's :data:`SUBSTITUTES` entry)."""
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    """The user's optimizer hyperparameters (``lr``, ``weight_decay``, ``betas``, ``eps``, ``momentum``); the ones
    not given are ``"auto"`` in the emitted JSON (filled by the Hugging Face Trainer) unless ``auto`` is off."""
    auto: bool = True
    """Whether a hyperparameter not given is written ``"auto"`` (the Hugging Face Trainer, or
    :func:`autofit.ds.launchers.fill_auto` in a script, fills it) or left out (script mode: the unmodified script
    hands the JSON to ``deepspeed.initialize``, which fills nothing, so the optimizer class's own default applies)."""
    source: str = ""
    """Where parts of the recipe were read (``--recipe-from``; :mod:`autofit.ds.recipe_from`), and which parts:
    ``ds_config.json (DeepSpeed JSON): optimizer, precision, lr``; empty when all came from flags and defaults."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise AutofitError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, but got {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise AutofitError(f"precision must be one of {', '.join(PRECISIONS)}, but got {self.precision!r}")
        allowed = substitutes_of(self.optimizer, self.precision) | quantized_meanings()
        for value in self.allow:
            if value not in allowed:
                raise AutofitError(f"allow: {value!r} is not a substitute for {self._words()} "
                                   f"({_substitute_words(allowed)}){_hint(value)}")
        object.__setattr__(self, "allow", tuple(dict.fromkeys(self.allow)))
        object.__setattr__(self, "hyperparameters", checked_hyperparameters(self.optimizer, self.hyperparameters))

    def _words(self) -> str:
        return f"the recipe {self.optimizer} + {self.precision}"

    def values(self, key: str) -> tuple[Any, ...]:
        """The values of ``key`` (``optimizer`` or ``precision``; a key of :data:`QUANTIZED_COMMUNICATION`) a search
        may run: the recipe's, then the allowed."""
        for name, (quantized_key, _) in QUANTIZED_COMMUNICATION.items():
            if key == quantized_key:
                return (False, True) if name in self.allow else (False,)
        own = getattr(self, key)
        return (own, *(v for v in self.allow if v in SUBSTITUTES.get((key, own), {})))

    def to_dict(self) -> dict[str, Any]:
        """The JSON's ``autofit.core.recipe``; ``source`` only where something was read (:attr:`source`)."""
        return {"optimizer": self.optimizer, "precision": self.precision, "allow": list(self.allow),
                "hyperparameters": {k: list(v) if isinstance(v, tuple) else v for k, v in self.hyperparameters.items()},
                "auto": self.auto, **({"source": self.source} if self.source else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """The inverse of :meth:`to_dict` (a JSON's ``autofit.core.recipe``, a queued search's request)."""
        return cls(optimizer=data["optimizer"], precision=data["precision"], allow=tuple(data.get("allow", ())),
                   hyperparameters=dict(data.get("hyperparameters", {})), auto=bool(data.get("auto", True)),
                   source=str(data.get("source", "")))

    def optimizer_params(self, optimizer: str) -> dict[str, Any]:
        """The params of ``optimizer``'s JSON section: the user's values, ``"auto"`` for the rest the Hugging Face
        Trainer fills (:data:`HF_AUTO_KEYS`; left out without :attr:`auto`); a key it does not fill (SGD's momentum)
        is left to the class's default."""
        params: dict[str, Any] = {}
        for key, takers in HYPERPARAMETER_OPTIMIZERS.items():
            if optimizer not in takers:
                continue
            if key in self.hyperparameters:
                value = self.hyperparameters[key]
                params[key] = list(value) if isinstance(value, tuple) else value
            elif key in HF_AUTO_KEYS and self.auto:
                params[key] = "auto"
        return params


def for_plain_deepspeed(recipe: Recipe) -> Recipe:
    """``recipe`` for a JSON that a script hands to ``deepspeed.initialize`` as it is (script mode), which fills no
    ``"auto"``: the user's learning rate is required (an optimizer's default rate is nobody's recipe), the other
    hyperparameters not given are left to the optimizer class's defaults."""
    if "lr" in HYPERPARAMETER_OPTIMIZERS and recipe.optimizer in HYPERPARAMETER_OPTIMIZERS["lr"] \
            and "lr" not in recipe.hyperparameters:
        raise AutofitError("script mode writes the JSON your script hands to deepspeed.initialize, which cannot fill "
                           "'auto': give your --lr (and --weight-decay, --betas, --eps where yours differ from the "
                           "optimizer's defaults), or --recipe-from the DeepSpeed JSON your script trains with")
    return replace(recipe, auto=False)


def measuring_params(optimizer: str) -> dict[str, Any]:
    """The params a probe's JSON gives ``optimizer`` (:data:`MEASURING_HYPERPARAMETERS`, where it takes them)."""
    return {k: v for k, v in MEASURING_HYPERPARAMETERS.items() if optimizer in HYPERPARAMETER_OPTIMIZERS[k]}


def substitutes_of(optimizer: str, precision: str) -> dict[str, str]:
    """Every substitute value for the recipe ``optimizer`` + ``precision``, with what it means."""
    return SUBSTITUTES.get(("optimizer", optimizer), {}) | SUBSTITUTES.get(("precision", precision), {})


def quantized_meanings() -> dict[str, str]:
    """Each ``--allow`` name of ZeRO++'s quantized communication, with what it means (:data:`QUANTIZED_COMMUNICATION`)."""
    return {name: meaning for name, (_, meaning) in QUANTIZED_COMMUNICATION.items()}


def expand_allow(names: Iterable[str], optimizer: str, precision: str) -> tuple[str, ...]:
    """``--allow`` names -> substitute values: a shortcut (:data:`SHORTCUTS`) becomes those of its values that
    substitute this recipe's; a plain name is kept as it is (:class:`Recipe` refuses one that substitutes nothing)."""
    allowed = substitutes_of(optimizer, precision)
    out: list[str] = []
    for raw in names:
        for name in (n.strip().lower() for n in str(raw).split(",")):
            if not name:
                continue
            if name in SHORTCUTS:
                out.extend(v for v in SHORTCUTS[name] if v in allowed)
            else:
                out.append(name)
    return tuple(dict.fromkeys(out))


def checked_hyperparameters(optimizer: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` validated for ``optimizer``: known keys it takes, positive numbers, ``betas`` a pair in [0, 1)."""
    if not isinstance(values, Mapping):
        raise AutofitError(f"hyperparameters must be a mapping of name to value, but got {values!r}")
    out: dict[str, Any] = {}
    for key, value in values.items():
        takers = HYPERPARAMETER_OPTIMIZERS.get(key)
        if takers is None:
            raise AutofitError(f"unknown hyperparameter {key!r}; known: {', '.join(HYPERPARAMETER_OPTIMIZERS)}")
        if optimizer not in takers:
            raise AutofitError(f"hyperparameter {key}={value!r} is not one {optimizer} takes")
        if key == "betas":
            betas = tuple(value) if isinstance(value, (list, tuple)) else ()
            if len(betas) != 2 or not all(_number(b) and 0.0 <= b < 1.0 for b in betas):
                raise AutofitError(f"betas must be two numbers in [0, 1), but got {value!r}")
            out[key] = (float(betas[0]), float(betas[1]))
            continue
        if not _number(value) or value < 0 or (key in ("lr", "eps") and value == 0):
            kind = "a number > 0" if key in ("lr", "eps") else "a number >= 0"
            hint = ", finite" if isinstance(value, float) and not math.isfinite(value) else ""
            raise AutofitError(f"{key} must be {kind}{hint}, but got {value!r}")
        out[key] = float(value)
    return out


def parse_hyperparameters(pairs: Iterable[str]) -> dict[str, Any]:
    """``["lr=3e-4", "betas=0.9,0.95"]`` -> ``{"lr": 0.0003, "betas": (0.9, 0.95)}`` (checked by :class:`Recipe`)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = str(pair).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise AutofitError(f"an optimizer argument is key=value, but got {pair!r}")
        try:
            numbers = [float(part) for part in text.split(",")]
        except ValueError:
            raise AutofitError(f"{key} must be a number (betas: two, comma-separated), but got {text!r}") from None
        out[key] = tuple(numbers) if key == "betas" else (numbers[0] if len(numbers) == 1 else tuple(numbers))
    return out


def recipe_for(fixed: Mapping[str, Any], device_kind: str, has_bf16: bool, *, optimizer: str | None = None,
               precision: str | None = None, allow: Iterable[str] = (),
               hyperparameters: Mapping[str, Any] | None = None, read: Any = None) -> Recipe:
    """The recipe the user stated: ``optimizer``/``precision`` (``--optimizer``/``--precision``) or the same keys
    fixed with ``--set`` (naming the recipe too), then what ``read`` (an :class:`autofit.ds.recipe_from.ReadRecipe`,
    ``--recipe-from``) states, else AdamW and :func:`default_precision`. Two of these ways disagreeing on a value
    is an :class:`AutofitError`: the recipe is named once. The hyperparameters are ``read``'s with the flags'."""
    stated = {}
    for key, flag in (("optimizer", optimizer), ("precision", precision)):
        value = flag.lower() if isinstance(flag, str) else None
        if value is not None and key in fixed and fixed[key] != value:
            raise AutofitError(f"--{key} {value} and --set {key}={fixed[key]} disagree: name the recipe once")
        stated[key] = value if value is not None else fixed.get(key)
        from_read = getattr(read, key, None)
        if from_read is not None and stated[key] is not None and stated[key] != from_read:
            raise AutofitError(f"{read.source} says {key} {from_read}, the command line {stated[key]}: name the recipe "
                               "once (leave the flag out, or --recipe-from out)")
        stated[key] = stated[key] or from_read
    given = dict(hyperparameters or {})
    read_values = dict(getattr(read, "hyperparameters", {}))
    for key in set(given) & set(read_values):
        if _differ(given[key], read_values[key]):
            raise AutofitError(f"{read.source} says {key}={read_values[key]!r}, the command line {given[key]!r}: "
                               "name the recipe once")
    chosen_optimizer = stated["optimizer"] or "adamw"
    chosen_precision = stated["precision"] or default_precision(device_kind, has_bf16)
    return Recipe(optimizer=chosen_optimizer, precision=chosen_precision,
                  allow=expand_allow(allow, chosen_optimizer, chosen_precision),
                  hyperparameters=read_values | given,
                  source=f"{read.source}: {read.stated()}" if read is not None else "")


def _differ(a: Any, b: Any) -> bool:
    """Whether two hyperparameter values differ (a pair compared element-wise, numbers as floats)."""
    pair = [tuple(map(float, v)) if isinstance(v, (list, tuple)) else float(v) for v in (a, b)]
    return pair[0] != pair[1]


@dataclass(frozen=True)
class Difference:
    """One way a config differs from the recipe."""

    key: str
    """The config key (``optimizer``, ``precision``, or ZeRO++'s ``quantized_weights`` / ``quantized_gradients``)."""
    recipe: str
    """The recipe's value."""
    value: str
    """The config's value."""
    substitute: bool
    """Whether ``value`` is a substitute for the recipe's (:data:`SUBSTITUTES`), else a different recipe altogether."""
    allowed: bool
    """Whether the recipe allows this substitute (``--allow``); a ladder rung may show one it does not."""
    meaning: str
    """What running ``value`` instead means for the training."""

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "recipe": self.recipe, "value": self.value, "substitute": self.substitute,
                "allowed": self.allowed, "meaning": self.meaning}

    def label(self) -> str:
        """``fp8 for bf16``: a short label for tables."""
        return f"{self.value} for {self.recipe}"


def differences(recipe: Recipe, config: Any) -> tuple[Difference, ...]:
    """How ``config`` (a :class:`~autofit.core.config.Config`) differs from ``recipe``: empty for the exact recipe."""
    out = []
    for key in ("optimizer", "precision"):
        own, value = getattr(recipe, key), getattr(config, key)
        if value == own:
            continue
        meaning = SUBSTITUTES.get((key, own), {}).get(value)
        substitute = meaning is not None
        if meaning is None:
            meaning = (f"fp32 throughout instead of {own}: more precise and slower than the recipe"
                       if key == "precision" and value == "fp32" else
                       f"a different {key} than the recipe's {own}: not the same training")
        out.append(Difference(key=key, recipe=own, value=value, substitute=substitute,
                              allowed=value in recipe.allow, meaning=meaning))
    for name, (key, meaning) in QUANTIZED_COMMUNICATION.items():
        if getattr(config, key, False):
            out.append(Difference(key=key, recipe="off", value=name, substitute=True, allowed=name in recipe.allow,
                                  meaning=meaning))
    return tuple(out)


def narrow_space(space: Any, recipe: Recipe) -> Any:
    """``space`` (a :class:`~autofit.core.space.SearchSpace`) with its optimizer and precision lists narrowed to the
    recipe and its allowed substitutes, in the recipe's order, and ZeRO++'s quantized communication to what is
    allowed. A space that lacks the recipe's own value is one
    :class:`AutofitError` (the space was written for another recipe)."""
    values = dict(space.values)
    for key, _ in QUANTIZED_COMMUNICATION.values():  # exact communication unless allowed, whatever the space lists
        values[key] = tuple(v for v in recipe.values(key) if v in space.values[key]) or (False,)
    for key in ("optimizer", "precision"):
        listed = space.values[key]
        own = getattr(recipe, key)
        if own not in listed:
            raise AutofitError(f"search space {space.name!r} lists {key} {', '.join(map(str, listed))}, not the "
                               f"recipe's {own}: choose another --space, or name the recipe with --{key}")
        values[key] = tuple(v for v in recipe.values(key) if v in listed)
    return replace(space, values=values)


def recipe_line(recipe: Mapping[str, Any]) -> str:
    """One line naming the recipe the candidates keep (a recipe's ``to_dict``), and the substitutes allowed."""
    allowed = f"; substitutes allowed: {', '.join(recipe['allow'])}" if recipe["allow"] else " exactly (no --allow)"
    given = ", ".join(f"{k}={v}" for k, v in recipe["hyperparameters"].items()) or "none given: 'auto' in the JSON"
    read = f"; read from {recipe['source']}" if recipe.get("source") else ""
    return f"recipe: {recipe['optimizer']} + {recipe['precision']}{allowed}; hyperparameters: {given}{read}"


def _number(value: Any) -> bool:
    """A finite int or float (not a bool, not NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _substitute_words(allowed: Mapping[str, str]) -> str:
    return f"its substitutes: {', '.join(allowed)}" if allowed else "it has no substitutes"


def _hint(value: str) -> str:
    if value in OPTIMIZERS:
        return f"; to train with {value}, name it as the recipe: --optimizer {value}"
    if value in PRECISIONS:
        return f"; to train in {value}, name it as the recipe: --precision {value}"
    return f"; shortcuts: {', '.join(SHORTCUTS)}"
