"""The entry-point contract: ``path/to/file.py:function`` or ``package.module:function``.

The function takes no arguments and returns a :class:`Workload`. An entry ``hf:ORG/NAME`` or ``hf:PATH`` is a
Hugging Face model built from its config (:mod:`autofit.hf`). Loading never
lets a user's mistake escape as a traceback: a missing file or function, an
entry that raises, or one that returns the wrong type becomes one
:class:`AutofitError` line.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autofit.errors import AutofitError


@dataclass(frozen=True)
class Workload:
    """What to train. Only ``model`` and ``batch`` are required."""

    model: Callable[..., Any]
    """``() -> nn.Module``, fresh, fp32. If it accepts an ``attention`` keyword
    ("eager" | "sdpa" | "flash"), the attention kernel is searched."""
    batch: Callable[[int], Any]
    """``(n) -> a micro-batch of n samples`` (dict / tuple / tensor) of CPU tensors."""
    loss: Callable[[Any, Any], Any] | None = None
    """``(model, batch) -> scalar loss``; default: see :func:`default_loss`."""
    layers: Callable[[Any], Any] | None = None
    """``(model) -> the repeated blocks``; default: the longest ``nn.ModuleList``."""
    tokens_per_sample: int | None = None
    """For tokens/s; None for workloads without tokens."""
    name: str | None = None
    """A display name; default: the entry's function name."""
    attention_modules: Callable[[Any], Any] | None = None
    """``(layer) -> the attention sub-module(s) of one repeated layer``, what ``checkpoint_granularity=attention``
    recomputes; default: :func:`find_attention_modules`."""

    def __post_init__(self) -> None:
        if not callable(self.model):
            raise AutofitError(f"Workload.model must be a callable returning an nn.Module, but got {self.model!r}")
        if not callable(self.batch):
            raise AutofitError(f"Workload.batch must be a callable (n) -> batch, but got {self.batch!r}")
        if self.loss is not None and not callable(self.loss):
            raise AutofitError(f"Workload.loss must be callable or None, but got {self.loss!r}")
        if self.layers is not None and not callable(self.layers):
            raise AutofitError(f"Workload.layers must be callable or None, but got {self.layers!r}")
        if self.attention_modules is not None and not callable(self.attention_modules):
            raise AutofitError(f"Workload.attention_modules must be callable or None, but got {self.attention_modules!r}")
        if self.tokens_per_sample is not None and (
            not isinstance(self.tokens_per_sample, int) or self.tokens_per_sample < 1
        ):
            raise AutofitError(f"Workload.tokens_per_sample must be a positive int, but got {self.tokens_per_sample!r}")

    @property
    def searches_attention(self) -> bool:
        """True when ``model`` accepts an ``attention`` keyword."""
        try:
            return "attention" in inspect.signature(self.model).parameters
        except (TypeError, ValueError):
            return False

    def build_model(self, attention: str | None = None) -> Any:
        """A fresh model; ``attention`` is passed only where the workload accepts it."""
        if attention is not None and self.searches_attention:
            return self.model(attention=attention)
        return self.model()

    def compute_loss(self, model: Any, batch: Any) -> Any:
        return self.loss(model, batch) if self.loss is not None else default_loss(model, batch)

    def repeated_layers(self, model: Any) -> list[Any]:
        """The blocks checkpointing may wrap, in execution order."""
        if self.layers is not None:
            return list(self.layers(model))
        return longest_module_list(model)

    def attention_of(self, layer: Any) -> list[Any]:
        """The attention sub-modules of one repeated layer (the hook's, else :func:`find_attention_modules`)."""
        if self.attention_modules is None:
            return find_attention_modules(layer)
        found = self.attention_modules(layer)
        return [found] if hasattr(found, "forward") else list(found)

    def checkpoints_attention(self) -> bool:
        """Whether every repeated layer has an attention sub-module to checkpoint alone (a build on the
        meta device: no memory); False where there are no repeated layers."""
        import torch

        with torch.device("meta"):
            layers = self.repeated_layers(self.build_model())
        return bool(layers) and all(self.attention_of(layer) for layer in layers)


