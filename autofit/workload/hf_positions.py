"""An ``hf:`` text model's sequence: the length it is planned at, and the config's position limit it is checked
against (:func:`text_lengths`, what :func:`autofit.workload.hf_tasks.sequence_lengths` returns the lengths of).

**Which tasks have a default length.** A dual encoder's text tower and a speech model's decoder are trained at their
config's limit, so that limit is the length planned where ``--seq-len`` is not given (:data:`DEFAULT_LENGTH_TASKS`):
CLIP's text is padded to its 77 positions (openai/CLIP's ``clip.tokenize`` pads every text to
``context_length=77``), SigLIP's to its 64 (transformers' SigLIP page: "the model was trained with
``padding="max_length"``"), and a Whisper decoder's labels hold at most ``max_target_positions`` tokens (448,
openai/whisper's ``n_text_ctx``): the longest transcript, so the plan holds for every shorter one. A causal LM's,
seq2seq's, masked LM's or classifier's ``max_position_embeddings`` is the longest the model may be used at
(Llama-3.1's 131072), not what one trains at: fine-tuning data is mostly far shorter and pretraining runs several
lengths, so planning the limit would price a length few users train at; those tasks need ``--seq-len``.

**A length past the limit.** Rotary positions (RoPE) and ALiBi are computed for any position: a longer sequence
runs, and whether the model is good there is its rope scaling's question, not memory's (ALST trains Llama-3.1-8B at
3.7M tokens, past its 131072: Bekman et al. 2025, "Arctic Long Sequence Training"); it is planned, with a note
(:func:`past_positions_note`). A table of positions (learned, as GPT-2's ``wpe``, BERT's, OPT's, CLIP's text and
Whisper's decoder keep) has one row a position: a longer sequence cannot run at all (``index out of range``), and is
one error line (:func:`positions_are_a_table`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autofit.core.errors import AutofitError

#: tasks whose length defaults to the config's position limit (module docstring)
DEFAULT_LENGTH_TASKS = ("contrastive", "speech-seq2seq")
#: config keys that name rotary positions: transformers' ``rope_parameters`` (``rope_theta`` and ``rope_scaling`` in
#: older configs and remote code), GPT-J's and CodeGen's ``rotary_dim``, GPT-NeoX remote code's ``rotary_pct`` and
#: ``rotary_emb_base``
ROTARY_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct", "rotary_emb_base")
#: ``position_embedding_type`` values that keep no table (ESM's ``rotary``; ``alibi``); any other (BERT's
#: ``absolute``, its ``relative_key`` distances up to the limit) indexes one
TABLE_FREE_TYPES = ("rotary", "alibi")


@dataclass(frozen=True)
class TextLengths:
    """The tokens per sample a text task is planned at, and what the plan should say about them."""

    lengths: tuple[int, ...]
    """``(seq_len,)``, or ``(seq_len, target_len)`` for seq2seq."""
    notes: tuple[str, ...] = ()
    """Sentences the report and the estimate JSON repeat: the default length, a length past the limit."""
    warnings: tuple[str, ...] = ()
    """The notes that are also a warning on stderr: a length past the limit."""


def position_limit(config: Any, task: str) -> tuple[str, int | None]:
    """``(name, value)`` of the config's position limit the task's sequence is checked against: a speech decoder's
    ``max_target_positions``, else the text config's ``max_position_embeddings``; value None where the config has no
    positive one (XLNet's -1, T5's none)."""
    name = "max_target_positions" if task == "speech-seq2seq" else "max_position_embeddings"
    value = getattr(config.get_text_config(), name, None)
    positive = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return name, value if positive else None


def positions_are_a_table(config: Any) -> bool:
    """Whether the text config's positions index a table of limit rows, so that no longer sequence runs: a
    ``position_embedding_type`` outside :data:`TABLE_FREE_TYPES` (BERT's ``absolute``, ESM's ``absolute`` beside a
    ``rope_theta`` it does not use), else no ``alibi`` and none of :data:`ROTARY_KEYS` (GPT-2, OPT, BART, CLIP's text,
    Whisper). A model without attention heads (RWKV) has nothing that indexes positions. Read from the config, not
    from a list of families; a model with no positions at all but attention heads (Jamba) reads as a table, and is
    planned past its limit by raising the limit in its config."""
    text = config.get_text_config()
    kind = getattr(text, "position_embedding_type", None)
    if isinstance(kind, str):
        return kind not in TABLE_FREE_TYPES
    if getattr(text, "num_attention_heads", None) is None or getattr(text, "alibi", False) is True:
        return False
    return all(getattr(text, key, None) is None for key in ROTARY_KEYS)


def past_positions_note(seq_len: int, limit_name: str, limit: int) -> str:
    """The sentence said of a length past the config's limit of computed positions (rotary, ALiBi), where a
    ``--seq-len N`` is planned and where ``--seq-len max`` answers (:mod:`autofit.planning.longest`)."""
    return (f"seq_len={seq_len} is past the config's {limit_name}={limit}: planned, as positions are computed for any "
            "length; how the model does past it is its rope scaling's question, not memory's")


def default_length_note(seq_len: int, limit_name: str, task: str) -> str:
    """The sentence said of a length taken from the config (:data:`DEFAULT_LENGTH_TASKS`)."""
    what = "its decoder's labels are" if task == "speech-seq2seq" else "its text is"
    return (f"seq_len={seq_len}: the config's {limit_name}, the length {what} trained at ({task}); "
            "--seq-len N plans another")


def text_lengths(config: Any, task: str, seq_len: int | None, target_len: int | None,
                 name_or_path: str) -> TextLengths:
    """The lengths a text ``task`` is planned at, with its notes (module docstring): ``seq_len``, or the config's
    limit for :data:`DEFAULT_LENGTH_TASKS`; a length past the limit planned with a note where positions are computed,
    one AutofitError line where they are a table; no length and no default: one line asking for ``--seq-len``."""
    limit_name, limit = position_limit(config, task)
    notes: list[str] = []
    if seq_len is None:
        if task not in DEFAULT_LENGTH_TASKS or limit is None:
            raise AutofitError(f"hf:{name_or_path} ({task}) needs a sequence length: pass --seq-len (seq_len=N)")
        seq_len = limit
        notes.append(default_length_note(seq_len, limit_name, task))
    longest = max(seq_len, target_len or 0)
    warnings: tuple[str, ...] = ()
    if limit is not None and longest > limit:
        if positions_are_a_table(config):
            raise AutofitError(f"hf:{name_or_path}: seq_len={longest} is past the config's {limit_name}={limit}, the "
                               f"rows of its table of positions (no row for position {limit}: the model cannot run "
                               f"it); raise {limit_name} in its config.json to plan a longer table")
        warnings = (past_positions_note(longest, limit_name, limit),)
    lengths = (seq_len, target_len or seq_len) if task == "seq2seq" else (seq_len,)
    return TextLengths(lengths=lengths, notes=(*notes, *warnings), warnings=warnings)
