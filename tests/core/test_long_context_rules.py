"""The long-context keys (issue 38): each rule and its reason, the collapse for a workload without a sequence, and
the accumulation over ``world / sequence_parallel`` data-parallel ranks."""

from __future__ import annotations

import pytest

from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS, Hardware
from autofit.core.rules import RULES, Context
from autofit.core.sequence import SequenceShape
from autofit.core.software import Software
from autofit.core.space import enumerate_candidates, space_from_dict

H100 = PRESETS["h100-80gb"]
CPU = Hardware(name="cpu", kind="cpu", memory_bytes=8 * 2**30, peak_flops={"fp32": 1e12, "bf16": 1e12, "fp16": 1e12})
LLAMA_8B = SequenceShape(seq_len=65536, n_heads=32, n_kv_heads=8, hidden_size=4096)


def check(name, *, world=8, sequence=LLAMA_8B, hardware=H100, **values):
    rule = next(r for r in RULES if r.name == name)
    return rule.check(Context(hardware, world, None, Software(), sequence), *(values[k] for k in rule.keys))


def test_sequence_parallel_must_divide_the_world_and_run_on_several_ranks():
    assert check("sp_divides_world", sequence_parallel=4) is None
    assert "does not divide the world size 8" in check("sp_divides_world", sequence_parallel=16)
    assert "one rank" in check("sp_needs_ranks", world=1, sequence_parallel=2)
    assert check("sp_needs_ranks", world=1, sequence_parallel=1) is None


def test_sequence_parallel_must_divide_the_heads_and_kv_heads_follow_deepspeed():
    assert "32 attention heads" in check("sp_divides_heads", world=64, sequence_parallel=64)
    # kv heads fewer than sp are replicated (8 kv heads, sp 16 and 32: sp % kv == 0)
    assert check("sp_divides_heads", world=32, sequence_parallel=32) is None
    odd = SequenceShape(seq_len=4096, n_heads=24, n_kv_heads=6, hidden_size=3072)
    assert "key/value heads" in check("sp_divides_heads", sequence=odd, world=8, sequence_parallel=4)


def test_sequence_parallel_needs_a_causal_lm_not_eager_a_divisible_sequence_and_zero3():
    assert "hf: causal LM" in check("sp_needs_hf_causal_lm", sequence=None, sequence_parallel=2)
    assert check("sp_needs_hf_causal_lm", sequence_parallel=2) is None
    assert "eager" in check("sp_not_eager", sequence_parallel=2, attention="eager")
    assert check("sp_not_eager", sequence_parallel=2, attention="sdpa") is None
    short = LLAMA_8B.with_length(65535)
    assert "sequence length 65535" in check("sp_divides_sequence", sequence=short, sequence_parallel=2)
    assert "ZeRO-3 only" in check("sp_needs_zero3", sequence_parallel=2, zero_stage=2)
    assert check("sp_needs_zero3", sequence_parallel=2, zero_stage=3) is None


def test_tiling_needs_a_causal_lm_and_more_than_one_tile():
    assert "hf: causal LM" in check("tiling_needs_hf_causal_lm", sequence=None, tiled_mlp=False, tiled_loss=True)
    assert check("tiling_needs_hf_causal_lm", tiled_mlp=True, tiled_loss=True) is None
    short = LLAMA_8B.with_length(4096)
    assert "one tile" in check("tiled_mlp_needs_two_tiles", sequence=short, tiled_mlp=True, sequence_parallel=1)
    assert check("tiled_mlp_needs_two_tiles", tiled_mlp=True, sequence_parallel=8) is None


def test_offloading_activations_needs_checkpointing_and_a_gpu():
    assert "checkpoint_ratio 0" in check("offload_activations_needs_checkpointing", offload_activations="cpu",
                                         checkpoint_ratio=0.0)
    assert check("offload_activations_needs_checkpointing", offload_activations="cpu", checkpoint_ratio=0.5) is None
    assert "CPU" in check("offload_activations_on_a_cpu_device", hardware=CPU, offload_activations="cpu")


SPACE = {"description": "long", "micro_batch_size": [1, 2], "precision": ["bf16"], "zero_stage": [2, 3],
         "checkpoint_ratio": [0.0, 1.0], "sequence_parallel": [1, 2, 4, 8], "tiled_mlp": [False, True],
         "tiled_loss": [False, True], "offload_activations": ["none", "cpu"]}


def enum(sequence, *, fixed=None, global_batch=8):
    return enumerate_candidates(space_from_dict(SPACE, name="long"), hardware=H100, world_size=8,
                                global_batch=global_batch, fixed=fixed or {}, searches_attention=True,
                                software=Software(), sequence=sequence)


def test_the_keys_stay_off_without_a_sequence_and_set_on_is_one_line():
    configs = enum(None).candidates
    assert {(c.sequence_parallel, c.tiled_mlp, c.tiled_loss, c.offload_activations) for c in configs} \
        == {(1, False, False, "none")}
    with pytest.raises(AutofitError, match="--set sequence_parallel=2 cannot run: it needs an hf: causal LM"):
        enum(None, fixed={"sequence_parallel": 2})


def test_accumulation_is_over_world_over_sp_data_parallel_ranks():
    configs = enum(LLAMA_8B).candidates
    assert {c.sequence_parallel for c in configs} == {1, 2, 4, 8}
    assert all(c.zero_stage == 3 for c in configs if c.sequence_parallel > 1)
    assert not any(c.offload_activations == "cpu" and c.checkpoint_ratio == 0 for c in configs)
    for c in configs:
        assert c.micro_batch_size * c.grad_accum_steps * (8 // c.sequence_parallel) == 8
    fixed = enum(LLAMA_8B, fixed={"grad_accum_steps": 1}).candidates
    assert {(c.sequence_parallel, c.micro_batch_size) for c in fixed} == {(1, 1), (2, 2), (4, 4), (8, 8)}
    assert {c.grad_accum_steps for c in fixed} == {1}
