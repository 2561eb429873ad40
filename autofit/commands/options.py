"""The shared options of the Python API, in sections, written once.

Every command that plans a model takes the same request (docs/design.md, "The shared request"): the fields of
:class:`autofit.planning.target.Target`, as the command line parsed them. The Python API takes the same options as
keywords, ``autofit.estimate(model, hardware="cpu", memory="2GiB", global_batch=16)``, in the types a notebook holds
(a dict for ``set``, numbers for the hyperparameters, paths). Here they are, in four sections (as torchtitan's
``JobConfig`` holds its ``Job``, ``Model``, ``Training`` ...):

- :class:`DeviceOptions`: where the model runs (the device, its memory, how many, the NVMe drive);
- :class:`SearchOptions`: what is searched (the global batch, the space, the values fixed);
- :class:`ModelOptions`: an ``hf:`` model's own options;
- :class:`RecipeOptions`: the user's recipe (optimizer, precision, substitutes, hyperparameters).

:class:`Options` bundles them (one typed value handed on instead of 23 arguments, as optuna hands its TPE sampler's
``_ParzenEstimatorParameters``); :meth:`Options.target` makes the :class:`Target` of a model and
:meth:`Options.from_target` the sections of a :class:`Target`. :func:`takes_options` writes an API function over one
:class:`Options` and gives its callers every field as a keyword-only argument with its default.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from autofit.core.errors import AutofitError
from autofit.cost_model.budget import DEFAULT_MARGIN
from autofit.planning.target import Target
from autofit.workload.entry import in_process_entry
from autofit.workload.types import Workload

#: a hyperparameter as the API takes it: a number, ``B1,B2`` / a pair for betas, or the CLI's string
Hyperparameter = float | str | tuple[float, float] | None
#: a path as the API takes it
PathOrName = str | os.PathLike[str]

R = TypeVar("R")


@dataclass(frozen=True)
class DeviceOptions:
    """Where the model runs: the device, its memory budget and the share of it left free, how many of them, their
    software (the CLI's ``--hardware``, ``--memory``, ``--margin``, ``--gpus``, ``--nodes``, ``--hosts``,
    ``--nvme-path``, ``--software``)."""

    hardware: str = "auto"
    """A preset (``"h100-80gb"``, ``"a100-40gb"``, ...), ``"cpu"`` or ``"auto"`` (detect)."""
    memory: str | int | None = None
    """The device memory budget, ``"2GiB"``, ``"800MiB"`` or bytes; None: the device's own."""
    margin: float = DEFAULT_MARGIN
    """The share of the device memory every config must leave free: it fits when predicted within ``(1 - margin) x``
    the memory (:mod:`autofit.cost_model.budget`); the search's winner must also be measured within it."""
    gpus: int | None = None
    """Devices per node; None: the visible GPUs with ``hardware="auto"`` on a CUDA machine, else 1."""
    nodes: int = 1
    """Nodes; the world size is ``gpus x nodes``."""
    hosts: str | None = None
    """Where probes of several nodes run, ``"a,b"`` or a hostfile (None: the Slurm allocation, else simulated nodes
    here)."""
    nvme_path: PathOrName | None = None
    """A directory on an NVMe drive where NVMe offload swaps (else NVMe offload is pruned)."""
    software: PathOrName | None = None
    """The training machines' software, which the rules judge: ``"here"``, ``"cluster"`` or a JSON file
    (``--software``; docs/design.md, "The target's software"); None: here for ``cpu``/``auto`` and probes here, else
    cluster."""

    def __post_init__(self) -> None:
        if not isinstance(self.hardware, str):
            raise AutofitError(f"hardware must be a preset name, 'cpu' or 'auto', but got hardware={self.hardware!r}")

    def target_fields(self) -> dict[str, Any]:
        """The :class:`Target` fields of this section."""
        return {"hardware": self.hardware, "memory": self.memory, "margin": self.margin, "gpus": self.gpus, "nodes": self.nodes,
                "hosts": self.hosts, "nvme_path": _path(self.nvme_path), "software": _path(self.software)}


@dataclass(frozen=True)
class SearchOptions:
    """What is searched: the global batch, the space and the values fixed (``--global-batch``, ``--space``,
    ``--set``)."""

    global_batch: int | None = None
    """Samples per optimizer step over every device; None: the space's own."""
    space: PathOrName | None = None
    """A space name in ``search_spaces/`` or a YAML file; None: the default space."""
    set: Mapping[str, Any] | Sequence[str] | None = None
    """Config keys to fix, ``{"zero_stage": 2}`` or ``["zero_stage=2"]`` (the CLI's ``--set``)."""

    def target_fields(self) -> dict[str, Any]:
        """The :class:`Target` fields of this section."""
        return {"global_batch": self.global_batch, "space": _path(self.space), "set_values": set_pairs(self.set)}


