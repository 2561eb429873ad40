"""``--seq-len max`` (issue 38) on a tiny hf: Llama on the CPU preset: the longest length, its config, and a ladder
in which every technique keeps or buys length."""

from __future__ import annotations

from pathlib import Path

import pytest

from autofit.core.errors import AutofitError
from autofit.planning.longest import longest_sequence
from autofit.planning.target import Target, prepare
from autofit.workload.entry import load_workload
from autofit.workload.hf import entry_lengths

LLAMA = "hf:" + str(Path(__file__).resolve().parents[2] / "examples" / "hf_configs" / "llama_gqa")


@pytest.mark.slow
def test_the_longest_sequence_on_two_cpu_ranks() -> None:
    answer = longest_sequence(Target(entry=LLAMA, hardware="cpu", memory="1GiB", gpus=2, global_batch=2, space="cpu",
                                     seq_len="max"))
    assert answer.seq_len > 0 and answer.config is not None and answer.prediction is not None
    assert answer.prediction.fits and answer.prediction.peak_bytes <= 2**30
    *cumulative, tp = answer.rungs  # the tiny Llama states a tp_plan: AutoTP over the node's 2 ranks comes last
    lengths = [rung.seq_len for rung in cumulative]
    assert lengths == sorted(lengths) and max(lengths[-1], tp.seq_len) == answer.seq_len
    assert lengths[-1] > lengths[0]  # the long-context keys buy length
    assert tp.name == "+ tensor parallelism (tp 2)" and tp.config is not None and tp.config.tensor_parallel == 2
    # beside no long-context key; whether it buys length is the model's (this one's logits, gathered whole on every
    # rank under AutoTP's colwise_gather_output head, dwarf its layers)
    assert tp.seq_len > 0 and tp.config.sequence_parallel == 1 and not tp.config.tiled_loss
    assert answer.seq_len % answer.config.sequence_parallel == 0
    assert "the longest sequence that fits" in answer.text()
    assert answer.to_dict()["ladder"][0]["rung"] == "no long-context technique"
    # past the config's 128 rotary positions: --seq-len N plans the answer, and both say so in the same words
    entry = f"{LLAMA}?seq_len={answer.seq_len}"
    assert answer.seq_len > 128 and load_workload(entry).tokens_per_sample == answer.seq_len
    planned = entry_lengths(entry)
    assert planned is not None and planned.warnings == (answer.position_note,)
    assert f"note: {answer.position_note}" in answer.text() and answer.to_dict()["position_note"] == answer.position_note


@pytest.mark.slow
def test_the_longest_sequence_stops_at_a_table_of_positions(tmp_path: Path) -> None:
    """GPT-2's learned positions (64 here): memory allows far more, the model cannot run a token past its table."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=64,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "gpt2")
    answer = longest_sequence(Target(entry=f"hf:{tmp_path / 'gpt2'}", hardware="cpu", memory="1GiB", gpus=1,
                                     global_batch=1, space="cpu", seq_len="max"))
    assert answer.seq_len == 64 and answer.position_note is None
    assert all(rung.seq_len == 64 for rung in answer.rungs)


def test_seq_len_max_is_estimates_question() -> None:
    with pytest.raises(AutofitError, match="--seq-len max is a question autofit estimate answers"):
        prepare(Target(entry=LLAMA, hardware="cpu", seq_len="max"))
    with pytest.raises(AutofitError, match="seq_len must be an integer >= 1 or max"):
        Target(entry=LLAMA, seq_len="long")
    assert Target(entry=LLAMA, seq_len="128").seq_len == 128


def test_an_answer_past_int32_hidden_states_says_so() -> None:
    """Memory may allow hidden states of more than 2^31 elements on a rank; kernels indexing in int32 do not."""
    from autofit.core.config import Config
    from autofit.planning.longest import INT32_ELEMENTS, Longest

    hidden = 4096
    def answer(seq_len: int, sp: int) -> Longest:
        return Longest(name="m", hardware="h100-80gb", world_size=sp, seq_len=seq_len,
                       config=Config(zero_stage=3, sequence_parallel=sp), prediction=None, rungs=(),
                       traced_lengths=(2048, 4096), max_position_embeddings=None,
                       int32_tokens=INT32_ELEMENTS // hidden)
    past = answer(600_000, 1)  # [1, 600_000, 4096]: 2.46e9 elements
    assert past.past_int32 and "more than 2^31 elements" in past.text() and past.to_dict()["past_int32"]
    assert not answer(500_000, 1).past_int32  # 2.05e9: under
    assert not answer(4_000_000, 8).past_int32  # 500,000 tokens a rank


@pytest.mark.slow
def test_the_fastest_fitting_config_is_the_one_pricing_every_candidate_gives() -> None:
    """:func:`fastest_fitting` replays the caching allocator for the fastest configs only, until one fits; its answer
    and prediction are those of pricing every candidate exactly, at a budget that half of them fit."""
    from dataclasses import replace as copied

    from autofit.cost_model import predict
    from autofit.cost_model.allocation_sequence import reserve_memo
    from autofit.planning.longest import fastest_fitting

    plan = prepare(Target(entry=LLAMA, hardware="h100-80gb", gpus=2, seq_len="1024",
                          set_values=("micro_batch_size=1", "attention=sdpa", "compile=off", "overlap_comm=false",
                                      "bucket_scale=1"))).plan()
    configs = plan.candidates
    priced = [predict(c, copied(plan.facts), plan.hardware, plan.world_size, plan.coefficients) for c in configs]
    budget = copied(plan.hardware, memory_bytes=sorted(p.peak_bytes for p in priced)[len(priced) // 2])
    every, fast = copied(plan.facts), copied(plan.facts)  # each with its own memo of replays
    exhaustive = [(c, predict(c, every, budget, plan.world_size, plan.coefficients)) for c in configs]
    config, prediction = max(((c, p) for c, p in exhaustive if p.fits), key=lambda cp: cp[1].samples_per_s)
    found = fastest_fitting(configs, fast, budget, plan)
    assert found is not None and found[0] == config and found[1].peak_bytes == prediction.peak_bytes
    assert len(reserve_memo(fast)) < len(reserve_memo(every))
