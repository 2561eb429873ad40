"""The model's parameters as built on the meta device: counts, shapes, and what optimizers keep per tensor.

What :mod:`autofit.trace` records beside the traced activations (:class:`autofit.cost_model.facts.ModelFacts`):
no forward runs here, so nothing costs memory.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from autofit.ds.buckets import persistence_threshold
from autofit.ds.fp8 import convertible_linear
from autofit.trace.layers import layer_pattern
from autofit.workload.types import Workload


@dataclass(frozen=True)
class SequenceStructure:
    """What the long-context pricing reads of a causal LM (:mod:`autofit.cost_model.long_context`); every field 0 for
    a workload without ``Workload.sequence``. Each field is the :class:`~autofit.cost_model.facts.ModelFacts` field of
    the same name."""

    seq_len: int = 0
    """Tokens per sample the model is traced at."""
    vocab_size: int = 0
    """The logits' width (the text config's ``vocab_size``)."""
    intermediate_size: int = 0
    """The MLP's intermediate width (the config's, else 4 x hidden)."""
    kv_width: int = 0
    """Key/value width of an attention layer: kv heads x head dim."""
    n_kv_heads: int = 0
    """Key/value heads."""
    mlp_intermediates: int = 0
    """Intermediate-wide tensors one layer's MLP saves a token: 4 gated, 2 otherwise."""
    mlp_matrices: int = 0
    """Hidden x intermediate matrices of one MLP: 3 gated, 2 otherwise."""


@dataclass(frozen=True)
class ModelStructure:
    """The model's parameters as :func:`model_structure` counts them on the meta device: what the tracer hands to
    :class:`~autofit.cost_model.facts.ModelFacts` beside the traced activations (a field of the same name there,
    but ``n_trainable``, ``param_bytes_fp32``, ``layer_period`` and ``sequence``)."""

    n_params: int
    """Elements of every parameter."""
    n_trainable: int
    """Elements of the trainable parameters."""
    param_bytes_fp32: int
    """Every parameter's bytes in fp32 (what a trace on real tensors would hold)."""
    n_layers: int
    """Repeated layers (:meth:`Workload.repeated_layers`)."""
    layer_period: int
    """Layers that repeat as one after the first :attr:`layer_prefix` (:func:`autofit.trace.layers.layer_pattern`)."""
    layer_params: tuple[int, ...]
    """Parameters of each repeated layer."""
    largest_module_params: int
    """Most parameters owned directly by one module."""
    largest_param_numel: int
    """Elements of the largest trainable tensor."""
    n_small_params: int
    """Elements in trainable tensors under 4096 elements (bitsandbytes' ``min_8bit_size``: 32-bit states)."""
    factored_state_numel: int
    """Adafactor's state elements (Shazeer & Stern 2018): a row and a column vector for a matrix, a full state
    otherwise."""
    n_param_tensors: int
    """Trainable tensors."""
    n_param_modules: int
    """Modules holding trainable parameters of their own (ZeRO-3 fetches and releases each one's in its hooks)."""
    n_persistent_params: int
    """Elements in tensors under ZeRO-3's persistence threshold for this model (:mod:`autofit.ds.buckets`): kept
    whole on every rank."""
    hidden_size: int
    """:func:`hidden_size_of` the model."""
    buffer_bytes: int
    """Module buffers' bytes."""
    fp8_weight_elements: int
    """``sum(in x out)`` over the Linear layers fp8 converts: the weights its casts read."""
    fp8_feature_elements: int
    """``sum(in + out)`` over the same layers: what its casts read per row of input (input and output gradient)."""
    fp8_largest_linear: tuple[int, int]
    """``(in, out)`` of the largest Linear fp8 converts; ``(0, 0)``: none."""
    sequence: SequenceStructure = field(default_factory=SequenceStructure)
    """A causal LM's long-context facts (:func:`sequence_structure`)."""
    adam_mini_state_numel: int = 0
    """Adam-mini's state elements, counted by its own step where a search has it (the tracer's ``_structure``)."""
    adam_mini_error: str = ""
    """Why Adam-mini's own step refused the model; empty where it stepped or was not asked."""
    layer_prefix: int = 0
    """Leading layers of their own before the repeating ones (:func:`autofit.trace.layers.layer_pattern`)."""


