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
"""

from __future__ import annotations

import contextlib
import importlib.util
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
    """SDPA restricted to its flash backend, its calls taken as flash-attn takes them, for :data:`SDPA_FLASH`;
    nothing otherwise."""
    if label != SDPA_FLASH:
        yield
        return
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention

    def as_flash_attn(*args: Any, **kwargs: Any) -> Any:
        bound = dict(zip(SDPA_ARGUMENTS, args, strict=False)) | kwargs
        if broadcasts_heads(bound["query"], bound["key"], bool(bound.get("enable_gqa", False))):
            bound["enable_gqa"] = True
        width, value_width = bound["query"].shape[-1], bound["value"].shape[-1]
        if value_width < width:
            bound["value"] = functional.pad(bound["value"], (0, width - value_width))
            return sdpa(**bound)[..., :value_width]
        return sdpa(**bound)

    functional.scaled_dot_product_attention = as_flash_attn
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield
    finally:
        functional.scaled_dot_product_attention = sdpa
