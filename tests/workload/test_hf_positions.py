"""An ``hf:`` model's sequence against its config's position limit: a length past it is planned with a note where
positions are computed (RoPE, ALiBi) and refused where they are a table, each judged from the config and checked
against the model transformers builds; CLIP and Whisper default to the length they are trained at."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autofit import AutofitError
from autofit.workload.hf import entry_lengths, hf_workload
from autofit.workload.hf_positions import positions_are_a_table, text_lengths

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "hf_configs"
LIMIT = 8
SMALL = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}


def _configs() -> dict[str, tuple[object, str]]:
    """Tiny configs of each way to keep positions, limit :data:`LIMIT`, with the Auto class that trains them."""
    import transformers as t

    causal, masked = "AutoModelForCausalLM", "AutoModelForMaskedLM"
    return {
        "llama (rope)": (t.LlamaConfig(**SMALL, max_position_embeddings=LIMIT), causal),
        "gpt_neox (partial rope)": (t.GPTNeoXConfig(**SMALL, max_position_embeddings=LIMIT), causal),
        "falcon (alibi)": (t.FalconConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          alibi=True, max_position_embeddings=LIMIT), causal),
        "gpt2 (learned)": (t.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=LIMIT), causal),
        "opt (learned)": (t.OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=LIMIT, word_embed_proj_dim=16), causal),
        "bert (absolute)": (t.BertConfig(**SMALL, max_position_embeddings=LIMIT), masked),
        "esm (absolute beside rope_theta)": (t.EsmConfig(**SMALL, max_position_embeddings=LIMIT, pad_token_id=1,
                                                         position_embedding_type="absolute"), masked),
        "esm (rotary)": (t.EsmConfig(**SMALL, max_position_embeddings=LIMIT, pad_token_id=1,
                                     position_embedding_type="rotary"), masked),
    }


def _runs_past_its_limit(config: object, auto_class: str) -> bool:
    """Whether transformers' model of ``config`` takes a forward and backward one token past :data:`LIMIT` (it takes
    one well within it: a failure past it is the positions')."""
    import transformers

    model = getattr(transformers, auto_class).from_config(config)
    ids = torch.randint(3, 64, (1, LIMIT // 2))
    model(input_ids=ids, labels=ids).loss.backward()
    ids = torch.randint(3, 64, (1, LIMIT + 1))
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except (IndexError, RuntimeError):  # an index past the table, or a table's row count against the sequence
        return False
    return True


@pytest.mark.parametrize("family", list(_configs()))
def test_the_config_tells_a_table_of_positions_as_the_model_fails_past_it(family: str) -> None:
    config, auto_class = _configs()[family]
    assert positions_are_a_table(config) is not _runs_past_its_limit(config, auto_class)


def test_a_rope_model_past_its_limit_is_planned_with_a_note_a_learned_one_is_one_line(tmp_path: Path) -> None:
    """The Llama-shaped example (max_position_embeddings 128) at 4096 tokens, and BERT (a learned table of 128)."""
    workload = hf_workload(str(CONFIGS / "llama_gqa"), seq_len=4096)
    assert workload.tokens_per_sample == 4096 and workload.sequence is not None and workload.sequence.seq_len == 4096
    lengths = entry_lengths(f"hf:{CONFIGS / 'llama_gqa'}?seq_len=4096")
    assert lengths is not None and lengths.lengths == (4096,) and lengths.warnings == lengths.notes
    (note,) = lengths.warnings
    assert "seq_len=4096 is past the config's max_position_embeddings=128" in note
    assert entry_lengths(f"hf:{CONFIGS / 'llama_gqa'}?seq_len=128").notes == ()  # at the limit: nothing to say
    with pytest.raises(AutofitError) as info:
        hf_workload(str(CONFIGS / "bert"), seq_len=129)
    message = str(info.value)
    assert "\n" not in message and "seq_len=129 is past the config's max_position_embeddings=128" in message
    assert "raise max_position_embeddings" in message


def test_clip_and_whisper_default_to_the_length_they_are_trained_at_and_a_causal_lm_needs_one(tmp_path: Path) -> None:
    from transformers import CLIPConfig, LlamaConfig, WhisperConfig

    clip = CLIPConfig(text_config={"max_position_embeddings": 77}, architectures=["CLIPModel"])
    planned = text_lengths(clip, "contrastive", None, None, "clip")
    assert planned.lengths == (77,) and planned.warnings == ()
    assert "seq_len=77: the config's max_position_embeddings" in planned.notes[0]
    whisper = WhisperConfig(max_target_positions=448)
    planned = text_lengths(whisper, "speech-seq2seq", None, None, "whisper")
    assert planned.lengths == (448,) and "max_target_positions" in planned.notes[0]
    assert text_lengths(whisper, "speech-seq2seq", 100, None, "whisper").notes == ()
    with pytest.raises(AutofitError, match="needs a sequence length: pass --seq-len"):
        text_lengths(LlamaConfig(max_position_embeddings=131072), "causal-lm", None, None, "llama")
    with pytest.raises(AutofitError, match="past the config's max_target_positions=448"):
        text_lengths(whisper, "speech-seq2seq", 449, None, "whisper")  # a learned table of decoder positions
    WhisperConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                  decoder_attention_heads=2, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                  architectures=["WhisperForConditionalGeneration"]).save_pretrained(tmp_path / "whisper")
    batch = hf_workload(str(tmp_path / "whisper"), seq_len=None).batch(2)  # the entry without seq_len builds
    assert batch["labels"].shape == (2, 16) and batch["input_features"].shape == (2, 8, 16)