@dataclass(frozen=True)
class ModelOptions:
    """An ``hf:`` model's options (``--seq-len``, ``--task``, ``--trust-remote-code``; :mod:`autofit.workload.hf`)."""

    seq_len: int | None = None
    """An ``hf:`` model's tokens per sample."""
    task: str | None = None
    """An ``hf:`` model's task (default: its config's architectures)."""
    trust_remote_code: bool = False
    """Let an ``hf:`` model run its repository's code."""

    def target_fields(self) -> dict[str, Any]:
        """The :class:`Target` fields of this section."""
        return {"seq_len": self.seq_len, "task": self.task, "trust_remote_code": self.trust_remote_code}


@dataclass(frozen=True)
class RecipeOptions:
    """The user's training recipe (docs/recipe.md; ``--recipe-from``, ``--optimizer``, ``--precision``, ``--allow``
    and the hyperparameters)."""

    recipe_from: PathOrName | None = None
    """A DeepSpeed JSON or a Trainer's ``TrainingArguments`` JSON stating the recipe
    (:func:`autofit.ds.recipe_from.read_recipe`); options that disagree with it are an error."""
    optimizer: str | None = None
    """The optimizer you train with (default AdamW); never traded away."""
    precision: str | None = None
    """The precision you train in (default: the device's mixed precision; fp32 on a CPU)."""
    allow: str | Sequence[str] = ()
    """Substitutes the search may try (``"adamw8bit"``, ``"fp8"``, ``"near"``, ...)."""
    lr: Hyperparameter = None
    """The learning rate the JSON carries (None: ``"auto"``)."""
    weight_decay: Hyperparameter = None
    """The weight decay (None: ``"auto"``)."""
    betas: Hyperparameter = None
    """Adam's or Lion's betas, a pair or ``"B1,B2"`` (None: ``"auto"``)."""
    eps: Hyperparameter = None
    """Adam's epsilon (None: ``"auto"``)."""
    momentum: Hyperparameter = None
    """SGD's momentum (None: torch's default)."""

    def target_fields(self) -> dict[str, Any]:
        """The :class:`Target` fields of this section."""
        return {"recipe_from": _path(self.recipe_from), "optimizer": self.optimizer, "precision": self.precision,
                "allow": names(self.allow, "allow"),
                **{name: hyperparameter(getattr(self, name), name)
                   for name in ("lr", "weight_decay", "betas", "eps", "momentum")}}


#: each section by its field of :class:`Options`, in the order their keywords appear
SECTIONS: dict[str, type[DeviceOptions | SearchOptions | ModelOptions | RecipeOptions]] = {
    "device": DeviceOptions, "search": SearchOptions, "model": ModelOptions, "recipe": RecipeOptions}
#: a section field whose :class:`Target` field is named otherwise
TARGET_NAMES = {"set": "set_values"}


@dataclass(frozen=True)
class Options:
    """The shared options of one API call, by section: what becomes the :class:`Target`."""

    device: DeviceOptions = field(default_factory=DeviceOptions)
    """Where the model runs."""
    search: SearchOptions = field(default_factory=SearchOptions)
    """What is searched."""
    model: ModelOptions = field(default_factory=ModelOptions)
    """An ``hf:`` model's options."""
    recipe: RecipeOptions = field(default_factory=RecipeOptions)
    """The user's recipe."""

    @classmethod
    def from_keywords(cls, **keywords: Any) -> Options:
        """The sections of flat keywords (``hardware="cpu", lr=3e-4``); a name no section has is an error."""
        sections: dict[str, Any] = {}
        for name, section in SECTIONS.items():
            mine = {f.name for f in dataclasses.fields(section)}
            sections[name] = section(**{key: keywords.pop(key) for key in mine & set(keywords)})
        if keywords:
            raise AutofitError(f"unknown options: {', '.join(sorted(keywords))}")
        return cls(**sections)

    @classmethod
    def from_target(cls, target: Target) -> Options:
        """The sections of ``target``'s fields (its entry is not an option: :meth:`target` takes it back)."""
        sections: dict[str, Any] = {
            name: section(**{f.name: getattr(target, TARGET_NAMES.get(f.name, f.name)) for f in dataclasses.fields(section)})
            for name, section in SECTIONS.items()}
        return cls(**sections)

    def target(self, entry: str | None) -> Target:
        """The :class:`Target` of ``entry`` with these options: each value as the command line spells it."""
        fields: dict[str, Any] = {}
        for name in SECTIONS:
            fields |= getattr(self, name).target_fields()
        return Target(entry=entry, **fields)


