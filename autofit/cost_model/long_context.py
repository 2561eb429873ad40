"""What the long-context keys do to a step's memory and time: Ulysses sequence parallelism, TiledMLP, the tiled
logits and loss, and checkpointed inputs offloaded to the host. Pure, no torch.

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
* **The peak's two parts.** The trace records its peak in the head's segments (after the last layer's forward,
  before its backward: the final norm, the logits, the loss) and in the layers' (:mod:`autofit.trace.scaling`),
  each on top of what the layers saved. Per rank both are divided by p, less what the saved tensors lose
  (``saved_delta``: offloaded inputs, TiledMLP's unsaved intermediates), plus SP's second attention-output copy a
  layer; the head's with its tiled moment for its untiled one where the loss is tiled (:func:`head_moment_bytes`:
  the loss's backward ``12 t V``, or the lm_head's, whichever is larger), the layers' plus SP's exchange buffers and
  less what TiledMLP tiles of the layer being back-propagated (:func:`tiled_mlp_layer_saving`: its MLP's gradients,
  and a checkpointed layer's recomputed intermediates): ``peak' = max(head', layers')``. Where a trace has no
  parts (a script's profile) both are the whole peak: no technique is credited with what no trace showed.
* **TiledMLP** (``ulysses_sp.py:955-1076``) runs ``T = ceil((s/p) / h)`` tiles, its intermediates one tile at a
  time (``n_mlp (t / T) i w``) plus the ``x_grad`` it preallocates (``t h w``); an uncheckpointed layer saves only
  its input (already saved), so ``n_mlp t i w`` fewer a layer. Time: one more MLP forward a layer (docstring :959).
* **Tiled loss**: ``ceil(V / h)`` tiles (Liger's fused linear-cross-entropy chunking,
  liger_kernel/ops/fused_linear_cross_entropy.py: ``inc_factor = cdiv(V, H)`` chunks), so ``/ ceil(V/h)`` of the
  loss's moment, plus the hidden state's gradient ``SequenceTiledCompute`` preallocates (``t h w``) and the lm_head's
  weight gradient the tiles accumulate (:func:`head_moment_bytes`); time: the
  lm_head forward once more (``sequence_tiled_compute`` recomputes each tile in backward).
* **Activation offload** keeps ``max_fwd_stash_count + keep_last_count`` = 3 checkpointed inputs on the device
  (DeepSpeed's ``get_checkpoint_hidden_states_offloading_ctx_manager`` defaults) and ``n_ckpt t h w`` on the host;
  time: each input down and up over PCIe on a side stream, exposed where it outlasts the compute beside it.
* **SP communication**: per attention layer and pass, 4 all-to-alls of ``t w (2 h + 2 max(k, p) d)`` bytes, each
  rank sending ``(p - 1) / p`` of them (the Ulysses paper's ``M / P`` per link); passes: forward, backward and the
  recompute of a checkpointed layer. Within a node on NVLink; a group past one node sends ``(p - g) / p`` of its
  bytes over its network link. On the compute stream: not overlapped.
"""

from __future__ import annotations

from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.core.sequence import loss_tiles, mlp_tiles
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
    """What the untiled loss holds beyond the saved activations at its largest, cross-entropy's backward: ``12 t V``,
    three fp32 ``t x V`` tensors at once -- log-softmax's saved output, ``nll_loss_backward``'s gradient and
    ``_log_softmax_backward_data``'s result (aten's ``log_softmax`` saves its output, not its input; transformers'
    ``ForCausalLMLoss`` upcasts with ``logits.float()``, so all three are fp32 whatever the model computes in). Its
    forward holds less: the logits, their fp32 copy where they are not fp32 already, and log-softmax's output,
    ``(w + 4 + 4) t V`` at most. Measured on the traced 4-layer GQA Llama at 1,024 tokens: the head's backward 49.0
    MiB over the saved activations, ``12 t V`` = 48 MiB (V = 4,096, fp32)."""
    return 3 * FP32 * tokens_per_rank(config, facts) * facts.vocab_size


def head_moment_bytes(config: Config, facts: ModelFacts, tiled: bool) -> float:
    """The head's largest moment beyond the saved activations: the loss's backward (:func:`loss_moment_bytes`, L), or
    the lm_head's backward -- the logits' gradient ``t V w``, the weight's gradient as it arrives ``V h w`` and the
    hidden state's ``t h w`` -- whichever is larger (measured on the traced 4-layer GQA Llama, V = 4,096, h = 256:
    at 32 tokens the weight's gradient sets the head's peak, at 1,024 the loss).

    Tiled (``SequenceTiledCompute``, ``ceil(V / h)`` tiles): one tile's share of both, the hidden state's gradient
    its backward preallocates whole (``torch.zeros_like``, ``t h w``), and the weight's gradient accumulated in
    ``.grad`` from the second tile on (``ds_grad_is_ready`` False until the last tile, which ZeRO-2's and ZeRO-3's
    hooks honour: ``stage_1_and_2.py``, ``stage3.py``; nothing is moved out between tiles) beside each tile's
    arriving one: ``max(L / T + V h w, t V w / T + 2 V h w) + t h w``. Short sequences of a large vocabulary hold
    more tiled than not."""
    t, w, h, v = tokens_per_rank(config, facts), trace_bytes(config), facts.hidden_size, facts.vocab_size
    loss, logits_grad, weight_grad = loss_moment_bytes(config, facts), t * v * w, v * h * w
    if not tiled:
        return max(loss, logits_grad + weight_grad + t * h * w)
    tiles = loss_tiles(facts.vocab_size, facts.hidden_size)
    return max(loss / tiles + weight_grad, logits_grad / tiles + 2 * weight_grad) + t * h * w