def default_loss(model: Any, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple, ``model(batch)`` otherwise;
    the output's ``.loss`` (or ``["loss"]``) if present, else the output itself."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    return out if loss is None else loss


def longest_module_list(model: Any) -> list[Any]:
    """The longest ``nn.ModuleList`` in the model (the first one found on a tie); [] if none."""
    from torch import nn

    best: list[Any] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            best = list(module)
    return best


def find_attention_modules(layer: Any) -> list[Any]:
    """The outermost sub-modules of ``layer`` whose class is named like attention (``Attention``/``Attn`` in
    any case: ``LlamaAttention``, ``BertAttention``, ``T5LayerSelfAttention``, ``nn.MultiheadAttention``), in
    order; the layer itself is not one. A decoder block's self- and cross-attention are both found."""
    found: list[tuple[str, Any]] = []
    for name, module in layer.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        kind = type(module).__name__.lower()
        if "attention" in kind or "attn" in kind:
            found.append((name, module))
    return [module for _, module in found]


#: how an entry string names a :class:`Workload` handed over as an object (``autofit.estimate(workload)``)
IN_PROCESS_PREFIX = "<in-process"


def in_process_entry(workload: Workload) -> str:
    """The entry string of a :class:`Workload` object given to the Python API (:mod:`autofit.api`) instead of an entry
    point: it names the workload in plans, tables and reports, and no process but this one can load it (a
    probe, or the CPU's kernel footprint, needs an entry point: :func:`check_loadable`)."""
    return f"{IN_PROCESS_PREFIX} workload {workload.name or 'unnamed'}>"


def is_loadable(entry: str) -> bool:
    """Whether another process can load ``entry`` (every entry point; not an :func:`in_process_entry`)."""
    return not entry.startswith(IN_PROCESS_PREFIX)


def check_loadable(entry: str, needs: str) -> None:
    """An :class:`AutofitError` where ``entry`` is a :class:`Workload` object's (:func:`in_process_entry`): ``needs``
    (``a search``, ``--measure``) runs the model in subprocesses, which load it from an entry point."""
    if not is_loadable(entry):
        raise AutofitError(
            f"{needs} runs the model in subprocesses, which cannot load a Workload object ({entry}): pass the "
            "entry point instead, 'path/to/file.py:function' or 'package.module:function' returning it "
            "(the function must be importable from a file, not defined in a notebook)"
        )


def load_workload(entry: str) -> Workload:
    """Import ``ENTRY`` and call it (an ``hf:`` entry: :func:`autofit.hf.load_hf_entry`). Every failure is one
    AutofitError line naming the entry."""
    if entry.startswith("hf:"):
        from autofit.hf import load_hf_entry

        return load_hf_entry(entry)
    function = _resolve_entry(entry)
    try:
        workload = function()
    except AutofitError:
        raise
    except Exception as exc:  # the user's code: report it, do not crash
        raise AutofitError(f"entry point {entry!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload):
        raise AutofitError(f"entry point {entry!r} must return an autofit.Workload, but returned {type(workload).__name__}")
    if workload.name is None:
        object.__setattr__(workload, "name", getattr(function, "__name__", entry))
    return workload


def _resolve_entry(entry: str) -> Callable[[], Any]:
    target, sep, attr = entry.rpartition(":")
    if not sep or not target or not attr:
        raise AutofitError(f"entry point must be path/to/file.py:function or package.module:function, but got {entry!r}")
    module = _import_target(target, entry)
    function = getattr(module, attr, None)
    if function is None:
        raise AutofitError(f"entry point {entry!r}: {target} has no function {attr!r}")
    if not callable(function):
        raise AutofitError(f"entry point {entry!r}: {attr!r} is not callable")
    return function  # type: ignore[no-any-return]


def _import_target(target: str, entry: str) -> Any:
    try:
        if target.endswith(".py") or "/" in target or "\\" in target:
            path = Path(target).resolve()
            if not path.is_file():
                raise AutofitError(f"entry point {entry!r}: no such file {target}")
            module_name = f"autofit_entry_{path.stem}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise AutofitError(f"entry point {entry!r}: cannot import {target}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            sys.path.insert(0, str(path.parent))
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except AutofitError:
        raise
    except ModuleNotFoundError as exc:
        raise AutofitError(f"entry point {entry!r}: cannot import {target}: {exc}") from exc
    except Exception as exc:
        raise AutofitError(f"entry point {entry!r}: importing {target} raised {type(exc).__name__}: {exc}") from exc
