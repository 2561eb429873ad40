"""What the long-context keys do to a step's memory and time: Ulysses sequence parallelism, TiledMLP, the tiled
logits and loss, and checkpointed inputs offloaded to the host (issue 38). Pure, no torch.

Shapes come from the model's facts (:class:`autofit.cost_model.facts.ModelFacts`: ``seq_len`` s, ``hidden_size`` h,
``intermediate_size`` i, ``vocab_size`` V, ``kv_width`` = kv heads x head dim, the MLP's saved tensors), the
derivations and source lines from docs/develop/long-context.md ("Memory and time model"). Per rank, with SP degree
p, micro-batch b and trace-dtype bytes w, a rank holds ``t = b x s / p`` tokens:

* **SP** divides every traced activation by p: outside attention a rank holds its ``s/p`` tokens; inside it all s
  tokens of ``heads/p`` heads, the same bytes (Jacobs et al. 2023, arXiv 2309.14509 sec. 3). Added: the all-to-all
  buffers of the layer being run -- a contiguous input copy and an output for q, k, v and the attention output
  (``ulysses_sp.py:192-197``, ``deepspeed/sequence/layer.py:328``): ``2 t w (2 h + 2 max(k, p) d)`` -- and kv heads
  fewer than p replicated to p (``UlyssesSPAttentionHF``, :131-152): ``2 t (max(k, p) - k) d w`` more per layer
  that keeps its k and v; and the attention output twice, ``t h w`` more per layer that keeps it: the exchange back
  ends in a new tensor (``_partition_global_sequence``, :223-226, ``rearrange`` then ``reshape(...).contiguous()``),
  which the output projection saves for backward beside the core's own output, which SDPA saves for its backward;
  without SP the projection's input is a view of that output (transformers' ``sdpa_attention_forward``:
  ``transpose(1, 2).contiguous()`` of an output laid out ``[b, s, heads, d]`` copies nothing), one tensor.
  Measured on two CPU ranks (a 4-layer GQA Llama, 512 tokens a rank): 4 x 0.5 MiB of ``(s/p, b, p, h/p)`` copies live
  at the peak under SP, nothing of the kind without it. SP is ZeRO-3 only (:func:`autofit.core.rules.sp_needs_zero3`),
  whose traced peak holds no gradients, so the whole traced peak is activations.
* **The peak's two moments.** The traced peak is the larger of the loss and a checkpointed layer's recompute, on
  top of the saved layer inputs ``n_ckpt t h w``. The loss: at least the logits ``(w + 4 + 4) t V`` (the logits,
  ``ForCausalLMLoss``'s fp32 upcast ``logits.float()``, transformers/loss/loss_utils.py:61, none where w is fp32
  already, and cross-entropy's fp32 log-softmax); fully checkpointed, where it is the larger moment, the trace's
  own peak less the saved inputs. The layer: its saved-for-backward tensors, measured as the traces without and
  with checkpointing differ (``(full - ckpt) / L + t h w`` at the loss), at least its MLP's ``n_mlp t i w``
  intermediates (:attr:`ModelFacts.mlp_intermediates`), which TiledMLP replaces. A technique shrinks its moment;
  the peak moves by how much the larger moment shrinks:
  ``peak' = traced / p - saved_delta - (max(loss, layer) - max(loss', layer'))``.
* **TiledMLP** (``ulysses_sp.py:955-1076``) runs ``T = ceil((s/p) / h)`` tiles, its intermediates one tile at a
  time (``n_mlp (t / T) i w``) plus the ``x_grad`` it preallocates (``t h w``); an uncheckpointed layer saves only
  its input (already saved), so ``n_mlp t i w`` fewer a layer. Time: one more MLP forward a layer (docstring :959).
* **Tiled loss**: ``ceil(V / h)`` tiles (Liger's fused linear-cross-entropy chunking,
  liger_kernel/ops/fused_linear_cross_entropy.py: ``inc_factor = cdiv(V, H)`` chunks), so ``/ ceil(V/h)`` of the
  logits moment; time: the lm_head forward once more (``sequence_tiled_compute`` recomputes each tile in backward).
* **Activation offload** keeps ``max_fwd_stash_count + keep_last_count`` = 3 checkpointed inputs on the device
  (DeepSpeed's ``get_checkpoint_hidden_states_offloading_ctx_manager`` defaults) and ``n_ckpt t h w`` on the host;
  time: each input down and up over PCIe on a side stream, exposed where it outlasts the compute beside it.
* **SP communication**: per attention layer and pass, 4 all-to-alls of ``t w (2 h + 2 max(k, p) d)`` bytes, each
  rank sending ``(p - 1) / p`` of them (the Ulysses paper's ``M / P`` per link); passes: forward, backward and the
  recompute of a checkpointed layer. Within a node on NVLink; a group past one node sends ``(p - g) / p`` of its
  bytes over its network link. On the compute stream: not overlapped.
"""

