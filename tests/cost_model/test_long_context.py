"""Long-context pricing (issue 38) on a tiny hf: Llama traced on fake tensors: a longer sequence never predicts less,
SP 2 about halves the activations, the tiled loss and activation offload shrink the device's share at a long sequence
(and the tiled loss not at a short one), offload moves it to the host, and the extrapolation through two traces lands
on a third."""

from __future__ import annotations

from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.core.hardware import PRESETS
from autofit.cost_model import predict
from autofit.cost_model.memory import activation_peak_bytes
from autofit.planning.longest import facts_at_length
from autofit.trace import trace_workload
from autofit.workload.hf import hf_workload

LLAMA = str(Path(__file__).resolve().parents[2] / "examples" / "hf_configs" / "llama_gqa")
H100 = PRESETS["h100-80gb"]
Z3 = Config(micro_batch_size=1, zero_stage=3, checkpoint_ratio=1.0)


@pytest.fixture(scope="module")
def traced() -> dict[int, object]:
    request = {"precisions": ("fp32",), "attentions": ("sdpa",), "checkpoint_ratios": (0.0, 1.0),
               "micro_batches": (1, 2)}
    return {s: trace_workload(hf_workload(LLAMA, seq_len=s), **request) for s in (32, 64, 128)}


@pytest.mark.slow
def test_the_trace_exposes_the_causal_lms_shapes(traced) -> None:
    facts = traced[64]
    assert (facts.seq_len, facts.vocab_size, facts.intermediate_size, facts.hidden_size) == (64, 4096, 688, 256)
    assert facts.kv_width == 2 * 256 // 8 and facts.n_kv_heads == 2
    assert facts.mlp_intermediates > 0 and facts.mlp_matrices == 3  # LlamaMLP is gated


@pytest.mark.parametrize("config", [Z3, Z3.with_(sequence_parallel=2), Z3.with_(tiled_loss=True, tiled_mlp=True),
                                    Z3.with_(offload_activations="cpu"), Z3.with_(checkpoint_ratio=0.0)])
@pytest.mark.slow
def test_a_longer_sequence_never_predicts_less(traced, config) -> None:
    peaks = [activation_peak_bytes(config, traced[s], keep_grads=False) for s in (32, 64, 128)]
    assert peaks == sorted(peaks)
    assert predict(config, traced[32], H100, 8).peak_bytes <= predict(config, traced[128], H100, 8).peak_bytes


@pytest.mark.slow
def test_sequence_parallel_two_about_halves_the_activations(traced) -> None:
    facts = traced[128]
    one = activation_peak_bytes(Z3, facts, keep_grads=False)
    two = activation_peak_bytes(Z3.with_(sequence_parallel=2), facts, keep_grads=False)
    assert 0.45 * one < two < 0.65 * one  # half, plus the all-to-all buffers of one layer
    time_one = predict(Z3, facts, H100, 8).time_breakdown
    time_two = predict(Z3.with_(sequence_parallel=2), facts, H100, 8).time_breakdown
    assert time_two["compute"] < time_one["compute"]
    assert time_two["communication"] > time_one["communication"]  # the Ulysses all-to-alls


@pytest.mark.slow
def test_the_trace_splits_its_peak_into_the_head_and_the_layers(traced) -> None:
    for profile in traced[128].profiles.values():
        for point in profile.points:
            assert point.head_peak_without_grads_bytes > 0 and point.body_peak_without_grads_bytes > 0
            assert point.peak_without_grads_bytes == max(point.head_peak_without_grads_bytes,
                                                         point.body_peak_without_grads_bytes)


@pytest.mark.slow
def test_a_tiled_loss_pays_only_where_the_logits_outweigh_the_lm_heads_gradient(traced) -> None:
    """V = 4,096, h = 256: the tiles accumulate the lm_head's 4 MiB gradient beside each tile's own, more than the
    1.5 MiB of logits cross-entropy holds at 32 tokens; at 2,048 tokens the logits' 96 MiB dwarf it."""
    short, long = traced[32], facts_at_length(traced[64], traced[128], 2048)
    tiled = Z3.with_(tiled_loss=True)
    assert activation_peak_bytes(tiled, short, False) > activation_peak_bytes(Z3, short, False)
    assert activation_peak_bytes(tiled, long, False) < 0.5 * activation_peak_bytes(Z3, long, False)


@pytest.mark.slow
def test_tiling_and_offload_shrink_the_device_and_offload_fills_the_host(traced) -> None:
    # traced at the length itself: carried from 64 and 128 tokens, a checkpointed layer's recompute, whose MLP
    # TiledMLP tiles, stays under what does not grow with the length (the layer's gradients)
    facts = trace_workload(hf_workload(LLAMA, seq_len=2048), precisions=("fp32",), attentions=("sdpa",),
                           checkpoint_ratios=(0.0, 1.0), micro_batches=(1, 2))
    base = predict(Z3, facts, H100, 8)
    tiled = predict(Z3.with_(tiled_loss=True), facts, H100, 8)
    assert tiled.breakdown.activations < base.breakdown.activations
    assert tiled.time_breakdown["compute"] > base.time_breakdown["compute"]  # the lm_head runs again
    for ratio in (0.0, 1.0):  # the MLP's intermediates unsaved, or recomputed, and their gradients one tile at a time
        loss_tiled = Z3.with_(checkpoint_ratio=ratio, tiled_loss=True)  # the loss's logits are not the peak
        plain = predict(loss_tiled, facts, H100, 8)
        tiled_mlp = predict(loss_tiled.with_(tiled_mlp=True), facts, H100, 8)
        assert tiled_mlp.breakdown.activations < plain.breakdown.activations
    offloaded = predict(Z3.with_(offload_activations="cpu"), facts, H100, 8)
    assert offloaded.breakdown.activations <= base.breakdown.activations
    assert offloaded.host_peak_bytes > base.host_peak_bytes


@pytest.mark.slow
def test_two_traces_extrapolate_to_a_third(traced) -> None:
    carried = facts_at_length(traced[32], traced[64], 128)
    for config in (Z3, Z3.with_(checkpoint_ratio=0.0)):
        expected = activation_peak_bytes(config, traced[128], keep_grads=False)
        assert activation_peak_bytes(config, carried, keep_grads=False) == pytest.approx(expected, rel=0.1)
