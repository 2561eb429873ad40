"""Tensor helpers of a trace step: the FLOP formulas of SDPA's kernels (``torch.utils.flop_counter`` leaves the
CPU's uncounted, and before torch 2.13 fails on grouped keys), and the casts of a fake model and its batch to
the traced precision."""

from __future__ import annotations

import functools
from typing import Any

from autofit.trace.hooks import counting_multi_grad_hooks


def sdpa_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas for SDPA's kernels: torch's own (``torch.utils.flop_counter``), given grouped keys and values.

    * The CPU's kernels (``_scaled_dot_product_flash_attention_for_cpu`` and its backward), which a trace runs
      (on the CPU) and torch leaves uncounted: without them an sdpa or flash candidate's attention matmuls count
      0. Their formulas are torch's for its CUDA flash kernel (same arguments first).
    * Every kernel's key and value shapes with the query's heads: a grouped- or multi-query model calls SDPA with
      ``enable_gqa`` and fewer key/value heads, which the kernel broadcasts. torch's formula counts that from
      2.13 on; before it (2.11, seen on an H100 image) it fails the trace with "sdpa_flop_count: query/key/value
      shapes are incompatible". Broadcast, the count is the same as 2.13's.
    """
    import torch
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    kernels = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention")
    pairs = [(name + suffix, name + suffix) for name in kernels for suffix in ("", "_backward")]
    pairs += [("_scaled_dot_product_flash_attention_for_cpu" + suffix, "_scaled_dot_product_flash_attention" + suffix)
              for suffix in ("", "_backward")]
    formulas = {}
    for op_name, formula_of in pairs:
        op, counted_as = getattr(aten, op_name, None), getattr(aten, formula_of, None)
        if op is not None and counted_as in flop_registry:  # FlopCounterMode wraps the raw formula again
            raw = flop_registry[counted_as].__wrapped__
            formulas[op] = _with_query_heads(raw, query_at=1 if op_name.endswith("_backward") else 0)
    return formulas


def _with_query_heads(formula: Any, query_at: int) -> Any:
    """``formula`` (shapes in, FLOPs out) called with the key and value shapes (right after the query's, at
    ``query_at``) given the query's head count, as the kernel broadcasts them."""

    def counted(*shapes: Any, **kwargs: Any) -> Any:
        shapes_list = list(shapes)
        query = shapes_list[query_at]
        for at in (query_at + 1, query_at + 2):
            shape = shapes_list[at]
            if len(query) == 4 and len(shape) == 4 and shape[1] != query[1]:
                shapes_list[at] = (shape[0], query[1], *shape[2:])
        return formula(*shapes_list, **kwargs)

    return counted


def flop_counter() -> InlineFlops:
    """``torch.utils.flop_counter.FlopCounterMode`` (with :func:`sdpa_flop_formulas`) whose module tracker
    registers no gradient hooks while a checkpointed layer recomputes its forward inside backward, counting the ops
    of the step's own dispatch mode (:class:`InlineFlops`).

    torch's ``ModuleTracker`` registers a multi-grad hook on the inputs and outputs of every module call and
    keeps each handle until the mode exits; a hook holds its tensors' ``grad_fn`` nodes, and those hold the
    tensors they saved. The recompute's graph is never backpropagated, so with the stock tracker every
    recomputed activation stayed alive to the end of the step: a T5 encoder-decoder, every block checkpointed,
    bf16, micro-batch 16, counted 243 MiB live at its peak, 64 MiB without the FLOP counter (the probe's
    measured peak, 186.5 MiB, agrees with the latter within the runtime's share). The recompute's FLOPs are
    still counted, and still attributed to the modules that run them. Its multi-grad hooks keep no gradient
    (:mod:`autofit.trace.hooks`).
    """
    from torch.utils import module_tracker
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils.module_tracker import ModuleTracker

    class RecomputeSafeTracker(ModuleTracker):
        def _fw_pre_hook(self, mod: Any, input: Any) -> None:
            if not self.is_bw:
                super()._fw_pre_hook(mod, input)
                return
            self._get_append_fn(self._get_mod_name(mod), False)()

        def _fw_post_hook(self, mod: Any, input: Any, output: Any) -> None:
            if not self.is_bw:
                super()._fw_post_hook(mod, input, output)
                return
            self._get_pop_fn(self._get_mod_name(mod), False)()

        def __enter__(self) -> Any:
            self._holds_no_grads = counting_multi_grad_hooks(module_tracker)
            self._holds_no_grads.start()
            return super().__enter__()

        def __exit__(self, *args: Any) -> None:
            try:
                super().__exit__(*args)
            finally:
                self._holds_no_grads.stop()

    counter = FlopCounterMode(display=False, custom_mapping=sdpa_flop_formulas())
    counter.mod_tracker = RecomputeSafeTracker()
    return InlineFlops(counter)