from __future__ import annotations

from dataclasses import replace

from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.cost_model.facts import ModelFacts

FP32 = 4
#: checkpointed inputs DeepSpeed's checkpoint-offload keeps on the device: max_fwd_stash_count=2 + keep_last_count=1
OFFLOAD_DEVICE_INPUTS = 3


def trace_bytes(config: Config) -> int:
    """Bytes of a traced activation element: fp32 traces in fp32, the 16-bit precisions in bf16."""
    return FP32 if config.trace_dtype == "fp32" else 2


def tokens_per_rank(config: Config, facts: ModelFacts) -> float:
    """``t = b x s / p``: the tokens of one micro-batch a rank holds outside attention."""
    return config.micro_batch_size * facts.seq_len / config.sequence_parallel


def loss_moment_bytes(config: Config, facts: ModelFacts) -> float:
    """The logits moment: ``(w + 8) t V``, over ``ceil(V / h)`` tiles with ``tiled_loss``."""
    w = trace_bytes(config)
    upcast = FP32 if w < FP32 else 0  # logits.float() copies only what is not fp32 already
    whole = (w + upcast + FP32) * tokens_per_rank(config, facts) * facts.vocab_size
    return whole / loss_tiles(facts) if config.tiled_loss else whole


def loss_tiles(facts: ModelFacts) -> int:
    """Liger's chunk count ``ceil(V / h)`` (1 where a size is unknown)."""
    return max(1, -(-facts.vocab_size // facts.hidden_size)) if facts.hidden_size else 1


def mlp_tiles(config: Config, facts: ModelFacts) -> int:
    """DeepSpeed's TiledMLP tile count ``ceil((s/p) / h)``."""
    local = -(-facts.seq_len // config.sequence_parallel)
    return max(1, -(-local // facts.hidden_size)) if facts.hidden_size else 1


def layer_moment_bytes(config: Config, facts: ModelFacts) -> float:
    """A layer's recompute: its MLP intermediates (one tile's and TiledMLP's ``x_grad`` when tiled), the all-to-all
    buffers and the replicated kv heads under SP."""
    t, w = tokens_per_rank(config, facts), trace_bytes(config)
    mlp = facts.mlp_intermediates * t * facts.intermediate_size * w
    if config.tiled_mlp:
        mlp = mlp / mlp_tiles(config, facts) + t * facts.hidden_size * w
    return mlp + sp_layer_bytes(config, facts)


def sp_layer_bytes(config: Config, facts: ModelFacts) -> float:
    """Under SP: the all-to-all copies and outputs of one layer (``2 t w (2 h + 2 max(k, p) d)``) and what it keeps
    for backward beyond the traced layer (:func:`sp_saved_bytes`); 0 without SP."""
    p = config.sequence_parallel
    if p == 1:
        return 0.0
    return 2 * exchanged_bytes(config, facts) + sp_saved_bytes(config, facts)


def sp_saved_bytes(config: Config, facts: ModelFacts) -> float:
    """What one layer saves for backward under SP beyond its traced tensors divided by p: its kv heads replicated to
    p (``2 t (max(k, p) - k) d w``) and the attention output's second copy (``t h w``, the exchange back's
    contiguous output that the output projection saves beside the core's own, module docstring); 0 without SP."""
    if config.sequence_parallel == 1:
        return 0.0
    output_copy = tokens_per_rank(config, facts) * facts.hidden_size * trace_bytes(config)
    return replicated_kv_bytes(config, facts) + output_copy


def exchanged_bytes(config: Config, facts: ModelFacts) -> float:
    """Bytes one layer's q, k, v and output hold on a rank around the all-to-alls: ``t w (2 h + 2 max(k, p) d)``."""
    return tokens_per_rank(config, facts) * trace_bytes(config) * (2 * facts.hidden_size + 2 * kv_width_sp(config, facts))


def kv_width_sp(config: Config, facts: ModelFacts) -> float:
    """``max(k, p) x d``: kv heads fewer than p are replicated to p before the exchange."""
    n_kv = facts.n_kv_heads or 1
    return max(n_kv, config.sequence_parallel) * facts.kv_width / n_kv


def replicated_kv_bytes(config: Config, facts: ModelFacts) -> float:
    return 2 * tokens_per_rank(config, facts) * (kv_width_sp(config, facts) - facts.kv_width) * trace_bytes(config)


def long_context_activation_bytes(config: Config, facts: ModelFacts, traced_peak: float) -> float:
    """The traced activation peak (at the config's checkpoint ratio, micro-batch and the trace's whole sequence)
    as the long-context keys change it (module docstring); ``traced_peak`` itself where all are off."""
    if not facts.seq_len or not _any_on(config):
        return traced_peak
    t, w, h = tokens_per_rank(config, facts), trace_bytes(config), facts.hidden_size
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    n_full = facts.n_layers - n_ckpt
    peak = traced_peak / config.sequence_parallel
    saved = n_ckpt * t * h * w
    mlp = facts.mlp_intermediates * t * facts.intermediate_size * w
    layer = max(mlp, traced_layer_bytes(config, facts))  # one layer's saved tensors, what its recompute holds
    loss = loss_moment_bytes(replace(config, tiled_loss=False), facts)
    if n_full == 0 and peak - saved > max(loss, layer):
        loss = peak - saved  # fully checkpointed and the loss the larger moment: the trace measured it
    before = max(loss, layer)
    tiled_mlp = (mlp / mlp_tiles(config, facts) + t * h * w) if config.tiled_mlp else mlp
    after = max(loss / loss_tiles(facts) if config.tiled_loss else loss,
                layer - mlp + tiled_mlp + sp_layer_bytes(config, facts))
    saved_delta = 0.0
    if config.offload_activations != "none":
        saved_delta += max(0, n_ckpt - OFFLOAD_DEVICE_INPUTS) * t * h * w
    if config.tiled_mlp:
        saved_delta += n_full * (mlp - t * h * w)
    peak = peak - saved_delta - (before - after) + n_full * sp_saved_bytes(config, facts)
    kept = min(n_ckpt, OFFLOAD_DEVICE_INPUTS) if config.offload_activations != "none" else n_ckpt
    return max(peak, kept * t * h * w)


def traced_layer_bytes(config: Config, facts: ModelFacts) -> float:
    """One layer's saved-for-backward bytes on a rank, measured: the traces without and with every layer checkpointed
    differ by ``L x (layer - its input)`` at the loss (``activation_bytes``); 0 where either trace is missing."""
    try:
        full = facts.profile(config.trace_dtype, config.attention, False)
        ckpt = facts.profile(config.trace_dtype, config.attention, True)
    except KeyError:
        return 0.0
    if not facts.n_layers:
        return 0.0
    b = config.micro_batch_size
    per_layer = (full.at(b, "activation_bytes") - ckpt.at(b, "activation_bytes")) / facts.n_layers
    return max(0.0, per_layer / config.sequence_parallel + tokens_per_rank(config, facts) * facts.hidden_size
               * trace_bytes(config))


def _any_on(config: Config) -> bool:
    return (config.sequence_parallel > 1 or config.tiled_mlp or config.tiled_loss
            or config.offload_activations != "none")


def offloaded_activation_bytes(config: Config, facts: ModelFacts) -> float:
    """Host bytes one rank keeps of its checkpointed inputs: ``n_ckpt t h w`` (0 without activation offload)."""
    if config.offload_activations == "none" or not facts.seq_len:
        return 0.0
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    return n_ckpt * tokens_per_rank(config, facts) * facts.hidden_size * trace_bytes(config)


def extra_flops(config: Config, facts: ModelFacts) -> float:
    """FLOPs one micro-batch adds on a rank: TiledMLP's MLP forward once more a layer (``2 t h i m``, m the MLP's
    matrices) and the tiled loss's lm_head forward once more (``2 t h V``)."""
    t = tokens_per_rank(config, facts)
    flops = 0.0
    if config.tiled_mlp:
        flops += facts.n_layers * 2 * t * facts.hidden_size * facts.intermediate_size * facts.mlp_matrices
    if config.tiled_loss:
        flops += 2 * t * facts.hidden_size * facts.vocab_size
    return flops


def sp_all_to_all_s(config: Config, facts: ModelFacts, hardware: Hardware, world_size: int,
                    efficiency: float = 1.0) -> float:
    """Seconds of one micro-batch's Ulysses all-to-alls on a rank (module docstring); 0 without SP."""
    p = config.sequence_parallel
    if p == 1 or not facts.seq_len:
        return 0.0
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    passes = 2 * facts.n_layers + n_ckpt  # forward and backward of every layer, the recompute of a checkpointed one
    sent = passes * exchanged_bytes(config, facts)  # the 4 exchanges of a pass together
    g = min(p, hardware.ranks_on_a_node(world_size))
    seconds = 0.0
    if g > 1 and hardware.intra_node_bytes_per_s > 0:
        seconds += (g - 1) / p * sent / (hardware.intra_node_bytes_per_s * efficiency)
    if p > g and hardware.inter_node_bytes_per_s > 0:
        seconds += (p - g) / p * sent / (hardware.inter_node_bytes_per_s * efficiency)
    return seconds


def activation_offload_s(config: Config, facts: ModelFacts, hardware: Hardware, micro_compute_s: float,
                         efficiency: float = 1.0) -> float:
    """Seconds one micro-batch waits for its offloaded inputs: each down and up over PCIe on a side stream, exposed
    where the transfers outlast the micro-batch's compute."""
    moved = 2 * offloaded_activation_bytes(config, facts)
    if not moved or hardware.pcie_bytes_per_s <= 0:
        return 0.0
    return max(0.0, moved / (hardware.pcie_bytes_per_s * efficiency) - micro_compute_s)