def model_structure(workload: Workload, model: Any = None) -> ModelStructure:
    """Parameter counts and shapes, from a model built on the meta device (no memory); ``model``: one built so
    already."""
    import torch

    if model is None:
        with torch.device("meta"):
            model = workload.build_model()
    params = [p for p in model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    layers = workload.repeated_layers(model)
    prefix, period = layer_pattern(layers)
    hidden = hidden_size_of(model)
    threshold = persistence_threshold(hidden)
    largest_module = 0
    for module in model.modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        largest_module = max(largest_module, own)
    linears = [m for _, m in fp8_linears(model)]
    return ModelStructure(
        n_params=sum(p.numel() for p in params),
        n_trainable=sum(p.numel() for p in trainable),
        param_bytes_fp32=4 * sum(p.numel() for p in params),
        n_layers=len(layers),
        layer_period=period,
        layer_params=tuple(sum(p.numel() for p in layer.parameters()) for layer in layers),
        largest_module_params=largest_module,
        largest_param_numel=max((p.numel() for p in trainable), default=0),
        n_small_params=sum(p.numel() for p in trainable if p.numel() < 4096),
        factored_state_numel=sum(
            (p.shape[-2] * 1 + p.shape[-1]) * (p.numel() // (p.shape[-2] * p.shape[-1])) if p.dim() >= 2 else p.numel()
            for p in trainable
        ),
        n_param_tensors=len(trainable),
        n_param_modules=sum(any(p.requires_grad for p in m.parameters(recurse=False)) for m in model.modules()),
        n_persistent_params=sum(p.numel() for p in params if p.numel() < threshold),
        hidden_size=hidden,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        fp8_weight_elements=sum(m.in_features * m.out_features for m in linears),
        fp8_feature_elements=sum(m.in_features + m.out_features for m in linears),
        fp8_largest_linear=max(((m.in_features, m.out_features) for m in linears), key=lambda d: d[0] * d[1],
                               default=(0, 0)),
        layer_prefix=prefix,
        sequence=sequence_structure(workload, model, hidden),
    )


def sequence_structure(workload: Workload, model: Any, hidden: int) -> SequenceStructure:
    """What the long-context pricing reads of a causal LM (:mod:`autofit.cost_model.long_context`): the traced length,
    the vocabulary, the MLP's width and kind, the kv width; all 0 for a workload without ``sequence``."""
    if workload.sequence is None or getattr(model, "config", None) is None:
        return SequenceStructure()
    text = model.config.get_text_config()
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    gated = any(hasattr(module, "gate_proj") for module in model.modules())
    return SequenceStructure(
        seq_len=workload.sequence.seq_len, vocab_size=int(text.vocab_size),
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        kv_width=workload.sequence.n_kv_heads * head_dim, n_kv_heads=workload.sequence.n_kv_heads,
        mlp_intermediates=4 if gated else 2, mlp_matrices=3 if gated else 2)


def hidden_size_of(model: Any) -> int:
    """The model's hidden size, as the Hugging Face integration finds it for its ``auto`` bucket sizes
    (transformers/integrations/deepspeed.py: ``config.hidden_size``, else ``max(config.hidden_sizes)``, also
    under ``config.text_config``); a model without such a config: the input width most of its Linear layers
    share (a transformer's residual width); 0 where it has no Linear layer."""
    import torch

    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        size = getattr(cfg, "hidden_size", None)
        if isinstance(size, int) and size > 0:
            return size
        sizes = getattr(cfg, "hidden_sizes", None)
        if sizes:
            return int(max(sizes))
    widths = Counter(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return max(widths, key=lambda w: (widths[w], w)) if widths else 0


def fp8_linears(model: Any) -> list[tuple[str, Any]]:
    """``(name, module)`` of the Linear layers fp8 training converts (:func:`autofit.ds.fp8.convertible_linear`)."""
    import torch


    return [
        (name, m) for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and convertible_linear(m.in_features, m.out_features)
    ]


def fp8_linear_flops(model: Any, counts: dict[str, Any]) -> int:
    """FLOPs of ``FlopCounterMode.get_flop_counts()`` spent inside the Linear layers fp8 converts.

    The counter keys a module as ``<root class>.<name>``; a Linear's matmuls (forward, both backward
    ones and a checkpointed recompute) are all counted under it.
    """
    root = type(model).__name__
    return int(sum(sum(counts.get(f"{root}.{name}", {}).values()) for name, _ in fp8_linears(model)))
