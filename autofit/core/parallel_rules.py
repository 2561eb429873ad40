"""The rules of model parallelism and of where ZeRO-3's parameters live: DeepSpeed AutoTP (``tensor_parallel``),
ZeRO++'s hierarchical partitioning (``hpz_partition_size``) and its quantized communication (``quantized_weights``,
``quantized_gradients``). Small pure checks as in :mod:`autofit.core.rules`, which
lists them in ``RULES``; each reason names the DeepSpeed source that decides it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autofit.core.rules import Context

_TP_SOURCE = "deepspeed/runtime/engine.py, _configure_tensor_parallel"
#: the tp_plan styles DeepSpeed converts (``SUPPORTED_STYLES``, ``deepspeed/module_inject/tp_plan_converter.py``), less
#: ``embedding_rowwise``: a vocabulary-parallel embedding, head and loss, which autofit does not plan
TP_STYLES = frozenset({"colwise", "colwise_rep", "colwise_gather_output", "rowwise", "replicated_with_grad_allreduce"})


def tp_within_a_node(ctx: Context, tensor_parallel: int) -> str | None:
    # AutoTP's groups are tp consecutive ranks (deepspeed/utils/groups.py, _init_tp_mesh_device: mesh (dp, tp)); every
    # layer all-reduces in each of them twice in forward and once a column Linear in backward, which autofit keeps on
    # a node's links
    if tensor_parallel == 1:
        return None
    per_node = ctx.hardware.ranks_on_a_node(ctx.world_size)
    if per_node == 1:
        return "tensor parallelism splits each layer over ranks; on one rank a node there is nothing to split it with"
    if per_node % tensor_parallel:
        return (f"tensor_parallel {tensor_parallel} does not divide the {per_node} ranks of a node (a TP group's "
                "all-reduces, several a layer, stay on a node's links)")
    return None


def tp_divides_world(ctx: Context, tensor_parallel: int, sequence_parallel: int) -> str | None:
    if tensor_parallel == 1 or ctx.world_size % (tensor_parallel * sequence_parallel) == 0:
        return None
    return (f"tensor_parallel {tensor_parallel} x sequence_parallel {sequence_parallel} does not divide the world size "
            f"{ctx.world_size}")


def tp_needs_a_plan(ctx: Context, tensor_parallel: int) -> str | None:
    # the engine shards by a JSON partition_config, else the model's HF tp_plan, else AutoTP's name heuristic
    # (engine.py, _configure_tensor_parallel); autofit traces the plan's split (autofit/trace/tensor_parallel.py)
    shape = ctx.sequence
    if tensor_parallel == 1:
        return None
    if shape is None or not shape.tp_styles:
        return "tensor parallelism needs an hf: causal LM whose class states a tp_plan (the Linear layers AutoTP splits)"
    unconverted = sorted(set(shape.tp_styles) - TP_STYLES - {"embedding_rowwise"})
    if unconverted:
        return (f"the model's tp_plan has the partition style {unconverted[0]!r}, which DeepSpeed's AutoTP does not "
                "convert: it refuses the whole plan (deepspeed/module_inject/tp_plan_converter.py, SUPPORTED_STYLES)")
    if "embedding_rowwise" in shape.tp_styles:
        return ("the model's tp_plan shards its embedding by vocabulary (embedding_rowwise), with a vocabulary-parallel "
                "loss autofit does not plan")
    return None


def tp_needs_an_untied_head(ctx: Context, tensor_parallel: int) -> str | None:
    # a head tied to the embedding is vocabulary-sharded jointly with it and trains with a vocabulary-parallel loss
    # (engine.py, the tied-head branch of _configure_tensor_parallel), which autofit has not traced or run
    if tensor_parallel == 1 or ctx.sequence is None or not ctx.sequence.tied_head:
        return None
    return ("the model's head is tied to its embedding: AutoTP shards them jointly with a vocabulary-parallel loss, "
            "which autofit does not plan")


def tp_divides_widths(ctx: Context, tensor_parallel: int) -> str | None:
    # each column Linear's outputs and each row Linear's inputs split in tp equal shards: whole heads and kv heads a
    # rank (more ranks than kv heads leave ranks without attention: engine.py's warning), the MLP's width, the head's
    # vocabulary
    shape = ctx.sequence
    if tensor_parallel == 1 or shape is None:
        return None
    widths = {"attention heads": shape.n_heads, "key/value heads": shape.n_kv_heads,
              "MLP intermediate width": shape.intermediate_size, "vocabulary": shape.vocab_size}
    for what, width in widths.items():
        if width and width % tensor_parallel:
            return f"tensor_parallel {tensor_parallel} does not divide the model's {width} {what} ({_TP_SOURCE})"
    return None


def tp_without_long_context(ctx: Context, tensor_parallel: int, sequence_parallel: int, tiled_mlp: bool,
                            tiled_loss: bool, offload_activations: str) -> str | None:
    # Ulysses SP, TiledMLP, the tiled loss and the checkpoint offload each wrap modules AutoTP replaces (the attention,
    # the MLP, the gathered head) or the checkpointed inputs beside its collectives: not run together here
    if tensor_parallel == 1 or (sequence_parallel == 1 and not tiled_mlp and not tiled_loss
                                and offload_activations == "none"):
        return None
    return ("AutoTP beside the long-context keys (sequence_parallel, tiled_mlp, tiled_loss, offload_activations) is not "
            "planned by autofit: tensor parallelism alone, or them without it")


def tp_not_compiled(ctx: Context, tensor_parallel: int, compile: str) -> str | None:
    if tensor_parallel == 1 or compile == "off":
        return None
    return ("torch.compile over AutoTP's layers (DeepSpeed's engine.compile() of LinearLayer and LinearAllreduce) is "
            "not run by autofit: compile off")


_HPZ_SOURCE = "deepspeed/utils/groups.py, _create_zero_param_parallel_group"
#: why hpZ cannot run on one node (the rule's reason, and the space's where it fixes hpZ off there)
HPZ_ON_ONE_NODE = ("hpZ keeps a secondary partition within each node so that gathers stay off the network; on one node "
                   "there is no network to keep them off (the world is one node)")
#: why a model without a ``tp_plan`` keeps ``tensor_parallel`` at 1 (the space's, where it fixes TP off)
NO_TP_PLAN = ("it needs an hf: causal LM whose class states a tp_plan (the layers DeepSpeed's AutoTP splits); the workload "
              "states none")


def hpz_needs_zero3(ctx: Context, hpz_partition_size: int, zero_stage: int) -> str | None:
    # the engine hands zero_hpz_partition_size to ZeRO-3's optimizer and zero.Init only (engine.py, the
    # ZeroStageEnum.weights branch of _configure_zero_optimizer); ZeRO 1/2 gather no parameters
    if hpz_partition_size == 1 or zero_stage == 3:
        return None
    return f"hpz_partition_size is ZeRO-3's (a secondary partition of the parameters it gathers): ZeRO-{zero_stage} has none"


def hpz_is_a_node(ctx: Context, hpz_partition_size: int) -> str | None:
    # DeepSpeed groups hpz consecutive global ranks (_HPZ_SOURCE): a group past a node gathers over the network again,
    # and one smaller than a node keeps node / hpz more of the parameters a rank for gathers on the same links
    if hpz_partition_size == 1:
        return None
    per_node = ctx.hardware.ranks_on_a_node(ctx.world_size)
    if ctx.hardware.n_nodes(ctx.world_size) == 1:
        return HPZ_ON_ONE_NODE
    if hpz_partition_size != per_node:
        return (f"hpz_partition_size {hpz_partition_size} is not the {per_node} ranks of a node: autofit plans hpZ's "
                f"secondary partition over one node, ZeRO++'s setting ({_HPZ_SOURCE} groups consecutive ranks)")
    return None


def hpz_without_model_parallel(ctx: Context, hpz_partition_size: int, tensor_parallel: int,
                               sequence_parallel: int) -> str | None:
    # hpZ's groups are consecutive global ranks (_HPZ_SOURCE), but under AutoTP a ZeRO partition group is every tp-th
    # rank (engine.py, _resolve_zero3_param_placement): a group of consecutive ranks holds different shards
    if hpz_partition_size == 1:
        return None
    if tensor_parallel > 1:
        return (f"hpZ's groups are consecutive ranks ({_HPZ_SOURCE}), which under AutoTP hold different shards of a "
                "layer: hpz_partition_size 1 with tensor_parallel")
    if sequence_parallel > 1:
        return "hpZ beside Ulysses sequence parallelism is not run by autofit: hpz_partition_size 1 with sequence_parallel"
    return None


def hpz_without_param_offload(ctx: Context, hpz_partition_size: int, offload_params: str) -> str | None:
    # the secondary partition is made on the parameters' remote device (partition_parameters.py, _partition_param_sec:
    # device=self.remote_device), so under parameter offload it is on the host and every gather reads host memory
    if hpz_partition_size == 1 or offload_params == "none":
        return None
    return ("under parameter offload hpZ's secondary partition lives on the host (partition_parameters.py, "
            "_partition_param_sec), where its gathers read host memory: hpz_partition_size 1 with offload_params")


_QUANTIZER_SOURCE = "deepspeed/accelerator/cpu_accelerator.py, get_op_builder"
_QGZ_SOURCE = "deepspeed/runtime/zero/stage3.py, __avg_scatter_grads"


def quantized_needs_zero3(ctx: Context, quantized: bool, zero_stage: int) -> str | None:
    # the engine hands both zero_quantized_weights and zero_quantized_gradients to ZeRO-3's optimizer and zero.Init only
    # (engine.py, the ZeroStageEnum.weights branch of _configure_zero_optimizer); stage_1_and_2.py reads neither
    if not quantized or zero_stage == 3:
        return None
    return f"ZeRO++'s quantized communication is ZeRO-3's (its gathers and its gradient reduce): ZeRO-{zero_stage} has none"


def qwz_runs_here(ctx: Context, quantized_weights: bool) -> str | None:
    # one rank gathers nothing (partition_parameters.py all_gather_coalesced: _no_gather_coalesced), so nothing is
    # quantized: the same config as without
    if not quantized_weights:
        return None
    if ctx.world_size == 1:
        return "qwZ quantizes ZeRO-3's parameter gathers; one rank gathers nothing (the same config without it)"
    return _no_quantizer(ctx)


def qgz_runs_here(ctx: Context, quantized_gradients: bool) -> str | None:
    # stage3.py quantizes the reduce only where num_nodes > 1 (else reduce_scatter_coalesced, as without it)
    if not quantized_gradients:
        return None
    if ctx.hardware.n_nodes(ctx.world_size) == 1:
        return (f"qgZ quantizes the gradient reduce across nodes only ({_QGZ_SOURCE}): on one node it is the plain "
                "reduce-scatter")
    return _no_quantizer(ctx)


def _no_quantizer(ctx: Context) -> str | None:
    # both quantize with the CUDA QuantizerBuilder op (partition_parameters.py CUDAQuantizer, coalesced_collectives.py
    # all_to_all_quant_reduce), which DeepSpeed's CPU accelerator does not build (a NotImplementedBuilder: zero.Init with
    # zero_quantized_weights on it raises "ValueError: This op had not been implemented on CPU backend")
    if ctx.hardware.kind == "cuda":
        return None
    return (f"ZeRO++'s quantized communication runs DeepSpeed's CUDA quantizer op, which the {ctx.hardware.kind} "
            f"accelerator does not build ({_QUANTIZER_SOURCE})")


def qgz_without_model_parallel(ctx: Context, quantized_gradients: bool, tensor_parallel: int,
                               sequence_parallel: int) -> str | None:
    # its all-to-alls run over every rank of each node and the same local rank of every node (deepspeed/utils/groups.py
    # _get_local_all_to_all_group; all_to_all_quant_reduce averages over dist.get_world_size()), not over the
    # data-parallel group that AutoTP or Ulysses leave
    if not quantized_gradients or (tensor_parallel == 1 and sequence_parallel == 1):
        return None
    return ("qgZ's all-to-alls span every rank of the world, not the data-parallel group that tensor or sequence "
            "parallelism leaves (deepspeed/utils/groups.py, _get_local_all_to_all_group): quantized_gradients off with them")
