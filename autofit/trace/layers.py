"""Cut a model to its first few repeated layers, and record live bytes per segment of the step.

What :func:`autofit.trace.trace_workload` uses to trace a many-layer model at the cost of 2 and 3 of
its layers (:mod:`autofit.trace.scaling` extrapolates). Only layers that are alike are cut: one class,
the same parameter and buffer shapes, the same settings (plain attributes of every submodule; an
integer that counts up with the layer, such as Hugging Face's ``layer_idx``, is its position, not a
setting), or layers whose pattern repeats every ``p`` of them (alternating sliding-window and global
attention: :func:`layer_period`), cut to whole periods and extrapolated a period at a time, after a few leading
layers of their own where a model has them (a dense layer before mixtures of experts: :func:`layer_pattern`), kept
in every cut. Layers that differ otherwise (a CNN's stages) are traced whole.

Segments come from PyTorch's own ``ModTracker`` (``torch.distributed._tools.mod_tracker``, the
tracker ``mem_tracker`` is built on): its forward hooks and its multi-grad hooks on each layer's
inputs and outputs mark where a layer's forward and backward begin and end; a checkpointed layer's
recompute runs inside its backward.

Both trackers run with :func:`autofit.trace.hooks.counting_multi_grad_hooks` (why: :mod:`autofit.trace`).

Garbage collection: a checkpointed layer's recompute leaves reference cycles (``torch.utils.checkpoint``'s
non-reentrant recompute; seen on real tensors too, the source not pinned down), whose storages die only
when Python's collector runs. Left to the collector's allocation counts, when they die is arbitrary, so the
live bytes of a checkpointed backward differ from run to run and grow with the layers (examples/gpt.py at
12 layers, sdpa, mb 4: 59 and 61 MiB without gradients in two runs, against 31 MiB when the cycles are
collected as each layer ends). Here the automatic collector is off during the step and a collection runs
at every layer boundary: what is counted is what is still referenced.
"""

from __future__ import annotations

import copy
import functools
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from autofit.trace.hooks import counting_multi_grad_hooks
from autofit.trace.scaling import CannotScale, Segment
from autofit.workload.types import Workload

_PLAIN = (bool, int, float, str, type(None))


def layers_alike(layers: list[Any]) -> bool:
    """True when ``layers`` have one class, the same parameter/buffer shapes and the same settings."""
    return layer_period(layers) == 1


def layer_period(layers: list[Any]) -> int:
    """The fewest consecutive layers whose pattern repeats through the stack: 1 where every layer is alike (one
    class, the same parameter/buffer shapes and settings); ``p`` where layers ``i`` and ``i + p`` are alike for every
    ``i`` and ``p`` divides the count (Gemma-2's sliding-window and global attention in turn: 2); 0 where none does
    (a CNN's stages), or for fewer than two layers."""
    return _period([(type(layer), _shapes(layer)) for layer in layers], [_settings(layer) for layer in layers])


#: leading layers that may differ from the repeating rest (DeepSeek-V3's three dense layers)
MAX_LAYER_PREFIX = 3


def layer_pattern(layers: list[Any]) -> tuple[int, int]:
    """``(prefix, period)``: the fewest leading layers (at most :data:`MAX_LAYER_PREFIX`) after which the stack repeats
    every ``period`` layers (:func:`layer_period` of the rest). ``(0, p)`` where the whole stack repeats; ``(1, 1)``
    for DeepSeek-V2's dense first layer before its alike mixture-of-experts layers (``first_k_dense_replace``);
    ``(0, 0)`` where no prefix leaves a repeating stack."""
    signatures = [(type(layer), _shapes(layer)) for layer in layers]
    settings = [_settings(layer) for layer in layers]
    for prefix in range(min(MAX_LAYER_PREFIX, len(layers) - 2) + 1):
        if period := _period(signatures[prefix:], settings[prefix:]):
            return prefix, period
    return 0, 0


def _period(signatures: list[Any], settings: list[dict[tuple[str, str], Any]]) -> int:
    n = len(signatures)
    for period in range(1, n // 2 + 1):
        if n % period == 0 and all(_alike(signatures[r::period], settings[r::period]) for r in range(period)):
            return period
    return 0


def _alike(signatures: list[Any], settings: list[dict[tuple[str, str], Any]]) -> bool:
    """One class and shapes, and each setting the same in every layer or its position (:func:`_counts_up`)."""
    if len(set(signatures)) != 1:
        return False
    for key in set().union(*settings):
        values = [s.get(key) for s in settings]
        if len(set(values)) > 1 and not _counts_up(values):
            return False
    return True


def _shapes(layer: Any) -> tuple[Any, ...]:
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in layer.named_buffers())
    return params, buffers, tuple((n, type(m).__name__) for n, m in layer.named_modules())


def _settings(layer: Any) -> dict[tuple[str, str], Any]:
    return {
        (name, attr): value
        for name, module in layer.named_modules()
        for attr, value in vars(module).items()
        if not attr.startswith("_") and isinstance(value, _PLAIN)
    }


def _counts_up(values: list[Any]) -> bool:
    """An integer that grows by one step from layer to layer (one, or the period between the layers compared): the
    layer's position."""
    if len(values) < 2 or not all(type(v) is int for v in values) or values[1] <= values[0]:
        return False
    return all(b - a == values[1] - values[0] for a, b in zip(values, values[1:], strict=False))


