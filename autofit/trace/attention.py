"""How the trace runs each attention kernel, and the label that says how ``flash`` was traced.

``flash`` is traced through flash-attn's own functions where flash-attn is installed (the workload's
model calls them; flash-attn registers fake implementations of its ops, so they run on fake tensors)
-- its memory is flash-attn's, which differs from SDPA's. Where it is not installed, or its functions
cannot run in the trace, ``flash`` is traced as SDPA forced to its flash backend
(``torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)``: saves the output and the log-sum-exp,
never the S x S scores). :data:`FLASH_ATTN` / :data:`SDPA_FLASH` label which one a prediction rests on.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

FLASH_ATTN = "flash-attn"
SDPA_FLASH = "sdpa flash backend"


def flash_trace_plan(flash_attn_installed: bool) -> list[tuple[str, str]]:
    """``(kernel given to build_model, label)`` to try in order when tracing ``flash``."""
    fallback = [("sdpa", SDPA_FLASH)]
    return [("flash", FLASH_ATTN), *fallback] if flash_attn_installed else fallback


def flash_attn_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def kernel_context(label: str) -> Iterator[None]:
    """SDPA restricted to its flash backend for :data:`SDPA_FLASH`; nothing otherwise."""
    if label != SDPA_FLASH:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        yield
