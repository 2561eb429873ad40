"""AutoTP's rules: which models, degrees and companions ``tensor_parallel`` runs with, the collapse for a model
without a ``tp_plan``, and the accumulation over ``world / tp`` data-parallel ranks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS
from autofit.core.rules import RULES, Context
from autofit.core.sequence import SequenceShape
from autofit.core.software import Software
from autofit.core.space import enumerate_candidates, space_from_dict

H100 = replace(PRESETS["h100-80gb"], devices_per_node=8)
LLAMA_STYLES = ("colwise", "colwise_gather_output", "rowwise")
LLAMA_70B = SequenceShape(seq_len=8192, n_heads=64, n_kv_heads=8, hidden_size=8192, intermediate_size=28672,
                          vocab_size=128256, tp_styles=LLAMA_STYLES)


def check(name, *, world=8, sequence=LLAMA_70B, hardware=H100, **values):
    rule = next(r for r in RULES if r.name == name)
    return rule.check(Context(hardware, world, 64, Software(), sequence), *(values[k] for k in rule.keys))


def test_tensor_parallel_stays_inside_a_node_and_divides_the_world():
    assert check("tp_within_a_node", world=16, tensor_parallel=8) is None
    assert "ranks of a node" in check("tp_within_a_node", world=16, tensor_parallel=16)
    assert "one rank" in check("tp_within_a_node", world=1, tensor_parallel=2)
    assert "does not divide the world size 12" in check("tp_divides_world", world=12, tensor_parallel=8,
                                                           sequence_parallel=1)


def test_tensor_parallel_needs_a_plan_deepspeed_converts_and_an_untied_head():
    assert check("tp_needs_a_plan", tensor_parallel=2) is None
    assert "tp_plan" in check("tp_needs_a_plan", sequence=SequenceShape(seq_len=512, n_heads=8, n_kv_heads=8),
                              tensor_parallel=2)
    moe = SequenceShape(seq_len=512, n_heads=8, n_kv_heads=8, tp_styles=("colwise", "local_colwise", "rowwise"))
    assert "'local_colwise', which DeepSpeed's AutoTP does not convert" in check("tp_needs_a_plan", sequence=moe,
                                                                               tensor_parallel=2)
    tied = SequenceShape(seq_len=512, n_heads=8, n_kv_heads=8, tp_styles=LLAMA_STYLES, tied_head=True)
    assert "tied" in check("tp_needs_an_untied_head", sequence=tied, tensor_parallel=2)
    assert check("tp_needs_an_untied_head", sequence=tied, tensor_parallel=1) is None


def test_tensor_parallel_must_split_the_heads_kv_heads_mlp_and_vocabulary_evenly():
    assert check("tp_divides_widths", tensor_parallel=8) is None
    assert "8 key/value heads" in check("tp_divides_widths", world=16, tensor_parallel=16)
    odd_vocab = SequenceShape(seq_len=512, n_heads=8, n_kv_heads=8, intermediate_size=1024, vocab_size=50257,
                              tp_styles=LLAMA_STYLES)
    assert "50257 vocabulary" in check("tp_divides_widths", sequence=odd_vocab, tensor_parallel=2)


def test_tensor_parallel_is_not_planned_beside_the_long_context_keys_or_compile():
    off = {"sequence_parallel": 1, "tiled_mlp": False, "tiled_loss": False, "offload_activations": "none"}
    assert check("tp_without_long_context", tensor_parallel=2, **off) is None
    assert "long-context" in check("tp_without_long_context", tensor_parallel=2, **(off | {"tiled_loss": True}))
    assert "compile" in check("tp_not_compiled", tensor_parallel=2, compile="on")


def test_the_global_batch_is_kept_over_world_over_tp_data_parallel_ranks():
    values = {"micro_batch_size": [1, 2, 4, 8], "zero_stage": [0, 3], "tensor_parallel": [1, 2, 8],
              "precision": ["bf16"], "attention": ["sdpa"], "compile": ["off"]}
    space = space_from_dict({**values, "global_batch_size": 64}, name="tp")
    configs = enumerate_candidates(space, hardware=H100, world_size=16, global_batch=64, fixed={}, sequence=LLAMA_70B,
                                   searches_attention=True, software=Software()).candidates
    assert {c.tensor_parallel for c in configs} == {1, 2, 8}
    for config in configs:
        assert config.micro_batch_size * config.grad_accum_steps * config.data_parallel(16) == 64
        assert config.data_parallel(16) == 16 // config.tensor_parallel


def test_a_model_without_a_plan_keeps_tensor_parallel_off_and_a_set_degree_is_one_error_line():
    space = space_from_dict({"tensor_parallel": [1, 2], "global_batch_size": 8}, name="tp")
    plain = SequenceShape(seq_len=512, n_heads=8, n_kv_heads=8)
    configs = enumerate_candidates(space, hardware=H100, world_size=2, global_batch=None, fixed={}, sequence=plain,
                                   searches_attention=True, software=Software()).candidates
    assert {c.tensor_parallel for c in configs} == {1}
    with pytest.raises(AutofitError, match="tensor_parallel=2 cannot run: it needs an hf: causal LM"):
        enumerate_candidates(space, hardware=H100, world_size=2, global_batch=None, fixed={"tensor_parallel": 2},
                             sequence=None, searches_attention=True, software=Software())
