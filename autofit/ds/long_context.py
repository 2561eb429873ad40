"""Apply the long-context keys of a DeepSpeed JSON's ``"autofit"`` section to a Hugging Face causal LM and its steps.

``sequence_parallel``, ``tiled_mlp``, ``tiled_loss`` and ``offload_activations`` (docs/design.md, "Config keys"),
with DeepSpeed 0.19.8's own pieces (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``; the research and the CPU
prototype: docs/develop/long-context.md, docs/develop/long_context/sp2_tiny.py). A training script::

    ds = json.load(open("ds_config.json"))
    with build_context(ds):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    apply_to_model(model, ds, model.model.layers)    # checkpointing, TiledMLP, the tiled logits+loss
    mpu = sequence_parallel_mpu(model, ds)           # Ulysses attention registered; None where sp = 1
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds, mpu=mpu)
    for batch in loader:                             # every rank of an SP group draws the same batch
        shard = shard_batch(batch, mpu)              # this rank's seq/sp tokens, shifted labels, position_ids
        with activation_offload_context(ds):         # forward and backward inside it
            loss = causal_lm_loss(engine, shard, ds, mpu)
            engine.backward(loss)
        engine.step()

* **SP** (:func:`sequence_parallel_mpu`): ``UlyssesSPAttentionHF.register_with_transformers`` with the model's own
  ``attn_implementation`` (sdpa/flash; eager refused by DeepSpeed), which builds the SP groups
  (``parallel_state_sp``) and returns them as the ``mpu`` for ``deepspeed.initialize``. Its
  ``UlyssesSPDataLoaderAdapter`` shards a DataLoader; :func:`shard_batch` does the same to one batch.
* **The SP loss** (:func:`causal_lm_loss`): each rank's loss over its shard, aggregated over the SP group weighted
  by good tokens with ``torch.distributed.nn.functional.all_gather`` (as the DeepSpeed tutorial, accelerate and the
  Trainer do). Finding 1: that all_gather's backward sums every rank's copy, so each rank's gradient is ``sp x`` its
  share, which only ZeRO-3's reduce (dividing by the whole world) cancels; under ZeRO 0-2 the gradient is divided by
  ``sp`` here, the loss's value kept (the rules allow SP with ZeRO-3 only, :func:`autofit.core.rules.sp_needs_zero3`).
* **tiled_mlp** (:func:`apply_tiled_mlp`): each layer's MLP runs under ``TiledMLP`` in ``ceil(tokens / hidden)``
  tiles (max over the ranks, which must agree under ZeRO-3).
* **tiled_loss** (:func:`apply_tiled_loss`): the causal LM's forward computes, when given labels, its logits and
  cross-entropy with ``sequence_tiled_compute`` in ``ceil(vocab / hidden)`` tiles (reduction ``sum``, unshard
  dimension 0), inside the model's forward, so DeepSpeed's engine sees the loss as its output. Finding 2: not
  ``TiledFusedLogitsLoss``, whose lm_head gradient ignores any scale applied to the loss after it.
* **offload_activations** (:func:`activation_offload_context`): DeepSpeed's
  ``get_checkpoint_hidden_states_offloading_ctx_manager``, which keeps the checkpointed layers' inputs on the host
  between forward and backward. On the CPU accelerator it offloads nothing (``_ActivationOffloadEngine._should_skip``:
  host and device are one), which is why the rules refuse it there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autofit.core.errors import AutofitError
from autofit.core.sequence import loss_tiles, mlp_tiles

#: attribute set on an MLP whose forward runs under TiledMLP, and on a model whose loss is tiled
TILED_ATTR = "_autofit_tiled"
IGNORE_INDEX = -100


@dataclass(frozen=True)
class LongContext:
    """The long-context keys of one DeepSpeed JSON's ``"autofit"`` section."""

    sequence_parallel: int = 1
    tiled_mlp: bool = False
    tiled_loss: bool = False
    offload_activations: str = "none"
    zero_stage: int = 0

    @classmethod
    def of(cls, ds: Mapping[str, Any]) -> LongContext:
        section = ds.get("autofit") or {}
        return cls(sequence_parallel=int(section.get("sequence_parallel", 1) or 1),
                   tiled_mlp=bool(section.get("tiled_mlp", False)), tiled_loss=bool(section.get("tiled_loss", False)),
                   offload_activations=str(section.get("offload_activations", "none")),
                   zero_stage=int((ds.get("zero_optimization") or {}).get("stage", 0)))

    @property
    def own_loss(self) -> bool:
        """Whether the loss is :func:`causal_lm_loss`'s (SP shards it) rather than the workload's."""
        return self.sequence_parallel > 1


def apply_long_context(model: Any, ds: Mapping[str, Any], layers: Sequence[Any]) -> None:
    """The model-side keys, before ``deepspeed.initialize``: TiledMLP on each layer's MLP, the tiled loss."""
    keys = LongContext.of(ds)
    if keys.tiled_mlp:
        apply_tiled_mlp(layers)
    if keys.tiled_loss:
        apply_tiled_loss(model)


