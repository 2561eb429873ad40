"""Memory traffic of a traced step: the bytes its kernels that do no matmul read and write, run eagerly and as a
compiler fuses them.

A roofline's memory side (Williams et al. 2009): such a kernel's time is its bytes over the device's achieved
memory bandwidth (:mod:`autofit.cost_model.time`). Eager PyTorch runs each op as its own kernel, so every op's
inputs and outputs cross memory. ``torch.compile`` (inductor) fuses the chains of such ops between two matmuls
into one kernel (its pointwise and reduction ops, their prologues and epilogues: PyTorch's ``torch.compile``
documentation, "TorchInductor"): a tensor one of them writes and only ops of the same chain read stays in
registers. AOTAutograd compiles forward and backward as two graphs, so what forward writes for backward is
written and read back, as is anything a matmul or attention kernel reads. :class:`Traffic` counts both: eager
bytes, and fused bytes as that rule leaves them (a lower bound: inductor may split a chain it cannot fuse).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from autofit.trace.tensors import sdpa_flop_formulas


def memory_bound_bytes(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """Bytes an op that does no matmul reads and writes: its tensor inputs and outputs (elementwise ops, norms,
    softmax, reductions, copies, casts); 0 for an op that only views its input, allocates without writing, or
    is a matmul or attention kernel (FLOP-bound: :func:`autofit.trace.tensors.flop_counter` counts those). A
    gather reads only what it writes (an embedding lookup reads its rows, not the table)."""
    if _moves_nothing(func):
        return 0
    return _moved(func, _tensors(args, kwargs), _tensors(out))


def _moved(func: Any, inputs: list[Any], outputs: list[Any]) -> int:
    """:func:`memory_bound_bytes` of an op that is neither a view, an allocation nor a matmul."""
    written = sum(_nbytes(t) for t in outputs)
    if not written:  # a query of a tensor's metadata (``prim.device``), or an op with nothing to write
        return 0
    if _is_gather(func):
        return 2 * written + sum(_nbytes(t) for t in inputs if not t.is_floating_point())
    return written + sum(_nbytes(t) for t in inputs)


@dataclass
class Traffic:
    """The bytes of the step's memory-bound kernels so far: ``eager``, and ``fused`` (module docstring).

    Call :meth:`record` for every op the step runs, :meth:`forget` when a storage is freed,
    :meth:`start_backward` when backward begins and :meth:`keep` for what outlives the step (gradients)."""

    eager: int = 0
    """Every memory-bound op's inputs and outputs."""
    ops: int = 0
    """Every op dispatched, views and allocations too (:mod:`autofit.cost_model.dispatch`)."""
    kernels: int = 0
    """The ops among them that run a kernel on a GPU: matmuls and every op that reads or writes memory (not a view
    or an allocation)."""
    reads: int = 0
    """What fused chains read from memory: their inputs written outside them."""
    writes: int = 0
    """What fused chains write to memory: outputs something outside them reads."""
    backward: bool = False
    """Whether the step is in its backward pass (where a checkpointed layer's recompute also runs)."""
    pending: dict[int, tuple[int, bool]] = field(default_factory=dict)
    """Storages a memory-bound op wrote that nothing outside its chain has read yet: ``(bytes, backward)``."""

    @property
    def fused(self) -> int:
        return self.reads + self.writes

    def record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """One op of the step, with its outputs."""
        outputs = _tensors(out)
        if not outputs:  # a query of a fake tensor's metadata (``prim.device``), which a real run does not dispatch
            return
        self.ops += 1
        matmul = _is_matmul(func)
        if not matmul and _moves_nothing(func):
            return  # a view or an allocation: no kernel reads anything
        inputs = _tensors(args, kwargs)
        moved = 0 if matmul else _moved(func, inputs, outputs)
        self.eager += moved
        if not moved and not matmul:
            return
        self.kernels += 1
        gather = moved and _is_gather(func)
        for tensor in inputs:
            key = storage_key(tensor)
            produced = self.pending.get(key)
            inside_chain = moved and produced is not None and produced[1] == self.backward
            if produced is not None and not inside_chain:
                self.keep(key)
            if moved and not inside_chain and not gather:
                self.reads += _nbytes(tensor)
        if gather:  # the rows it reads and its indices: all it moves but its output
            self.reads += moved - sum(_nbytes(t) for t in outputs)
        if moved:
            for tensor in outputs:
                self.pending[storage_key(tensor)] = (_nbytes(tensor), self.backward)

    def totals(self) -> dict[str, int]:
        """What a :class:`~autofit.cost_model.facts.PeakPoint` keeps of the step's traffic."""
        return {"memory_bound_bytes": self.eager, "fused_memory_bound_bytes": self.fused, "dispatched_ops": self.ops,
                "kernels": self.kernels}

    def keep(self, key: int) -> None:
        """The storage ``key`` is read outside its chain (or outlives the step): its write reaches memory."""
        produced = self.pending.pop(key, None)
        if produced is not None:
            self.writes += produced[0]

    def forget(self, key: int) -> None:
        """The storage ``key`` was freed without leaving its chain (its key may be reused)."""
        self.pending.pop(key, None)

    def start_backward(self) -> None:
        self.backward = True


def storage_key(tensor: Any) -> int:
    """What :class:`Traffic` knows a tensor's storage by (its views share it)."""
    return int(tensor.untyped_storage()._cdata)


def _tensors(*trees: Any) -> list[Any]:
    """The tensors among an op's arguments, or its outputs (any nesting of tuples, lists and dicts)."""
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(trees) if _is_tensor(t)]


@functools.cache
def _moves_nothing(func: Any) -> bool:
    """Views, uninitialised allocations, matmuls and attention kernels (looked up once per op)."""
    name = func.overloadpacket.__name__
    return func.is_view or name == "_unsafe_view" or "empty" in name or _is_matmul(func)


@functools.cache
def _is_matmul(func: Any) -> bool:
    """A matmul, convolution or attention kernel: FLOP-bound, and what a fused chain of the others ends at."""
    from torch.utils.flop_counter import flop_registry


    packet = func.overloadpacket
    return packet in flop_registry or packet in sdpa_flop_formulas()


@functools.cache
def _is_gather(func: Any) -> bool:
    import torch

    aten = torch.ops.aten
    return func.overloadpacket in (aten.embedding, aten.index_select, aten.gather, aten.nll_loss_forward,
                                   aten.nll_loss2d_forward, aten.index)


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())
