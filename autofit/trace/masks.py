"""transformers' attention mask traced as eager training makes it (:func:`causal_mask_as_eager`).

A causal LM trained on batches of whole sequences needs no mask: transformers' ``create_causal_mask``
(``masking_utils.py``) returns None and SDPA runs with ``is_causal``. Without a KV cache (``use_cache=False``, as every
checkpointed layer runs: :func:`autofit.ds.apply.apply_checkpointing`), it first asks
``find_packed_sequence_indices(position_ids)`` whether the rows pack several sequences, a question of the positions'
values. On fake tensors ``is_tracing`` is true (``is_fake_tensor``), so the answer is "maybe", and the mask is made
whole: a ``[batch, 1, s, s]`` boolean and, in each layer's SDPA call, its twin in the model's dtype (3 bytes a token
pair in bf16: 192 GiB at 262,144 tokens) that real tensors never hold. The trace's own batches state no positions
(the model counts them from 0), so none is packed and the question has eager's answer: None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any


@contextlib.contextmanager
def causal_mask_as_eager(batch: Mapping[str, Any] | Any) -> Iterator[None]:
    """transformers' packed-sequence check answered "not packed" for the step, where ``batch`` gives no
    ``position_ids`` (module docstring); nothing changed where it does, or where transformers has no such check."""
    masking = _masking_utils()
    original = getattr(masking, "find_packed_sequence_indices", None) if masking is not None else None
    states_positions = isinstance(batch, Mapping) and "position_ids" in batch
    if original is None or states_positions:
        yield
        return
    masking.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _not_packed(position_ids: Any) -> None:
    """``find_packed_sequence_indices``' answer for positions counted from 0 in every row: one sequence a row."""
    return None


def _masking_utils() -> Any:
    try:
        from transformers import masking_utils
    except ImportError:  # a workload without transformers
        return None
    return masking_utils