def sequence_parallel_mpu(model: Any, ds: Mapping[str, Any]) -> Any | None:
    """Register DeepSpeed's Ulysses attention for the model's attention implementation and build the SP groups;
    the ``mpu`` to pass ``deepspeed.initialize`` (None where the JSON's ``sequence_parallel`` is 1). Starts
    ``torch.distributed`` if needed (``deepspeed.init_distributed``); call it once per process, after the model is
    built and before ``deepspeed.initialize``. It replaces the implementation's entry in transformers'
    ``ALL_ATTENTION_FUNCTIONS`` for the whole process."""
    sp = LongContext.of(ds).sequence_parallel
    if sp == 1:
        return None
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed()
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if config is None or implementation is None:
        raise AutofitError("sequence_parallel needs a Hugging Face model (its config names the attention DeepSpeed's "
                           "Ulysses wraps)")
    try:
        return UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=implementation, sequence_parallel_size=sp,
            micro_batch_size=int(ds.get("train_micro_batch_size_per_gpu", 1)), seq_length_is_variable=True)
    except (ValueError, RuntimeError) as exc:  # heads not divisible, eager attention, world not divisible
        raise AutofitError(f"sequence_parallel {sp}: {str(exc).strip().splitlines()[0]}") from exc


def sp_rank_and_size(mpu: Any | None) -> tuple[int, int]:
    """This rank's place in its SP group and the group's size; (0, 1) without SP."""
    if mpu is None:
        return 0, 1
    return int(mpu.get_sequence_parallel_rank()), int(mpu.get_sequence_parallel_world_size())


def shard_batch(batch: Mapping[str, Any], mpu: Any | None) -> dict[str, Any]:
    """This rank's share of a causal-LM batch under SP, as ``UlyssesSPDataLoaderAdapter`` makes it: the batch is
    first made the SP group's (its first rank's tokens, broadcast), then ``input_ids``, ``position_ids`` and the
    pre-shifted ``shift_labels`` (pad -100; also passed as ``labels``) are cut to ``seq/sp`` tokens on dim 1. An
    ``attention_mask`` is dropped (Ulysses drops any mask; sdpa runs causal). Without SP: the batch as is."""
    import torch
    import torch.nn.functional as F

    rank, sp = sp_rank_and_size(mpu)
    if sp == 1:
        return dict(batch)
    input_ids = batch["input_ids"]
    labels = batch.get("shift_labels")
    if labels is None:
        labels = F.pad(batch.get("labels", input_ids), (0, 1), value=IGNORE_INDEX)[..., 1:]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    seq = input_ids.shape[1]
    if seq % sp:
        raise AutofitError(f"sequence_parallel {sp} does not divide the batch's sequence length {seq} (pad it to a "
                           f"multiple: a collator's pad_to_multiple_of={sp})")
    group_tensors = _same_in_group([input_ids, labels, positions.contiguous()], mpu)
    local = seq // sp
    input_ids, labels, positions = (t[:, rank * local:(rank + 1) * local].contiguous() for t in group_tensors)
    return {"input_ids": input_ids, "position_ids": positions, "labels": labels, "shift_labels": labels}


def _same_in_group(tensors: list[Any], mpu: Any) -> list[Any]:
    """The SP group's first rank's tensors on every rank of the group (a broadcast over the group)."""
    import torch.distributed as dist

    group = mpu.get_sequence_parallel_group()
    source = dist.get_global_rank(group, 0)
    out = [t.clone() for t in tensors]
    for tensor in out:
        dist.broadcast(tensor, src=source, group=group)
    return out


def causal_lm_loss(engine: Any, shard: Mapping[str, Any], ds: Mapping[str, Any], mpu: Any | None) -> Any:
    """The loss of one micro-batch: the model's own loss over this rank's shard (:func:`shard_batch`), aggregated
    over the SP group weighted by its good tokens (the Trainer's ``deepspeed_sp_compute_loss``); with the ``/sp``
    gradient correction under ZeRO 0-2 (Finding 1, module docstring). Without SP: the model's loss."""
    inputs = {key: shard[key] for key in ("input_ids", "position_ids", "labels", "shift_labels") if key in shard}
    loss = engine(**inputs, use_cache=False).loss
    rank, sp = sp_rank_and_size(mpu)
    if sp == 1 or mpu is None:
        return loss
    import torch
    from torch.distributed.nn.functional import all_gather

    group = mpu.get_sequence_parallel_group()
    good = (shard["shift_labels"] != IGNORE_INDEX).sum()
    losses = torch.stack(all_gather(loss, group=group))
    goods = torch.stack(all_gather(good, group=group))
    safe = torch.where(goods > 0, losses, torch.zeros_like(losses))
    total = (safe * goods).sum() / goods.sum().clamp(min=1)
    if LongContext.of(ds).zero_stage < 3:  # the gradient / sp, the value kept
        total = total.detach() + (total - total.detach()) / sp
    return total