def cut_model(model: Any, workload: Workload, n_layers: int) -> Any:
    """``model`` with only the first ``n_layers`` of its repeated layers, in place.

    The layers must sit in one ``nn.ModuleList`` or ``nn.Sequential`` that holds nothing else, and the
    cut model's repeated layers (by the workload's rule) must be exactly those kept; else
    :class:`CannotScale`.
    """
    from torch import nn

    layers = workload.repeated_layers(model)
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) not in (nn.ModuleList, nn.Sequential) or len(child) != len(layers):
                continue
            if all(a is b for a, b in zip(child, layers, strict=True)):
                kept = layers[:n_layers]
                setattr(parent, name, nn.ModuleList(kept) if type(child) is nn.ModuleList else nn.Sequential(*kept))
                if [id(m) for m in workload.repeated_layers(model)] != [id(m) for m in kept]:
                    raise CannotScale("the cut model's repeated layers are not the ones kept")
                return model
    raise CannotScale("the repeated layers are not one ModuleList or Sequential of the model")


def cut_workload(workload: Workload, n_layers: int) -> Workload:
    """The workload whose model is cut to its first ``n_layers`` repeated layers (same signature)."""
    original = workload.model
    built: dict[Any, Any] = {}

    @functools.wraps(original)  # keeps the ``attention`` keyword visible (inspect follows __wrapped__)
    def build(*args: Any, **kwargs: Any) -> Any:
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # built whole on the meta device (no dispatch through the fake mode: LLaMA-2-70B's 80 layers take
        # 0.1 s there against 2.8 s as fake tensors), cut, then given empty tensors of the caller's mode; built
        # once for each arguments and copied after (a trace runs a dozen steps of each cut: the 80-layer build
        # took 0.05-0.15 s each time here, a copy of the cut model 3-13 ms)
        with unset_fake_temporarily(), torch.device("meta"):
            key = _arguments_key(args, kwargs)
            if key is None:
                return _emptied(cut_model(original(*args, **kwargs), workload, n_layers))
            if key not in built:
                built[key] = cut_model(original(*args, **kwargs), workload, n_layers)
            model = _copied(built[key])
            if model is None:  # a module deepcopy cannot copy: built each time
                model = cut_model(original(*args, **kwargs), workload, n_layers)
        return _emptied(model)

    return replace(workload, model=build)


def _arguments_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A hashable key of a build's arguments (``attention="sdpa"``), or None where one is not hashable."""
    key = (args, tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _copied(model: Any) -> Any:
    """A deep copy of a meta-device model (tied weights still tied), or None where the copy fails."""

    try:
        return copy.deepcopy(model)
    except Exception:  # a module holding something deepcopy refuses (a lock, a generator)
        return None


def _emptied(model: Any) -> Any:
    """``model`` with every meta parameter and buffer replaced by an empty CPU tensor (fake under a fake
    mode), shared ones (tied weights) still shared."""
    import torch

    made: dict[int, Any] = {}

    def empty(tensor: Any, parameter: bool) -> Any:
        if id(tensor) not in made:
            new = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            made[id(tensor)] = torch.nn.Parameter(new, tensor.requires_grad) if parameter else new
        return made[id(tensor)]

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = empty(param, True)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = empty(buffer, False)
    return model


class SegmentMarks:
    """Which segment of the step runs now (:data:`autofit.trace.scaling.LAYER_PHASES`), from ModTracker's hooks."""

    def __init__(self, layers: list[Any], on_change: Any) -> None:
        self.index = {id(layer): i for i, layer in enumerate(layers)}
        self.on_change = on_change
        self.backward = False
        self.running: set[int] = set()
        self.done: int | None = None

    def segment(self) -> Segment:
        if self.running:
            return ("b" if self.backward else "f", min(self.running))
        if self.done is None:
            return ("bhead" if self.backward else "fpre", 0)
        return ("ba" if self.backward else "fa", self.done)

    def start_backward(self) -> None:
        self.backward, self.running, self.done = True, set(), None
        self.on_change()

    def _mark(self, module: Any, starting: bool, backward_hook: bool, recomputing: bool = False) -> None:
        i = self.index.get(id(module))
        if i is None or recomputing or backward_hook != self.backward:
            return  # another module, or a checkpointed layer's recompute inside backward
        if starting:
            self.running.add(i)
        else:
            self.running.discard(i)
            self.done = i
        gc.collect()  # a checkpointed layer's recompute leaves reference cycles: free them as each layer ends
        self.on_change()

    @contextmanager
    def tracking(self) -> Iterator[None]:
        from torch.distributed._tools import mod_tracker

        tracker = mod_tracker.ModTracker()
        tracker.register_user_hooks(
            pre_fw_hook=lambda m, _inputs: self._mark(m, True, False, tracker.is_bw),
            post_fw_hook=lambda m, _inputs, _outputs: self._mark(m, False, False, tracker.is_bw),
            pre_bw_hook=lambda m, _grads: self._mark(m, True, True),
            post_bw_hook=lambda m, _grads: self._mark(m, False, True),
        )
        gc.freeze()  # what exists before the step (the model, the libraries) is not scanned by each collect
        enabled = gc.isenabled()
        gc.disable()  # collections where the layers end, not at whatever allocation count
        try:
            with counting_multi_grad_hooks(mod_tracker), tracker:
                yield
        finally:
            if enabled:
                gc.enable()
            gc.unfreeze()
