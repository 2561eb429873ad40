"""The entry-point contract: ``path/to/file.py:function`` or ``package.module:function``.

The function takes no arguments and returns a :class:`Workload`. An entry ``hf:ORG/NAME`` or ``hf:PATH`` is a
Hugging Face model built from its config (:mod:`autofit.workload.hf`). Loading never
lets a user's mistake escape as a traceback: a missing file or function, an
entry that raises, or one that returns the wrong type becomes one
:class:`AutofitError` line.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autofit.core.errors import AutofitError
from autofit.core.sequence import SequenceShape

#: the attention kernels a workload's ``model(attention=...)`` may be asked for
ATTENTION_KERNELS = ("eager", "sdpa", "flash")


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
    sequence: SequenceShape | None = None
    """The sequence length and attention heads of a causal LM (an ``hf:`` entry's), which the long-context keys need
    (:mod:`autofit.core.sequence`); None: they stay off."""
    attention_kernels: tuple[str, ...] | None = None
    """The kernels ``model(attention=...)`` can be built with; None: every kernel (:data:`ATTENTION_KERNELS`); ():
    the model has no attention to choose a kernel for (a state-space model). An ``hf:`` entry reads them from
    transformers' class flags (:func:`autofit.workload.hf_tasks.supported_kernels`), so a kernel the model refuses
    (Gemma-2 and sdpa) is never searched."""
    kernel_note: str | None = None
    """Why :attr:`attention_kernels` is narrower than every kernel, in a sentence the report and the estimate JSON
    repeat; None where nothing was narrowed."""
    at_length: Callable[[int], Workload] | None = None
    """``(seq_len) -> the same workload at another sequence length``, for a model whose trace loops over its tokens (a
    state-space model's reference scan, without its fused kernels): a step at a short length is timed first, and a
    length whose trace would run past the trace's limit is one error line at once
    (:func:`autofit.trace.tracer.check_scan_time`). None: nothing is timed first."""
    flash_stand_in: str = "sdpa"
    """The ``attention`` value ``model(attention=...)`` is built with when the trace stands SDPA's flash backend in for
    ``flash`` (flash-attn not installed where the plan is made: :mod:`autofit.trace.attention`); never trained. An
    ``hf:`` model that takes flash but refuses SDPA names transformers' own SDPA function registered under autofit's
    name (:data:`autofit.workload.hf_tasks.SDPA_STAND_IN`)."""

    def __post_init__(self) -> None:
        if not callable(self.model):
            raise AutofitError(f"Workload.model must be a callable returning an nn.Module, but got {self.model!r}")
        if not callable(self.batch):
            raise AutofitError(f"Workload.batch must be a callable (n) -> batch, but got {self.batch!r}")
        if self.loss is not None and not callable(self.loss):
            raise AutofitError(f"Workload.loss must be callable or None, but got {self.loss!r}")
        if self.layers is not None and not callable(self.layers):
            raise AutofitError(f"Workload.layers must be callable or None, but got {self.layers!r}")
        if self.at_length is not None and not callable(self.at_length):
            raise AutofitError(f"Workload.at_length must be callable or None, but got {self.at_length!r}")
        if self.attention_modules is not None and not callable(self.attention_modules):
            raise AutofitError(f"Workload.attention_modules must be callable or None, but got {self.attention_modules!r}")
        if self.sequence is not None and not isinstance(self.sequence, SequenceShape):
            raise AutofitError(f"Workload.sequence must be a SequenceShape or None, but got {self.sequence!r}")
        if self.attention_kernels is not None and not set(self.attention_kernels) <= set(ATTENTION_KERNELS):
            raise AutofitError(f"Workload.attention_kernels must name kernels of {', '.join(ATTENTION_KERNELS)}, "
                               f"but got {self.attention_kernels!r}")
        if self.tokens_per_sample is not None and (
            not isinstance(self.tokens_per_sample, int) or self.tokens_per_sample < 1
        ):
            raise AutofitError(f"Workload.tokens_per_sample must be a positive int, but got {self.tokens_per_sample!r}")

    @property
    def searches_attention(self) -> bool:
        """True when ``model`` accepts an ``attention`` keyword and can be built with some kernel."""
        try:
            takes = "attention" in inspect.signature(self.model).parameters
        except (TypeError, ValueError):
            return False
        return takes and self.attention_kernels != ()

    @property
    def kernels(self) -> tuple[str, ...] | None:
        """The kernels the search may choose among: :attr:`attention_kernels`, all where None; () where the model
        has no attention (no kernel dimension: its JSON has no ``attention`` key); None where the model takes no
        ``attention`` keyword (the kernel is whatever it builds)."""
        if self.attention_kernels == ():
            return ()
        if not self.searches_attention:
            return None
        return ATTENTION_KERNELS if self.attention_kernels is None else tuple(self.attention_kernels)

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