def takes_options(*, without: tuple[str, ...] = ()) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Give an API function, written over ``options: Options``, every section field as a keyword-only argument with
    its default (but those ``without``), after its own: its callers write ``f(model, hardware="cpu", lr=3e-4)``, and
    ``inspect.signature`` and ``help()`` show each keyword with its type and default. An unknown keyword is Python's
    own ``TypeError``."""

    def decorate(function: Callable[..., R]) -> Callable[..., R]:
        own = [p for p in inspect.signature(function).parameters.values() if p.name != "options"]
        shared = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                  for section in SECTIONS.values() for f in dataclasses.fields(section) if f.name not in without]
        public = inspect.signature(function).replace(parameters=[*own, *shared])
        shared_names = {p.name for p in shared}

        @functools.wraps(function)
        def with_keywords(*args: Any, **kwargs: Any) -> R:
            given = public.bind(*args, **kwargs).arguments
            options = Options.from_keywords(**{k: v for k, v in given.items() if k in shared_names})
            return function(**{k: v for k, v in given.items() if k not in shared_names}, options=options)

        with_keywords.__signature__ = public  # type: ignore[attr-defined]
        del with_keywords.__wrapped__  # the signature is the public one: docs tools that unwrap must not see `options`
        return with_keywords

    return decorate


def quiet(line: str) -> None:
    """The API's default ``say``: progress lines go nowhere."""


# -- the values as the command line spells them ------------------------------------------------------------------


def model_entry(model: str | Workload) -> tuple[str, Workload | None]:
    """``model`` as an entry string, with the :class:`Workload` object where it is one (named by
    :func:`autofit.workload.entry.in_process_entry`)."""
    if isinstance(model, Workload):
        return in_process_entry(model), model
    if isinstance(model, str) and model.strip():
        return model.strip(), None
    raise AutofitError("model must be an autofit.Workload, an entry point 'path/to/file.py:function' or "
                       f"'package.module:function', or an 'hf:' config, but got model={model!r}")


def _path(value: PathOrName | None) -> str | None:
    """A path option as a string (None stays None)."""
    return os.fspath(value) if value is not None else None


def set_pairs(values: Mapping[str, Any] | Sequence[str] | None) -> tuple[str, ...]:
    """``set`` as ``--set`` gives it: ``{"zero_stage": 2}`` -> ``("zero_stage=2",)``; ``"k=v"`` strings pass
    as they are (one string alone too); the values are parsed and checked by :func:`autofit.core.config.parse_set`."""
    if values is None:
        return ()
    if isinstance(values, str):
        return (values,)
    if isinstance(values, Mapping):
        return tuple(f"{key}={_set_value(value)}" for key, value in values.items())
    if isinstance(values, Sequence) and all(isinstance(v, str) for v in values):
        return tuple(values)
    raise AutofitError(f"set must be a dict of config keys to values or 'key=value' strings, but got set={values!r}")


def _set_value(value: Any) -> str:
    """A ``set`` value as the command line spells it (a bool is not a config value: refused by the parse)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def names(values: str | Sequence[str], field: str) -> tuple[str, ...]:
    """A name or names (``allow="fp8"``, ``allow=["fp8", "adamw8bit"]``) as a tuple of strings."""
    if isinstance(values, str):
        return (values,)
    if isinstance(values, Sequence) and all(isinstance(v, str) for v in values):
        return tuple(values)
    raise AutofitError(f"{field} must be a name or a list of names, but got {field}={values!r}")


def hyperparameter(value: Hyperparameter, field: str) -> str | None:
    """A recipe hyperparameter as the command line spells it: ``3e-4`` -> ``"0.0003"``, ``(0.9, 0.95)`` ->
    ``"0.9,0.95"``; parsed and checked by :func:`autofit.core.recipe.parse_hyperparameters` in
    :func:`autofit.planning.target.prepare`."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise AutofitError(f"{field} must be a number, but got {field}={value!r}")
    if isinstance(value, (int, float)):
        return repr(float(value))
    if isinstance(value, tuple) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return ",".join(repr(float(v)) for v in value)
    raise AutofitError(f"{field} must be a number, a pair of numbers or a string, but got {field}={value!r}")
