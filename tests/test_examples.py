"""Every shipped example and held-out benchmark model loads and trains one step on CPU in fp32."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from autofit import Workload
from autofit.workload.entry import load_workload

ROOT = Path(__file__).resolve().parents[1]

# entry -> (expected number of repeated layers, whether attention is searched)
TRAINABLE = {
    "examples/gpt.py": (4, True),
    "examples/hf_bert.py": (4, True),
    "examples/mlp.py": (8, False),
    "benchmarks/models/t5_encdec.py": (8, True),
    "benchmarks/models/vit.py": (6, True),
    "benchmarks/models/gqa_llama.py": (4, True),
    "benchmarks/models/moe.py": (4, True),
    "benchmarks/models/cnn.py": (8, False),
    "benchmarks/models/qwen2_lm.py": (8, True),
}
NEEDS_TRANSFORMERS = {"hf_bert", "t5_encdec", "vit", "gqa_llama", "moe", "llama_7b", "llama2", "qwen2_lm"}
#: planning-only examples (built on meta tensors, never trained here)
PLANNING_ONLY = {"examples/llama_7b.py", "examples/llama2.py", "examples/seed_build_along.py"}
#: entries whose real step takes more than a few seconds on 2 cores: the full tier's (qwen2_lm: ~57 M parameters,
#: half of them its 32,000-token embedding and head)
SLOW_ENTRIES = {"benchmarks/models/qwen2_lm.py"}


def _entries(paths: Iterable[str]) -> list[Any]:
    """``paths`` sorted, as parameters: those of :data:`SLOW_ENTRIES` marked slow."""
    return [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_ENTRIES else p for p in sorted(paths)]


def _load(path: str, function: str = "workload") -> Workload:
    if Path(path).stem in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    return load_workload(f"{ROOT / path}:{function}")


def test_every_entry_file_is_covered() -> None:
    shipped = {str(p.relative_to(ROOT)) for p in [*ROOT.glob("examples/*.py"), *ROOT.glob("benchmarks/models/*.py")]}
    # gpu_large.py: 0.6-0.8 B models for the GPU benchmark, checked on the meta device (test_cuda_benchmark.py)
    gpu_only = {"benchmarks/models/gpu_large.py"}
    assert shipped - {"benchmarks/models/__init__.py"} == set(TRAINABLE) | PLANNING_ONLY | gpu_only


@pytest.mark.parametrize("path", _entries(TRAINABLE))
def test_entry_trains_one_step(path: str) -> None:
    n_layers, searches_attention = TRAINABLE[path]
    workload = _load(path)
    assert workload.searches_attention is searches_attention
    torch.manual_seed(0)
    model = workload.build_model("eager" if searches_attention else None)
    model.train()
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())

    layers = workload.repeated_layers(model)
    assert len(layers) == n_layers
    assert len({type(layer) for layer in layers}) == 1, "the repeated blocks should be one kind of block"
    owned = {id(m) for m in model.modules()}
    assert all(id(layer) in owned for layer in layers)

    batch = workload.batch(2)
    tensors = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, tuple) else [batch]
    assert all(t.device.type == "cpu" and t.shape[0] == 2 for t in tensors)

    loss = workload.compute_loss(model, batch)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads), "every parameter should get a gradient"
    # one optimizer step changes the weights
    before = next(iter(layers[0].parameters())).detach().clone()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert not torch.equal(before, next(iter(layers[0].parameters())))


@pytest.mark.parametrize("path", _entries(p for p, (_, attn) in TRAINABLE.items() if attn))
def test_eager_and_sdpa_attention_agree(path: str) -> None:
    workload = _load(path)
    batch = workload.batch(2)
    losses = []
    for attention in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = workload.build_model(attention).eval()  # eval: no dropout
        with torch.no_grad():
            losses.append(workload.compute_loss(model, batch).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


def test_gpt_flash_without_flash_attn_says_so() -> None:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flash-attn is installed")
    workload = _load("examples/gpt.py")
    with pytest.raises(RuntimeError, match="flash-attn"):
        workload.build_model("flash")


def test_tokens_per_sample_matches_the_batch() -> None:
    gpt = _load("examples/gpt.py")
    assert gpt.tokens_per_sample == gpt.batch(1)["input_ids"].shape[1]
    assert _load("examples/mlp.py").tokens_per_sample is None
    assert _load("benchmarks/models/cnn.py").tokens_per_sample is None


def test_t5_layers_cover_encoder_then_decoder() -> None:
    workload = _load("benchmarks/models/t5_encdec.py")
    model = workload.build_model()
    layers = workload.repeated_layers(model)
    assert layers == [*model.encoder.block, *model.decoder.block]
    assert not layers[0].is_decoder and layers[-1].is_decoder


def test_moe_has_more_expert_parameters_than_a_dense_mlp() -> None:
    workload = _load("benchmarks/models/moe.py")
    model = workload.build_model()
    config = model.config
    assert config.num_local_experts > config.num_experts_per_tok
    assert workload.repeated_layers(model) == list(model.model.layers)


def test_gqa_llama_shares_key_value_heads() -> None:
    workload = _load("benchmarks/models/gqa_llama.py")
    model = workload.build_model()
    attn = model.model.layers[0].self_attn
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert attn.k_proj.out_features * 4 == attn.q_proj.out_features


def test_llama_7b_builds_on_meta_with_7b_params() -> None:
    workload = _load("examples/llama_7b.py")
    assert workload.searches_attention
    with torch.device("meta"):
        model = workload.build_model("sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == pytest.approx(6.74e9, rel=0.01)
    assert all(p.is_meta for p in model.parameters())
    assert len(workload.repeated_layers(model)) == 32
    assert workload.tokens_per_sample == 2048
    # the batch is cheap and real: only the model is meta
    assert workload.batch(1)["input_ids"].shape == (1, 2048)


@pytest.mark.parametrize(("function", "n_params", "n_layers"), [("llama2_7b", 6.74e9, 32), ("llama2_13b", 13.02e9, 40),
                                                               ("llama2_70b", 68.98e9, 80)])
def test_llama2_builds_on_meta_with_its_published_size(function: str, n_params: float, n_layers: int) -> None:
    workload = _load("examples/llama2.py", function)
    with torch.device("meta"):
        model = workload.build_model("sdpa")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(n_params, rel=0.01)
    assert len(workload.repeated_layers(model)) == n_layers
    assert workload.tokens_per_sample == 4096


def test_seed_build_along_is_the_seeds_shape_with_4x_the_parameters_it_claims() -> None:
    workload = _load("examples/seed_build_along.py")
    assert not workload.searches_attention
    with torch.device("meta"):
        model = workload.build_model()
    assert model.embedding.weight.shape == (50257, 2048) and model.head.weight.shape == (50257, 2048)
    layers = workload.repeated_layers(model)
    assert len(layers) == 24 and layers[0].ff[0].weight.shape == (8192, 2048)
    n_params = sum(p.numel() for p in model.parameters())
    # the seed says "~350M params"; the docstring and the README give the count: 1,416,552,448
    assert n_params == pytest.approx(1.4166e9, rel=1e-4) and n_params > 4 * 350e6
    assert workload.batch(1)["input_ids"].shape == (1, 1024) and workload.tokens_per_sample == 1024


def test_seed_build_along_tiny_trains_one_step_with_the_seeds_loss() -> None:
    workload = _load("examples/seed_build_along.py", "workload_tiny")
    torch.manual_seed(0)
    model = workload.build_model().train()
    batch = workload.batch(2)
    loss = workload.compute_loss(model, batch)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    layers = workload.repeated_layers(model)
    assert len(layers) == 4 and all(id(layer) in {id(m) for m in model.modules()} for layer in layers)
