"""Apply what DeepSpeed's JSON cannot say: checkpointing (ratio, granularity), fp8 (torchao), a client optimizer,
``engine.compile()``, and the long-context keys (Ulysses SP, TiledMLP, the tiled loss, activation offload:
:mod:`autofit.ds.long_context`, whose functions are re-exported here).

``emit.deepspeed_config`` writes these into the JSON's ``"autofit"`` section; a
training script (and the probe) calls :func:`apply_to_model` before
``deepspeed.initialize``::

    ds = fill_auto(json.load(open("ds_config.json")), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    with build_context(ds):   # deepspeed.zero.Init(config_dict_or_path=ds) under ZeRO-3
        model = workload.build_model(attention=ds["autofit"].get("attention"))
    apply_to_model(model, ds, workload.repeated_layers(model))
    optimizer = client_optimizer(model, ds)   # None when DeepSpeed builds it
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      optimizer=optimizer, config=ds)
    compile_engine(engine, ds)                # engine.compile() where the JSON says "compile": "on"

Under ZeRO-3 the model is built inside ``deepspeed.zero.Init(config_dict_or_path=ds)``
(:func:`build_context`): each module's parameters are partitioned over the ranks as soon as
the module is made (in the JSON's precision, on the rank's device, or on the host with
parameter offload), so no rank ever holds the whole model. The cost model prices ZeRO-3
that way, and the probe builds that way.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autofit.core.errors import AutofitError
from autofit.core.recipe import HYPERPARAMETER_OPTIMIZERS, checked_hyperparameters
from autofit.ds.fp8 import convertible_linear
from autofit.ds.long_context import (
    LongContext,
    activation_offload_context,
    apply_long_context,
    causal_lm_loss,
    sequence_parallel_mpu,
    shard_batch,
)
from autofit.workload.types import find_attention_modules

#: attribute set on a layer whose forward runs under checkpointing (so wrapping is idempotent)
CHECKPOINTED_ATTR = "_autofit_checkpointed"


def n_checkpointed(n_layers: int, ratio: float) -> int:
    """``round(r x L)``, the number of leading layers that run under checkpointing."""
    if not 0.0 <= float(ratio) <= 1.0:
        raise AutofitError(f"checkpoint_ratio must be within 0.0 ... 1.0, but got {ratio!r}")
    return int(round(float(ratio) * n_layers))


def apply_checkpointing(model: Any, layers: Sequence[Any], ratio: float, granularity: str = "block",
                        attention_of: Callable[[Any], list[Any]] | None = None) -> int:
    """Run the first ``round(ratio x len(layers))`` layers under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: each whole layer (``granularity="block"``),
    or only its attention sub-modules (``"attention"``, selective checkpointing: the rest of the layer keeps
    its activations and is not recomputed). ``attention_of(layer)`` names them (default:
    :func:`autofit.workload.types.find_attention_modules`).

    The modules are patched in place (their ``forward`` is wrapped; parameters,
    state-dict keys and outputs are unchanged), so DeepSpeed and optimizers see
    the same module tree. Wrapping an already wrapped module is a no-op.
    A Hugging Face model's KV cache is turned off (``config.use_cache = False``, as
    ``gradient_checkpointing_enable`` does): a cache filled in forward changes what
    the recompute saves. Returns how many layers are checkpointed. A ratio above 0 with
    no layers, or attention granularity on a layer without attention, is an error: the config
    would claim a saving it cannot make.
    """
    if granularity not in ("block", "attention"):
        raise AutofitError(f"checkpoint_granularity must be block or attention, but got {granularity!r}")
    n_wrap = n_checkpointed(len(layers), ratio)
    if n_wrap:
        _disable_kv_cache(model)
    if ratio > 0 and not layers:
        raise AutofitError("checkpoint_ratio > 0 but the workload has no repeated layers to checkpoint")
    for index, layer in enumerate(list(layers)[:n_wrap]):
        if granularity == "block":
            _wrap_forward(layer)
            continue
        modules = (attention_of or _find_attention)(layer)
        if not modules:
            raise AutofitError(f"checkpoint_granularity=attention, but repeated layer {index} ({type(layer).__name__}) "
                               "has no attention sub-module; name it with Workload(attention_modules=...)")
        for module in modules:
            _wrap_forward(module)
    return n_wrap


def _find_attention(layer: Any) -> list[Any]:

    return find_attention_modules(layer)


def _disable_kv_cache(model: Any) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False


def is_checkpointed(layer: Any) -> bool:
    """True when :func:`apply_checkpointing` wrapped ``layer``."""
    return bool(getattr(layer, CHECKPOINTED_ATTR, False))


def _wrap_forward(layer: Any) -> None:
    if is_checkpointed(layer):
        return
    from torch.utils.checkpoint import checkpoint

    inner = layer.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward
    setattr(layer, CHECKPOINTED_ATTR, True)


def build_context(ds: dict[str, Any]) -> Any:
    """The context to build the model in: ``deepspeed.zero.Init(config_dict_or_path=ds)`` for ZeRO-3,
    a no-op context otherwise. ``torch.distributed`` is started first (``deepspeed.init_distributed``,
    as ``deepspeed.initialize`` would): zero.Init checks the JSON's batch against the world size.

    Where the workload uses transformers, a ZeRO-3 build also holds ``HfDeepSpeedConfig(ds)`` (transformers'
    integrations/deepspeed.py; its documented way to use ZeRO-3 without the Trainer), so a model made with
    ``from_config``/``from_pretrained`` initialises its weights module by module with the parameters
    gathered (``initialize_weights_zero3``). A transformers model made by its class's constructor inside
    zero.Init initialises nothing: its ``_init_weights`` sees empty partitions, and a parameter made with
    ``torch.empty`` (Mixtral's experts and router in transformers 5) keeps whatever the memory held --
    nan loss, every step skipped, which the probe reports as an error.
    """
    if ds.get("zero_optimization", {}).get("stage", 0) != 3:
        return contextlib.nullcontext()
    import deepspeed

    deepspeed.init_distributed()
    stack = contextlib.ExitStack()
    hf_config_class = hf_deepspeed_config_class()
    if hf_config_class is not None:
        hf_config = hf_config_class(ds)
        stack.callback(lambda: hf_config)  # transformers keeps only a weak reference: hold it while building
        if ds["zero_optimization"].get("zero_hpz_partition_size", 1) > 1:
            # from_config enters zero.Init itself, and a zero.Init inside another makes hpZ's group again and fails
            # (partition_parameters.py, Init.__init__: it asks only its own argument whether the group exists, and
            # groups.py _create_zero_param_parallel_group asserts): under hpZ the model is built in transformers'
            # Init alone, as the Trainer's from_pretrained builds it
            return stack
    stack.enter_context(deepspeed.zero.Init(config_dict_or_path=ds))
    return stack


def hf_deepspeed_config_class() -> Any | None:
    """``transformers.integrations.HfDeepSpeedConfig`` when the workload has imported transformers, else None
    (a model that does not use transformers is not charged its import: 16 MiB of resident memory). The probe
    calls it before its memory baseline, so the import is not measured as training memory."""
    if "transformers" not in sys.modules:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig


def client_optimizer(source: Any, ds: dict[str, Any], **hyperparameters: Any) -> Any | None:
    """The optimizer the training script must build itself, or None when DeepSpeed's JSON names one.

    Reads ``ds["autofit"]["client_optimizer"] = {"class": "pkg.mod.Class", "params": {...}}``
    (for ``adamw8bit``: ``bitsandbytes.optim.AdamW8bit``). ``source`` is the model (its trainable
    parameters are passed), or the parameters themselves for an optimizer that needs no names; one whose
    spec says ``"takes": "model"`` (``adam_mini``, which partitions by parameter name) gets the model.
    ``hyperparameters`` (the script's own ``lr=...``, ``weight_decay=...``) fill the params the JSON leaves
    ``"auto"`` (the user gave autofit none); one still ``"auto"`` is an :class:`AutofitError` naming it, never
    a made-up value.
    """
    spec = ds.get("autofit", {}).get("client_optimizer")
    if spec is None or "optimizer" in ds:
        return None
    params = {key: hyperparameters.get(key, value) if value == "auto" else value
              for key, value in spec.get("params", {}).items()}
    params = {key: tuple(v) if key == "betas" and isinstance(v, list) else v for key, v in params.items()}
    unfilled = [key for key, value in params.items() if value == "auto"]
    if unfilled:
        raise AutofitError(f"client optimizer {spec['class']!r}: {unfilled[0]} is 'auto' in the JSON (no value was "
                           f"given to autofit): pass the script's own, client_optimizer(model, ds, {unfilled[0]}=...)")
    module_name, _, class_name = spec["class"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise AutofitError(f"client optimizer {spec['class']!r} cannot be imported: {exc}") from exc
    is_model = hasattr(source, "named_parameters")
    if spec.get("takes") == "model":
        if not is_model:
            raise AutofitError(f"client optimizer {spec['class']!r} partitions by parameter name: pass the model, "
                               "client_optimizer(model, ds)")
        return cls(source, **params)
    parameters = [p for p in source.parameters() if p.requires_grad] if is_model else list(source)
    return cls(parameters, **params)


def apply_fp8(model: Any, recipe: str) -> int:
    """Convert the model's fp8-able ``nn.Linear`` layers to torchao's ``Float8Linear``, in place.

    ``torchao.float8.convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(recipe)``;
    a Linear is converted when :func:`autofit.ds.fp8.convertible_linear` accepts its dimensions. Returns
    how many were converted. Without torchao: an :class:`AutofitError` naming the extra to install.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise AutofitError(f"fp8 needs torchao (pip install -e '.[fp8]'): {exc}") from None

    def accept(module: Any, fqn: str) -> bool:
        return bool(convertible_linear(module.in_features, module.out_features))

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=accept)
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def compile_engine(engine: Any, ds: dict[str, Any]) -> bool:
    """``engine.compile()`` where the JSON's ``"autofit"`` section says ``"compile": "on"``; returns whether it did.

    DeepSpeed's own compile support (``DeepSpeedEngine.compile``, deepspeed/runtime/engine.py): it compiles the
    wrapped module with the accelerator's backend (inductor on CUDA and on the CPU) and keeps DeepSpeed's ZeRO
    hooks outside the graph (deepspeed/runtime/compiler.py). Call it after ``deepspeed.initialize``; the graph
    is built by the first forward and backward, which is why that step is slow (the probe times it apart as
    ``compile_s``). A model wrapped by hand in ``torch.compile`` would hide the parameters DeepSpeed hooks.
    """
    if not compiles(ds):
        return False
    engine.compile()
    return True


def compiles(ds: Mapping[str, Any]) -> bool:
    """Whether a DeepSpeed JSON's ``"autofit"`` section says ``"compile": "on"`` (:func:`compile_engine`)."""
    section = ds.get("autofit")
    return isinstance(section, Mapping) and str(section.get("compile", "off")) == "on"


def apply_to_model(model: Any, ds: dict[str, Any], layers: Sequence[Any],
                   attention_of: Callable[[Any], list[Any]] | None = None) -> int:
    """Apply the ``"autofit"`` section of a DeepSpeed JSON to a freshly built model.

    The checkpoint ratio and granularity (``attention_of``: the workload's hook naming each layer's attention,
    :meth:`autofit.workload.types.Workload.attention_of`), and for fp8 torchao's float8 conversion of the Linear
    layers (DeepSpeed's ``bf16`` section runs the rest), ``tiled_mlp`` and ``tiled_loss``
    (:func:`autofit.ds.long_context.apply_long_context`); the attention kernel is chosen when the model is
    built, the client optimizer by :func:`client_optimizer`, the SP groups by :func:`sequence_parallel_mpu`.
    Returns the number of checkpointed layers.
    """
    section = ds.get("autofit", {})
    n_ckpt = apply_checkpointing(model, layers, float(section.get("checkpoint_ratio", 0.0)),
                                 str(section.get("checkpoint_granularity", "block")), attention_of)
    fp8 = section.get("fp8")
    if isinstance(fp8, dict):
        apply_fp8(model, str(fp8.get("recipe", "tensorwise")))
    apply_long_context(model, ds, layers)
    return n_ckpt


# -- the "auto" hyperparameters: the user's values, for launchers that fill none (or not every one) ---------------

#: the value a Hugging Face launcher fills from its own arguments (transformers/integrations/deepspeed.py, fill_match)
AUTO = "auto"


def lookup(ds: Mapping[str, Any], dotted: str) -> Any:
    """``ds["a"]["b"]`` for ``"a.b"``; None where a level is missing (as ``find_config_node`` treats it)."""
    node: Any = ds
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


#: where an emitted JSON holds optimizer hyperparameters (dotted): DeepSpeed's optimizer section, and the client
#: optimizer the script builds (autofit.ds.emit.autofit_section; autofit.ds.apply.client_optimizer reads it)
HYPERPARAMETER_SECTIONS = ("optimizer.params", "autofit.client_optimizer.params")


def fill_auto(ds_config: Mapping[str, Any], /, **values: Any) -> dict[str, Any]:
    """A copy of the DeepSpeed JSON whose ``"auto"`` optimizer hyperparameters hold ``values``, the script's own.

    An emitted JSON writes ``"auto"`` for each hyperparameter the user gave autofit none of
    (:meth:`autofit.core.recipe.Recipe.optimizer_params`); the Hugging Face Trainer fills them all, other launchers
    do not: Accelerate fills only ``optimizer.params.lr`` and ``weight_decay``, from its ``DummyOptim``
    (``Accelerator._prepare_deepspeed``, accelerate/accelerator.py), and stops at any other ("`optimizer.params.betas`
    not found in kwargs": ``DeepSpeedPlugin.fill_match``, accelerate/utils/dataclasses.py); Lightning fills none.

    ``values``: ``lr``, ``weight_decay``, ``betas`` (a pair), ``eps``, ``momentum``, checked as a
    :class:`~autofit.core.recipe.Recipe`'s are. Filled: ``optimizer.params`` and the ``"autofit"`` section's
    ``client_optimizer.params``. A number in the JSON is the user's, as given to autofit, and stays; a value for a
    key the JSON lacks is not added (its optimizer may not take it). An ``"auto"`` that ``values`` does not fill
    is an :class:`AutofitError` naming it, never a made-up value. The caller's mapping is left as it was.
    """
    checked: dict[str, Any] = {}
    for key, value in values.items():
        takers = HYPERPARAMETER_OPTIMIZERS.get(key)
        if takers is None:
            raise AutofitError(f"fill_auto: unknown hyperparameter {key}={value!r}; known: "
                               f"{', '.join(HYPERPARAMETER_OPTIMIZERS)}")
        checked |= checked_hyperparameters(takers[0], {key: value})
    ds = copy.deepcopy(dict(ds_config))
    for section in HYPERPARAMETER_SECTIONS:
        params = lookup(ds, section)
        if not isinstance(params, dict):
            continue
        for key, value in params.items():
            if value != AUTO:
                continue
            if key not in checked:
                raise AutofitError(f"the DeepSpeed JSON's {section}.{key} is \"auto\" and nothing fills it: pass the "
                                   f"script's own, fill_auto(ds, {key}=...)")
            filled = checked[key]
            params[key] = list(filled) if isinstance(filled, tuple) else filled  # JSON has no tuple
    return ds


def auto_hyperparameters(ds: Mapping[str, Any]) -> tuple[str, ...]:
    """The hyperparameters a DeepSpeed JSON leaves ``"auto"`` (the user gave autofit none), in its order."""
    names: list[str] = []
    for section in HYPERPARAMETER_SECTIONS:
        params = lookup(ds, section)
        if isinstance(params, Mapping):
            names += [key for key, value in params.items() if value == AUTO and key not in names]
    return tuple(names)


#: how fill_auto spells each hyperparameter's value in a hint (the user's own numbers go there)
FILL_EXAMPLE = {"lr": "lr=...", "weight_decay": "weight_decay=...", "betas": "betas=(..., ...)", "eps": "eps=...",
                "momentum": "momentum=..."}


def fill_hint(path: str, ds: Mapping[str, Any]) -> str | None:
    """One line saying how to fill the ``"auto"`` hyperparameters of the JSON written to ``path``, or None where it
    has none (``autofit run`` says it on stderr where it writes the JSON): plain ``deepspeed.initialize`` hands
    ``"auto"`` to the optimizer (FusedAdam: ``ValueError: too many values to unpack``)."""
    names = auto_hyperparameters(ds)
    if not names:
        return None
    keywords = ", ".join(FILL_EXAMPLE.get(name, f"{name}=...") for name in names)
    flags = ", ".join(f"--{name.replace('_', '-')}" for name in names)
    return (f"autofit: {path} leaves {', '.join(names)} \"auto\" (the HF Trainer fills them); for deepspeed.initialize, "
            f"Accelerate or Lightning fill them first: ds = autofit.ds.apply.fill_auto(json.load(open({str(path)!r})), "
            f"{keywords}), or give autofit {flags}")
__all__ = ["LongContext", "activation_offload_context", "apply_checkpointing", "apply_fp8", "apply_to_model",
           "build_context", "causal_lm_loss", "client_optimizer", "compile_engine", "sequence_parallel_mpu",
           "shard_batch"]
