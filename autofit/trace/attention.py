"""How the trace runs each attention kernel, and the label that says how ``flash`` was traced.

``flash`` is traced through flash-attn's own functions where flash-attn is installed (the workload's
model calls them; flash-attn registers fake implementations of its ops, so they run on fake tensors)
-- its memory is flash-attn's, which differs from SDPA's. Where it is not installed, or its functions
cannot run in the trace, ``flash`` is traced as SDPA forced to its flash backend
(``torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)``: saves the output and the log-sum-exp,
never the S x S scores), with the model built as :attr:`autofit.workload.types.Workload.flash_stand_in` names
(``sdpa`` unless the model says otherwise). :data:`FLASH_ATTN` / :data:`SDPA_FLASH` label which one a prediction
rests on.

The stand-in takes what flash-attn takes: key/value heads fewer than the query's (multi-query or grouped-query
attention: Falcon-7B's one key head for 71 query heads) reach flash-attn unexpanded (``flash_attn_func`` takes
``nheads_k`` dividing ``nheads``), so a call that broadcasts them is run with ``enable_gqa`` (SDPA's flash backend
refuses broadcast heads without it: ``check_batch_size_and_num_heads_dense`` in ``sdp_utils_cpp.h``); values of a
narrower head than the query's (DeepSeek-V2's multi-head latent attention: 192-wide queries and keys, 128-wide values)
are padded to the query's width and the output cut back, as transformers does before it calls flash-attn, which
takes one head width (``modeling_deepseek_v2.py``).

Where the stand-in changes no call and the CPU's own choice for each is already its flash kernel
(:func:`flash_alike_calls`), ``flash`` runs the very steps ``sdpa`` does and the trace takes ``sdpa``'s profiles for it
(:func:`autofit.trace.tracer.trace_workload`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Iterator
from typing import Any

from autofit.trace.sdpa import SDPA_ARGUMENTS, broadcasts_heads

FLASH_ATTN = "flash-attn"
SDPA_FLASH = "sdpa flash backend"


def flash_trace_plan(flash_attn_installed: bool, stand_in: str = "sdpa") -> list[tuple[str, str]]:
    """``(kernel given to build_model, label)`` to try in order when tracing ``flash``; ``stand_in``: the kernel the
    model is built with where SDPA's flash backend stands in (:attr:`autofit.workload.types.Workload.flash_stand_in`)."""
    fallback = [(stand_in, SDPA_FLASH)]
    return [("flash", FLASH_ATTN), *fallback] if flash_attn_installed else fallback


def flash_attn_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def kernel_context(label: str) -> Iterator[None]:
    """SDPA restricted to its flash backend, its calls taken as flash-attn takes them (:func:`stand_in_call`), for
    :data:`SDPA_FLASH`; nothing otherwise."""
    if label != SDPA_FLASH:
        yield
        return
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention

    def as_flash_attn(*args: Any, **kwargs: Any) -> Any:
        return stand_in_call(sdpa, dict(zip(SDPA_ARGUMENTS, args, strict=False)) | kwargs)

    functional.scaled_dot_product_attention = as_flash_attn
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield
    finally:
        functional.scaled_dot_product_attention = sdpa


def stand_in_call(sdpa: Any, bound: dict[str, Any]) -> Any:
    """``sdpa`` called with ``bound`` (its arguments by name) as flash-attn takes the call: broadcast key/value heads
    with ``enable_gqa``, a value narrower than the query padded to its width and the output cut back."""
    import torch

    bound = dict(bound)
    if broadcasts_heads(bound["query"], bound["key"], bool(bound.get("enable_gqa", False))):
        bound["enable_gqa"] = True
    width, value_width = bound["query"].shape[-1], bound["value"].shape[-1]
    if value_width < width:
        bound["value"] = torch.nn.functional.pad(bound["value"], (0, width - value_width))
        return sdpa(**bound)[..., :value_width]
    return sdpa(**bound)


@contextlib.contextmanager
def flash_alike_calls(found: list[bool]) -> Iterator[None]:
    """For each SDPA call run inside, appends whether :data:`SDPA_FLASH`'s trace runs it as SDPA's own choice does:
    the call run again as the stand-in runs it (:func:`stand_in_call` under SDPA's flash backend) dispatches the same
    ATen kernels in the same order, so a step holds and computes the same with either. The function is replaced as
    :func:`kernel_context` replaces it: enter this first where :func:`autofit.trace.sdpa.sdpa_as_dispatched` is entered
    inside it, as in a trace step."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode

    class Kernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.run: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.run.append(str(func))
            return func(*args, **(kwargs or {}))

    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention

    def recorded(*args: Any, **kwargs: Any) -> Any:
        with Kernels() as own:
            out = sdpa(*args, **kwargs)
        try:  # (SDPA warns why its flash backend refuses a call: the answer here, not news)
            with Kernels() as stand_in, sdpa_kernel(SDPBackend.FLASH_ATTENTION), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stand_in_call(sdpa, dict(zip(SDPA_ARGUMENTS, args, strict=False)) | kwargs)
            found.append(own.run == stand_in.run)
        except Exception:  # the flash backend refuses the call: the stand-in's trace differs (or fails)
            found.append(False)
        return out

    functional.scaled_dot_product_attention = recorded
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = sdpa