class InlineFlops:
    """A ``FlopCounterMode`` (:func:`flop_counter`) that counts the ops another dispatch mode runs (:meth:`run`)
    instead of being a dispatch mode of its own: the same counts, by module, without a second layer of Python
    dispatch around every op of a traced step.

    What the counter's mode does for each op, done here: an op with a FLOP formula is run and counted; one without
    that decomposes (a ``CompositeImplicitAutograd`` kernel, ``aten.silu_backward`` for one) is run under the
    counter's own mode, which decomposes it and counts what it decomposes into; any other runs as it is.
    """

    def __init__(self, counter: Any) -> None:
        self.counter = counter

    def __enter__(self) -> InlineFlops:
        self.counter.flop_counts.clear()
        self.counter.mod_tracker.__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        self.counter.mod_tracker.__exit__(*args)

    def run(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``func(*args, **kwargs)``, its FLOPs counted."""
        packet = func._overloadpacket
        if packet in self.counter.flop_registry:
            out = func(*args, **kwargs)
            return self.counter._count_flops(packet, out, args, kwargs)
        if _decomposes(func):
            from torch.utils.flop_counter import _FlopCounterMode

            with _FlopCounterMode(self.counter):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def get_flop_counts(self) -> dict[str, dict[Any, int]]:
        return self.counter.get_flop_counts()  # type: ignore[no-any-return]

    def get_total_flops(self) -> int:
        return int(self.counter.get_total_flops())


@functools.cache
def _decomposes(func: Any) -> bool:
    """Whether the counter's mode would decompose ``func``: it has a ``CompositeImplicitAutograd`` kernel (what
    ``OpOverload.decompose`` runs) and returns tensors (the mode passes metadata queries on, ``prim::device`` among
    them, which has no such kernel to look up)."""
    import torch

    if not makes_tensors(func):
        return False
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    try:
        return key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)
    except RuntimeError:  # an operator the dispatcher does not know by name
        return False


def makes_tensors(func: Any) -> bool:
    """Whether ``func``'s schema returns tensors: a step too slow is stopped only before such an op. A metadata query
    (``prim::device``, ``aten::sym_size``) can come from C++ that cannot unwind a Python exception (autograd's
    ``InputMetadata`` asks the output's device inside ``set_history``): raised there, the process aborts
    (``terminate called after throwing an instance of 'python_error'``)."""
    return any("Tensor" in str(ret.type) for ret in func._schema.returns)


def kernel_workspace_bytes(func: Any, args: Any, out: Any) -> int:
    """Bytes a kernel holds while it runs beyond its inputs and outputs: scratch no tensor shows.

    Convolutions: oneDNN, PyTorch's CPU convolution, reorders its operands into a blocked layout and
    back, a copy of each. Measured on torch 2.13 CPU, fp32 3x3 convolutions of 3 to 256 channels at
    batch 4 and 32, the resident-memory peak of forward and of backward less the tensors' bytes:
    forward holds a copy of its output and its weight; backward (``convolution_backward``) a copy of its
    input and the incoming gradient, or of the weight where that is larger. cuDNN's workspace on a GPU
    depends on the algorithm it picks and is not measured here; the same bytes are assumed.
    """
    forward, backward = _convolution_ops()
    if func is forward:
        return _nbytes(out) + _nbytes(args[1])
    if func is backward:
        grad_output, conv_input, weight = args[0], args[1], args[2]
        return max(_nbytes(grad_output) + _nbytes(conv_input), _nbytes(weight))
    return 0


@functools.cache
def _convolution_ops() -> tuple[Any, Any]:
    """aten's convolution and its backward, looked up once (the trace asks for every op it runs)."""
    import torch

    return torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def to_dtype(model: Any, dtype: Any) -> Any:
    """``model.to(dtype)`` for floating parameters and buffers, done by assignment
    (``Module.to`` swaps tensors in place, which fake tensors do not allow). A parameter shared by
    several modules (a head tied to the embedding) stays one parameter: one gradient, as ``Module.to`` keeps it."""
    import torch

    cast: dict[int, Any] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                if id(param) not in cast:
                    cast[id(param)] = torch.nn.Parameter(param.detach().to(dtype), param.requires_grad)
                module._parameters[name] = cast[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                module._buffers[name] = buffer.to(dtype)
    return model


def batch_tensors(batch: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]


def cast_batch(batch: Any, dtype: Any) -> Any:
    """Floating-point inputs follow the model's precision, as DeepSpeed's bf16/fp16 training expects."""
    import torch
    from torch.utils._pytree import tree_map

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    return tree_map(cast, batch)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""