def mlp_moment_bytes(config: Config, facts: ModelFacts, tiled: bool) -> float:
    """A layer's MLP intermediates, ``n_mlp t i w``; tiled, one of TiledMLP's tiles and the ``x_grad`` it preallocates
    (``t h w``)."""
    t, w = tokens_per_rank(config, facts), trace_bytes(config)
    mlp = facts.mlp_intermediates * t * facts.intermediate_size * w
    if not tiled:
        return mlp
    return mlp / mlp_tiles(facts.seq_len, config.sequence_parallel, facts.hidden_size) + t * facts.hidden_size * w


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


def long_context_activation_bytes(config: Config, facts: ModelFacts, traced_peak: float, head_peak: float = 0.0,
                                  body_peak: float = 0.0) -> float:
    """The traced activation peak (at the config's checkpoint ratio, micro-batch and the trace's whole sequence)
    as the long-context keys change it (module docstring); ``traced_peak`` itself where all are off.

    ``head_peak`` and ``body_peak``: the trace's peaks in the head's segments and in the layers'
    (:attr:`autofit.cost_model.facts.PeakPoint.head_peak_with_grads_bytes`); the tiled loss lowers the head's, the
    tiled MLP's recompute and SP's exchange buffers change the layers'. Not measured (0): both at the traced peak,
    so that neither technique is credited with what no trace showed."""
    if not facts.seq_len or not any_long_context(config):
        return traced_peak
    if not (head_peak and body_peak):
        head_peak = body_peak = traced_peak
    p, t = config.sequence_parallel, tokens_per_rank(config, facts)
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    held = (facts.n_layers - n_ckpt) * sp_saved_bytes(config, facts) - saved_delta_bytes(config, facts)
    head = head_peak / p + held
    if config.tiled_loss:
        head += head_moment_bytes(config, facts, True) - head_moment_bytes(config, facts, False)
    body = body_peak / p + held + sp_layer_bytes(config, facts)
    if config.tiled_mlp:
        body -= tiled_mlp_layer_saving(config, facts, n_ckpt > 0)
    kept = min(n_ckpt, OFFLOAD_DEVICE_INPUTS) if config.offload_activations != "none" else n_ckpt
    return max(head, body, kept * t * facts.hidden_size * trace_bytes(config))


def tiled_mlp_layer_saving(config: Config, facts: ModelFacts, checkpointed: bool) -> float:
    """What TiledMLP takes off the layer being back-propagated: its MLP's intermediates' gradients, which the untiled
    backward holds beside them -- each elementwise op's backward returns a gradient the size of what it saved (a
    gated MLP's ``mul`` two ``t x i`` at once, beside ``down_proj``'s), about ``n_mlp t i w`` -- and TiledMLP computes
    one tile at a time (``TiledMLP.backward`` runs each tile's forward and backward in turn, ``ulysses_sp.py``);
    and, for a checkpointed layer, the recomputed intermediates themselves, one tile at a time too
    (:func:`mlp_moment_bytes`). An uncheckpointed layer's saved intermediates are :func:`saved_delta_bytes`'."""
    untiled, tiled = mlp_moment_bytes(config, facts, False), mlp_moment_bytes(config, facts, True)
    gradients = untiled - untiled / mlp_tiles(facts.seq_len, config.sequence_parallel, facts.hidden_size)
    return gradients + (untiled - tiled if checkpointed else 0.0)


def saved_delta_bytes(config: Config, facts: ModelFacts) -> float:
    """What every moment after the layers' forwards holds less of their saved tensors: the checkpointed inputs past
    the device's three with activation offload (``(n_ckpt - 3) t h w``), and under TiledMLP each uncheckpointed
    layer's MLP intermediates, which it no longer saves (``n_full n_mlp t i w``; ``TiledMLP.forward`` saves only
    its input, the tensor the untiled ``gate_proj`` and ``up_proj`` saved already)."""
    t, w, h = tokens_per_rank(config, facts), trace_bytes(config), facts.hidden_size
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    delta = 0.0
    if config.offload_activations != "none":
        delta += max(0, n_ckpt - OFFLOAD_DEVICE_INPUTS) * t * h * w
    if config.tiled_mlp:
        delta += (facts.n_layers - n_ckpt) * mlp_moment_bytes(config, facts, False)
    return delta


def any_long_context(config: Config) -> bool:
    """Whether any long-context key is on (SP, TiledMLP, the tiled loss, activation offload)."""
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
