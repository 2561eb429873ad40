"""transformers' causal mask on fake tensors (:mod:`autofit.trace.masks`): a tiny Llama without a KV cache, as its
checkpointed layers run, holds no ``s x s`` tensor in the trace, as on real tensors, and its checkpointed trace is
linear in the length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autofit.trace.masks import causal_mask_as_eager

LLAMA = Path(__file__).resolve().parents[2] / "examples" / "hf_configs" / "llama_gqa"
TOKENS = 512


def _square_tensors(fake: bool, batch_of: Any) -> list[tuple[int, ...]]:
    """The shapes of every tensor ending in ``TOKENS x TOKENS`` one forward makes (``use_cache=False``)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig, AutoModelForCausalLM

    seen: list[tuple[int, ...]] = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tuple(tensor.shape[-2:]) == (TOKENS, TOKENS):
                    seen.append(tuple(tensor.shape))
            return out

    config = AutoConfig.from_pretrained(LLAMA, attn_implementation="sdpa")
    config.use_cache = False
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config)
        batch = batch_of(torch.randint(0, config.vocab_size, (1, TOKENS)))
        with causal_mask_as_eager(batch), Shapes():
            model(**batch)
    return seen


def test_fake_tensors_make_the_mask_real_tensors_do_not() -> None:
    def ids(tokens: Any) -> dict[str, Any]:
        return {"input_ids": tokens, "labels": tokens}

    assert _square_tensors(fake=False, batch_of=ids) == []
    assert _square_tensors(fake=True, batch_of=ids) == []


def test_positions_the_batch_states_are_left_to_transformers() -> None:
    """A batch with its own ``position_ids`` may pack several sequences a row: the mask is transformers' to make."""
    import torch

    def positioned(tokens: Any) -> dict[str, Any]:
        return {"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(TOKENS)[None]}

    assert _square_tensors(fake=True, batch_of=positioned)  # on fake tensors it cannot know: it makes one


@pytest.mark.slow
def test_a_checkpointed_trace_is_linear_in_the_length() -> None:
    """Every tensor a checkpointed layer holds is ``tokens x width`` under SDPA: the bytes a token of the body's peak
    are the same at 1, 2 and 4 thousand tokens (within 1%)."""
    from autofit.planning.target import Target, prepare

    per_token = []
    for tokens in (1024, 2048, 4096):
        facts = prepare(Target(entry=f"hf:{LLAMA}", hardware="h100-80gb", seq_len=str(tokens),
                               set_values=("micro_batch_size=1", "attention=sdpa", "checkpoint_ratio=1"))).plan().facts
        point = facts.profiles["bf16/sdpa/ckpt"].points[0]
        per_token.append(point.body_peak_without_grads_bytes / tokens)
    assert max(per_token) == pytest.approx(min(per_token), rel=0.01)
