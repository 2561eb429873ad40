"""The model's parameters as built on the meta device: counts, shapes, and what optimizers keep per tensor.

What :mod:`autofit.trace` records beside the traced activations (:class:`autofit.cost_model.facts.ModelFacts`):
no forward runs here, so nothing costs memory.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from autofit.ds.buckets import persistence_threshold
from autofit.ds.fp8 import convertible_linear
from autofit.trace.layers import layer_period
from autofit.workload.types import Workload


def model_structure(workload: Workload, model: Any = None) -> dict[str, Any]:
    """Parameter counts and shapes, from a model built on the meta device (no memory); ``model``: one built so
    already."""
    import torch

    if model is None:
        with torch.device("meta"):
            model = workload.build_model()
    params = [p for p in model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    layers = workload.repeated_layers(model)
    hidden = hidden_size_of(model)
    threshold = persistence_threshold(hidden)
    largest_module = 0
    for module in model.modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        largest_module = max(largest_module, own)
    return {
        "n_params": sum(p.numel() for p in params),
        "n_trainable": sum(p.numel() for p in trainable),
        "param_bytes_fp32": 4 * sum(p.numel() for p in params),
        "n_layers": len(layers),
        "layer_period": layer_period(layers),
        "layer_params": [sum(p.numel() for p in layer.parameters()) for layer in layers],
        "largest_module_params": largest_module,
        "largest_param_numel": max((p.numel() for p in trainable), default=0),
        # bitsandbytes keeps 32-bit states for tensors under min_8bit_size=4096 elements
        "n_small_params": sum(p.numel() for p in trainable if p.numel() < 4096),
        # Adafactor (Shazeer & Stern 2018): a row and a column vector for matrices, a full state otherwise
        "factored_state_numel": sum(
            (p.shape[-2] * 1 + p.shape[-1]) * (p.numel() // (p.shape[-2] * p.shape[-1])) if p.dim() >= 2 else p.numel()
            for p in trainable
        ),
        "n_param_tensors": len(trainable),
        # modules holding trainable parameters of their own: ZeRO-3 fetches and releases each one's in its hooks
        "n_param_modules": sum(any(p.requires_grad for p in m.parameters(recurse=False)) for m in model.modules()),
        # ZeRO-3 keeps parameters under stage3_param_persistence_threshold whole on every rank (the threshold
        # autofit writes for this model: autofit.ds.buckets)
        "n_persistent_params": sum(p.numel() for p in params if p.numel() < threshold),
        "hidden_size": hidden,
        **sequence_structure(workload, model, hidden),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        # what fp8's casts move (autofit.cost_model.fp8.fp8_cast_traffic_bytes): each converted weight, and per
        # row of input the input's and the output gradient's features
        "fp8_weight_elements": sum(m.in_features * m.out_features for _, m in fp8_linears(model)),
        "fp8_feature_elements": sum(m.in_features + m.out_features for _, m in fp8_linears(model)),
        "fp8_largest_linear": max(
            ((m.in_features, m.out_features) for _, m in fp8_linears(model)), key=lambda d: d[0] * d[1], default=(0, 0)
        ),
    }


def sequence_structure(workload: Workload, model: Any, hidden: int) -> dict[str, int]:
    """What the long-context pricing reads of a causal LM (:mod:`autofit.cost_model.long_context`): the traced length,
    the vocabulary, the MLP's width and kind, the kv width; empty for a workload without ``sequence``."""
    if workload.sequence is None or getattr(model, "config", None) is None:
        return {}
    text = model.config.get_text_config()
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    gated = any(hasattr(module, "gate_proj") for module in model.modules())
    return {"seq_len": workload.sequence.seq_len, "vocab_size": int(text.vocab_size),
            "intermediate_size": int(getattr(text, "intermediate_size", None) or 4 * hidden),
            "kv_width": workload.sequence.n_kv_heads * head_dim, "n_kv_heads": workload.sequence.n_kv_heads,
            "mlp_intermediates": 4 if gated else 2, "mlp_matrices": 3 if gated else 2}


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
