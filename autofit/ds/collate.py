"""Batches a sequence-parallel run can take: padded to a multiple of the SP degree, with ``position_ids``.

DeepSpeed's ``UlyssesSPDataLoaderAdapter`` (which the Trainer and Accelerate wrap a training DataLoader in under
``sp_backend="deepspeed"``) pads nothing: a batch whose length is not a multiple of ``sp`` raises, and one without
``position_ids`` raises too (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``, ``refill``; docs/develop/
long-context.md, "Hugging Face Trainer / Accelerate"). :class:`SequenceCollator` pads a list of samples to the
longest, rounded up to :func:`pad_multiple` (``input_ids`` with the pad token, ``labels`` with -100), and adds
``position_ids`` (``0 .. len-1`` per sample). With a tokenizer, transformers' own
``DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=pad_multiple(ds))`` pads the same way
but adds no ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autofit.core.errors import AutofitError
from autofit.ds.sequence_parallel import sp_degree

IGNORE_INDEX = -100


def pad_multiple(ds_config: Mapping[str, Any]) -> int:
    """What a batch's length must be a multiple of under the JSON: its sequence-parallel degree (1 without SP)."""
    return sp_degree(ds_config)


@dataclass(frozen=True)
class SequenceCollator:
    """``collator(samples) -> batch``: ``input_ids``, ``labels`` (each sample's own, or its ``input_ids``; the model
    shifts them), ``attention_mask`` and ``position_ids``, padded on the right to a multiple of
    ``pad_to_multiple_of``."""

    pad_to_multiple_of: int = 1
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.pad_to_multiple_of, bool) or not isinstance(self.pad_to_multiple_of, int) \
                or self.pad_to_multiple_of < 1:
            raise AutofitError(f"pad_to_multiple_of must be an integer >= 1, but got {self.pad_to_multiple_of!r}")

    @classmethod
    def for_json(cls, ds_config: Mapping[str, Any], pad_token_id: int = 0) -> SequenceCollator:
        return cls(pad_to_multiple_of=pad_multiple(ds_config), pad_token_id=pad_token_id)

    def padded_length(self, longest: int) -> int:
        return -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        import torch

        ids = [torch.as_tensor(s["input_ids"]).reshape(-1) for s in samples]
        length = self.padded_length(max(len(t) for t in ids))
        batch = {key: torch.full((len(ids), length), fill, dtype=torch.long)
                 for key, fill in (("input_ids", self.pad_token_id), ("labels", IGNORE_INDEX), ("attention_mask", 0))}
        for row, (sample, tokens) in enumerate(zip(samples, ids, strict=True)):
            n = len(tokens)
            batch["input_ids"][row, :n] = tokens
            labels = sample.get("labels")
            batch["labels"][row, :n] = tokens if labels is None else torch.as_tensor(labels).reshape(-1)
            batch["attention_mask"][row, :n] = 1
        batch["position_ids"] = torch.arange(length).expand(len(ids), length).clone()
        return batch
