"""Held-out benchmark: a tiny T5 encoder-decoder (transformers, random weights).

What it checks in the cost model: two stacks of blocks (the decoder's have
cross-attention), two sequence lengths, and relative-position attention bias.
``layers`` is explicit: T5 keeps ``encoder.block`` and ``decoder.block`` as two
``nn.ModuleList``s of equal length, so the default (the longest list, first found
on a tie) would see only the encoder's half. Here they are listed in execution
order, encoder first.
"""

from __future__ import annotations

import torch

from autofit import Workload

VOCAB_SIZE = 4096
SRC_LEN = 128
TGT_LEN = 64


def kernels() -> tuple[str, ...]:
    """The kernels the installed transformers builds T5 with: SDPA from 5.15 on (``_supports_sdpa``), eager always."""
    from transformers import T5PreTrainedModel

    return ("eager", "sdpa") if T5PreTrainedModel._supports_sdpa else ("eager",)


def build_model(attention: str | None = None) -> torch.nn.Module:
    """The model with ``attention``; None: the fastest kernel this transformers builds T5 with."""
    from transformers import AutoModelForSeq2SeqLM, T5Config

    attention = attention or kernels()[-1]
    if attention not in kernels():
        raise ValueError(f"this transformers builds T5 with attention {' or '.join(kernels())}, but got {attention=}")
    config = T5Config(
        vocab_size=VOCAB_SIZE,
        d_model=256,
        d_kv=64,
        d_ff=1024,
        num_layers=4,
        num_decoder_layers=4,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        attn_implementation=attention,
    )
    return AutoModelForSeq2SeqLM.from_config(config)


def make_batch(n: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(1, VOCAB_SIZE, (n, SRC_LEN)),
        "attention_mask": torch.ones(n, SRC_LEN, dtype=torch.long),
        "labels": torch.randint(1, VOCAB_SIZE, (n, TGT_LEN)),
    }


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [*model.encoder.block, *model.decoder.block]


def workload() -> Workload:
    return Workload(
        model=build_model,
        batch=make_batch,
        layers=blocks,
        tokens_per_sample=SRC_LEN + TGT_LEN,
        attention_kernels=kernels(),
        name="t5-encdec-tiny",
    )
