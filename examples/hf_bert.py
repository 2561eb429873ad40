"""A small BERT sequence classifier from transformers, built from a config (random weights).

``autofit run examples/hf_bert.py:workload --hardware cpu --memory 2GiB``

The attention kernel is searched through ``attn_implementation`` ("eager" or
"sdpa"; BERT has no flash-attention path in transformers, so "flash" is refused).
The batch is a dict, so the default loss ``model(**batch).loss`` applies, and the
default layers (the longest ``nn.ModuleList``) are the encoder's ``BertLayer``s.
"""

from __future__ import annotations

import torch

from autofit import Workload

VOCAB_SIZE = 8192
SEQ_LEN = 128
N_LABELS = 4


def build_model(attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification, BertConfig

    if attention not in ("eager", "sdpa"):
        raise ValueError(f"BERT supports attention 'eager' or 'sdpa', but got {attention=}")
    config = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=SEQ_LEN,
        num_labels=N_LABELS,
        attn_implementation=attention,
    )
    return AutoModelForSequenceClassification.from_config(config)


def make_batch(n: int) -> dict[str, torch.Tensor]:
    attention_mask = torch.ones(n, SEQ_LEN, dtype=torch.long)
    # ragged lengths so the padding mask does something
    lengths = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (n,))
    attention_mask[torch.arange(SEQ_LEN) >= lengths[:, None]] = 0
    return {
        "input_ids": torch.randint(0, VOCAB_SIZE, (n, SEQ_LEN)),
        "attention_mask": attention_mask,
        "labels": torch.randint(0, N_LABELS, (n,)),
    }


def workload() -> Workload:
    return Workload(model=build_model, batch=make_batch, tokens_per_sample=SEQ_LEN, name="bert-small")