def apply_tiled_mlp(layers: Sequence[Any]) -> int:
    """Run each layer's MLP (its ``mlp`` or ``feed_forward``) under DeepSpeed's ``TiledMLP``; returns how many. A layer
    without one is an error: the config would claim a saving it cannot make."""
    count = 0
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None)
        if mlp is None:
            raise AutofitError(f"tiled_mlp: repeated layer {index} ({type(layer).__name__}) has no mlp/feed_forward")
        if not getattr(mlp, TILED_ATTR, False):
            mlp.forward = _tiled_mlp_forward(mlp, mlp.forward)
            setattr(mlp, TILED_ATTR, True)
        count += 1
    return count


def _tiled_mlp_forward(mlp: Any, inner: Any) -> Any:
    @functools.wraps(inner)
    def forward(x: Any) -> Any:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        params = [p for p in mlp.parameters() if p.requires_grad]
        return TiledMLP.apply(lambda _self, tile: inner(tile), mlp, x, agreed_tiles(x.shape[-2], x.shape[-1]), params)

    return forward


def agreed_tiles(tokens: int, hidden: int) -> int:
    """``ceil(tokens / hidden)`` (DeepSpeed's rule, ``TiledMLP``'s docstring), the largest over the ranks: under ZeRO-3
    every rank must call the MLP's modules as often."""
    import torch
    import torch.distributed as dist

    tiles = mlp_tiles(int(tokens), 1, int(hidden))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        agreed = torch.tensor(tiles)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        tiles = int(agreed.item())
    return tiles


def apply_tiled_loss(model: Any) -> None:
    """Make the causal LM's forward compute its loss in sequence tiles when it is given ``labels`` (or
    ``shift_labels``): the decoder's last hidden state, then ``lm_head`` and cross-entropy one tile at a time with
    ``sequence_tiled_compute`` (each recomputed in backward), so the ``seq x vocab`` logits never exist whole. It
    returns ``CausalLMOutputWithPast(loss=...)`` (the mean over the rank's good tokens, as the model's own loss;
    no logits). Without labels, the model's own forward. Models that scale or cap their logits are refused."""
    if getattr(model, TILED_ATTR, False):
        return
    config = model.config.get_text_config()
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise AutofitError(f"tiled_loss: {type(model).__name__} transforms its logits ({name}); not tiled")
    # the same on every rank whatever its length (ZeRO-3 gathers the lm_head once a tile)
    shards = loss_tiles(int(config.vocab_size), int(config.hidden_size))
    model.forward = _tiled_loss_forward(model, model.forward, shards)
    setattr(model, TILED_ATTR, True)


def _tiled_loss_forward(model: Any, inner: Any, shards: int) -> Any:
    @functools.wraps(inner)
    def forward(input_ids: Any = None, labels: Any = None, shift_labels: Any = None, **kwargs: Any) -> Any:
        if labels is None and shift_labels is None:
            return inner(input_ids=input_ids, **kwargs)
        import torch.nn.functional as F
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        kwargs.pop("logits_to_keep", None)
        hidden = model.base_model(input_ids=input_ids, **kwargs).last_hidden_state
        total = tiled_cross_entropy(hidden, shift_labels, model.get_output_embeddings(), shards)
        good = (shift_labels != IGNORE_INDEX).sum().clamp(min=1)
        return CausalLMOutputWithPast(loss=total / good)

    return forward


def tiled_cross_entropy(hidden: Any, shift_labels: Any, head: Any, shards: int) -> Any:
    """The summed cross-entropy of ``head(hidden)`` against ``shift_labels``, ``shards`` sequence tiles at a time
    (``sequence_tiled_compute``, output reduction ``sum`` on dim 0: backward recomputes each tile and receives the
    true incoming gradient, Finding 2)."""
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    def tile_loss(hidden_states: Any = None, shift_labels: Any = None, head: Any = None) -> Any:
        logits = head(hidden_states).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    return sequence_tiled_compute(tile_loss, hidden.shape[1], shards,
                                  {"hidden_states": hidden, "shift_labels": shift_labels}, {"head": head},
                                  "hidden_states", [head.weight], output_unshard_dimension=0, output_reduction="sum")


def activation_offload_context(ds: Mapping[str, Any]) -> Any:
    """The context forward and backward run in: DeepSpeed's checkpoint-offload of the checkpointed layers' inputs
    where the JSON says ``offload_activations: cpu`` (a no-op on the CPU accelerator), else a null context."""
    if LongContext.of(ds).offload_activations == "none":
        return contextlib.nullcontext()
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )

    return get_checkpoint_hidden_states_offloading_ctx_manager()
