"""SDPA traced as the target device dispatches it (:func:`sdpa_as_dispatched`).

The trace's fake tensors are CPU tensors, so ``torch.nn.functional.scaled_dot_product_attention`` picks a kernel
as the CPU does (``select_sdp_backend_cpp``, ``aten/src/ATen/native/transformers/sdp_utils_cpp.cpp``). Two
cases differ from CUDA's choice (``sdp_utils.cpp``):

- **Attention dropout.** The CPU's flash kernel takes no dropout (``check_for_dropout``), so a model that trains
  with it (StarCoder2's ``attention_dropout=0.1``) falls to SDPA's math path here: q, k and v upcast to fp32
  (``_scaled_dot_product_attention_math`` in ``attention.cpp``, unless ``allow_fp16_bf16_reduction_math_sdp``), the
  S x S scores, the dropout mask and the dropped probabilities saved, above eager's own. CUDA's flash and
  memory-efficient kernels take dropout and save only the output, the log-sum-exp and the Philox seed and offset,
  as without it. For a CUDA target such a call is traced without its dropout; for a CPU target as it is.
- **Broadcast heads.** A call whose key/value have fewer heads than the query, without ``enable_gqa`` (Falcon's
  multi-query attention up to transformers 5.24, one key head for 71 query heads, ``modeling_falcon.py``; from 5.25
  the shared SDPA function repeats them to the query's where a mask is passed, and Falcon always passes one), is
  refused by every fused kernel on CUDA too: ``check_batch_size_and_num_heads_dense`` requires equal heads unless
  ``enable_gqa`` is set (``sdp_utils_cpp.h``). It runs the math path there as here, fp32 upcast included, so its
  trace stands as it is (more than eager's, which keeps 16-bit probabilities): :data:`MATH_BROADCAST` labels it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: ``torch.nn.functional.scaled_dot_product_attention``'s arguments, in order
SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
#: the largest head dimension CUDA's flash kernel takes (``check_head_dim_size_flash`` in ``sdp_utils.cpp``)
FUSED_HEAD_DIM = 256
#: how ``sdpa`` was traced for a model whose calls broadcast key/value heads (the label of ``attention_traces``)
MATH_BROADCAST = ("SDPA math path: key/value heads broadcast to the query's without enable_gqa, which no fused "
                  "kernel takes on CUDA either (sdp_utils check_batch_size_and_num_heads_dense), so q, k, v run "
                  "upcast to fp32; eager holds less")
#: the dispatch of each target: a CUDA device's, or the CPU's (a ``--hardware cpu`` plan)
DISPATCHES = ("cuda", "cpu")


def broadcasts_heads(query: Any, key: Any, enable_gqa: bool) -> bool:
    """Key/value with other head counts than the query and no ``enable_gqa``: no fused kernel takes it."""
    return tuple(query.shape[:-2]) != tuple(key.shape[:-2]) and not enable_gqa


def fused_takes_dropout(query: Any, key: Any, enable_gqa: bool) -> bool:
    """Whether CUDA's fused kernels would take this call with its dropout: equal head counts (or ``enable_gqa``:
    flash's grouped-query path) and a head dimension flash takes."""
    return not broadcasts_heads(query, key, enable_gqa) and query.shape[-1] <= FUSED_HEAD_DIM


@contextlib.contextmanager
def sdpa_as_dispatched(dispatch: str, seen: set[str] | None = None) -> Iterator[None]:
    """SDPA calls traced as ``dispatch`` (one of :data:`DISPATCHES`) would run them: for ``cuda``, a call with dropout
    that CUDA's fused kernels take is traced without it (what they hold is the same with and without dropout).
    ``seen`` collects :data:`MATH_BROADCAST` where a call broadcasts heads.

    The function itself is replaced for the step (models call it as ``torch.nn.functional.scaled_dot_product_attention``,
    transformers' ``integrations/sdpa_attention.py`` included): a ``TorchFunctionMode`` is not active where a
    checkpointed layer recomputes its forward in backward, which then recomputes other tensors than it saved."""
    import torch

    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention

    def traced(*args: Any, **kwargs: Any) -> Any:
        bound = dict(zip(SDPA_ARGUMENTS, args, strict=False)) | kwargs
        gqa = bool(bound.get("enable_gqa", False))
        if seen is not None and broadcasts_heads(bound["query"], bound["key"], gqa):
            seen.add(MATH_BROADCAST)
        if dispatch == "cuda" and bound.get("dropout_p") and fused_takes_dropout(bound["query"], bound["key"], gqa):
            return sdpa(**(bound | {"dropout_p": 0.0}))
        return sdpa(*args, **kwargs)

    functional.scaled_dot_product_attention = traced
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = sdpa
