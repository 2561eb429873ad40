"""What the long-context keys need to know of a workload's sequence, before anything is traced.

An ``hf:`` causal language model states it (:func:`autofit.workload.hf.hf_workload`); a plain
:class:`~autofit.workload.types.Workload` has none, and the long-context keys (``sequence_parallel``,
``tiled_mlp``, ``tiled_loss``, ``offload_activations``) stay off for it (:func:`autofit.core.space.dimensions`).
The rules (:mod:`autofit.core.rules`) read it: DeepSpeed's Ulysses wrapper splits the attention heads and the
sequence over the sequence-parallel ranks (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``,
``UlyssesSPAttentionHF.__init__``, :131-152) and wraps only a Hugging Face attention registered in
``ALL_ATTENTION_FUNCTIONS`` (``register_with_transformers``, :395-568).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from autofit.core.errors import AutofitError


@dataclass(frozen=True)
class SequenceShape:
    """The sequence a causal language model trains at, and its attention heads."""

    seq_len: int
    """Tokens per sample (``--seq-len``)."""
    n_heads: int
    """Query heads of each attention layer (the text config's ``num_attention_heads``)."""
    n_kv_heads: int
    """Key/value heads (``num_key_value_heads``; equal to ``n_heads`` without grouped-query attention)."""
    hidden_size: int = 0
    """The model's hidden size (``hidden_size``): DeepSpeed's TiledMLP runs ``ceil((seq/sp) / hidden)`` tiles;
    0: not known."""
    causal_lm: bool = True
    """A Hugging Face causal LM: DeepSpeed's ``UlyssesSPAttentionHF`` can wrap its attention, TiledMLP its MLP
    and ``sequence_tiled_compute`` its logits and loss."""
    intermediate_size: int = 0
    """The MLP's intermediate width (``intermediate_size``), which AutoTP splits; 0: not known."""
    vocab_size: int = 0
    """The vocabulary (``vocab_size``), which AutoTP splits the untied head's outputs by; 0: not known."""
    tp_styles: tuple[str, ...] = ()
    """The partition styles of the model's Hugging Face ``tp_plan`` (the config's ``base_model_tp_plan`` and the
    class's ``_tp_plan``, which DeepSpeed merges and shards by: ``_get_hf_tp_plan``,
    ``deepspeed/runtime/tensor_parallel/config.py``), sorted; empty: the model states none."""
    tied_head: bool = False
    """The head shares the embedding's weight (``tie_word_embeddings``)."""

    def __post_init__(self) -> None:
        if isinstance(self.hidden_size, bool) or not isinstance(self.hidden_size, int) or self.hidden_size < 0:
            raise AutofitError(f"SequenceShape.hidden_size must be an integer >= 0, but got {self.hidden_size!r}")
        for name in ("intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AutofitError(f"SequenceShape.{name} must be an integer >= 0, but got {value!r}")
        for name in ("seq_len", "n_heads", "n_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AutofitError(f"SequenceShape.{name} must be an integer >= 1, but got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SequenceShape:
        return cls(**{**data, "tp_styles": tuple(data.get("tp_styles", ()))})

    def with_length(self, seq_len: int) -> SequenceShape:
        """The same model at another sequence length (``--seq-len max``'s bisection)."""
        return replace(self, seq_len=seq_len)

    def mlp_tiles(self, sequence_parallel: int) -> int:
        """DeepSpeed's TiledMLP tile count for a rank's ``seq/sp`` tokens (:func:`mlp_tiles`)."""
        return mlp_tiles(self.seq_len, sequence_parallel, self.hidden_size)


def mlp_tiles(seq_len: int, sequence_parallel: int, hidden_size: int) -> int:
    """DeepSpeed's TiledMLP tile count for a rank's ``seq/sp`` tokens: ``ceil((seq/sp) / hidden)`` (the tutorial's
    rule and ``TiledMLP``'s docstring, ulysses_sp.py:975-981); 1 where the hidden size is not known (0)."""
    local = -(-seq_len // sequence_parallel)
    return max(1, -(-local // hidden_size)) if hidden_size else 1


def loss_tiles(vocab_size: int, hidden_size: int) -> int:
    """The tiled loss's shard count ``ceil(vocab / hidden)`` (Liger's chunking rule, which the cost model prices and
    :func:`autofit.ds.long_context.apply_tiled_loss` runs); 1 where the hidden size is not known (0)."""
    return max(1, -(-vocab_size // hidden_size)) if hidden_size else 1
