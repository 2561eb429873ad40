"""The rules that prune what cannot run, or means nothing, on a device: small pure checks over a few keys.

Each :class:`Rule` reads a few config keys and a :class:`Context` (the device, the job and what the
machine's software runs) and returns the reason a partial config cannot run, or None. The reasons are
what ``autofit estimate`` lists for each pruned group (:func:`autofit.core.space.describe_rejections`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autofit.core.hardware import Hardware
from autofit.core.parallel_rules import (
    hpz_is_a_node,
    hpz_needs_zero3,
    hpz_without_model_parallel,
    hpz_without_param_offload,
    qgz_runs_here,
    qgz_without_model_parallel,
    quantized_needs_zero3,
    qwz_runs_here,
    tp_divides_widths,
    tp_divides_world,
    tp_needs_a_plan,
    tp_needs_an_untied_head,
    tp_not_compiled,
    tp_within_a_node,
    tp_without_long_context,
)
from autofit.core.sequence import SequenceShape
from autofit.core.software import Software, optimizer_op

#: optimizers DeepSpeed has a CPU implementation of (DeepSpeedCPUAdam, DeepSpeedCPULion;
#: deepspeed/runtime/engine.py, _configure_basic_optimizer). Others would run a torch
#: optimizer on the host, or refuse (``zero_force_ds_cpu_optimizer``).
OFFLOADABLE_OPTIMIZERS = ("adamw", "lion")

@dataclass(frozen=True)
class Context:
    """What the rules know beyond the config: the device, the job and the workload."""

    hardware: Hardware
    """The device each rank runs on."""
    world_size: int
    """Ranks: gpus x nodes (data-parallel ranks x the tensor- and sequence-parallel degrees)."""
    global_batch: int | None
    """Samples per optimizer step, or None where none is known."""
    software: Software = field(default_factory=Software)
    """What the machine's software runs (:func:`autofit.machine.software.detect_software`); by default everything."""
    sequence: SequenceShape | None = None
    """The workload's sequence and attention heads (an ``hf:`` causal LM's); None: it states none, and the
    long-context keys cannot run (:mod:`autofit.core.sequence`)."""


@dataclass(frozen=True)
class Rule:
    """A pure check over a few config keys; ``check`` returns why a partial config cannot run, or None."""

    name: str
    """Short identifier, used in tests and logs."""
    keys: tuple[str, ...]
    """The config keys ``check`` reads, in order."""
    check: Callable[..., str | None] = field(repr=False)
    """``check(context, *values) -> reason | None``, one value per key."""


def precision_supported(ctx: Context, precision: str) -> str | None:
    if ctx.hardware.supports_precision(precision):
        return None
    return f"{ctx.hardware.name} has no {precision} support"


def fp8_needs_torchao(ctx: Context, precision: str) -> str | None:
    if precision != "fp8" or ctx.software.torchao:
        return None
    return "fp8 training needs torchao, which is not installed (pip install -e '.[fp8]')"


def flash_supported(ctx: Context, attention: str) -> str | None:
    if attention != "flash" or ctx.hardware.supports_flash:
        return None
    return f"flash attention does not run on {ctx.hardware.name}"


def flash_needs_flash_attn(ctx: Context, attention: str) -> str | None:
    if attention != "flash" or ctx.software.flash_attn:
        return None
    return "flash attention needs flash-attn, which is not installed (pip install -e '.[flash]')"


def flash_needs_16_bit(ctx: Context, attention: str, precision: str) -> str | None:
    # flash-attn's kernels take fp16 and bf16 only (flash_attn_interface.py: "FlashAttention only support
    # fp16 and bf16 data type"); fp8 runs bf16 around its matmuls, attention included
    if attention != "flash" or precision != "fp32":
        return None
    return "flash attention runs in fp16/bf16 only, not fp32"


def offload_on_a_cpu_device_optimizer(ctx: Context, offload_optimizer: str) -> str | None:
    return _offload_on_cpu_device(ctx, offload_optimizer)


def offload_on_a_cpu_device_params(ctx: Context, offload_params: str) -> str | None:
    return _offload_on_cpu_device(ctx, offload_params)


def _offload_on_cpu_device(ctx: Context, device: str) -> str | None:
    # on a CPU device DeepSpeed's offload keeps the states in the same RAM and adds CPU-side fp32 partitions
    # and copies: measured 24-55% above the same config without it
    if device != "cpu" or ctx.hardware.kind != "cpu":  # NVMe on a CPU device: nvme_needs_cuda says why
        return None
    return "the device is the CPU: offloading to the host moves nothing off it and adds DeepSpeed's buffers"


def deepspeed_op_loadable(ctx: Context, optimizer: str, offload_optimizer: str) -> str | None:
    """A CUDA DeepSpeed optimizer op that is neither pre-built nor buildable (no nvcc) cannot run.

    AdamW without offload is exempt: it falls back to DeepSpeed's ``torch_adam`` (:mod:`autofit.ds.emit`).
    """
    if ctx.hardware.kind != "cuda":
        return None
    op = optimizer_op(optimizer, offload_optimizer, ctx.hardware.kind)
    if op is None or op == "fused_adam":
        return None
    why = ctx.software.op_unavailable(op)
    return f"{optimizer} needs DeepSpeed's {op} op, {why}" if why else None


def nvme_offload_ready(ctx: Context, offload_optimizer: str, offload_params: str) -> str | None:
    """NVMe offload on a CUDA device needs a directory to swap to and DeepSpeed's async_io op."""
    if "nvme" not in (offload_optimizer, offload_params) or ctx.hardware.kind != "cuda":
        return None
    if not ctx.software.nvme_path:
        return "NVMe offload needs --nvme-path DIR (a writable directory on the NVMe drive)"
    why = ctx.software.op_unavailable("async_io")
    return f"NVMe offload needs DeepSpeed's async_io op, {why}" if why else None


def param_offload_needs_zero3(ctx: Context, offload_params: str, zero_stage: int) -> str | None:
    if offload_params == "none" or zero_stage == 3:
        return None
    return f"offloading parameters needs ZeRO stage 3, not {zero_stage}"


def optimizer_offload_needs_zero(ctx: Context, offload_optimizer: str, zero_stage: int) -> str | None:
    # DeepSpeed runs stage 1/2 NVMe optimizer offload silently as CPU offload (stage_1_and_2.py
    # treats any device != none as cpu_offload); only ZeRO-Infinity (stage 3) swaps to NVMe.
    if offload_optimizer == "none":
        return None
    if zero_stage == 0:
        return "offloading the optimizer needs ZeRO stage >= 1"
    if offload_optimizer == "nvme" and zero_stage != 3:
        return f"NVMe optimizer offload needs ZeRO stage 3, not {zero_stage}"
    return None


def optimizer_offloadable(ctx: Context, offload_optimizer: str, optimizer: str) -> str | None:
    if offload_optimizer == "none" or optimizer in OFFLOADABLE_OPTIMIZERS:
        return None
    return f"DeepSpeed cannot offload {optimizer} (only {', '.join(OFFLOADABLE_OPTIMIZERS)})"


def nvme_needs_cuda_optimizer(ctx: Context, offload_optimizer: str) -> str | None:
    return _nvme_needs_cuda(ctx, offload_optimizer)


def nvme_needs_cuda_params(ctx: Context, offload_params: str) -> str | None:
    return _nvme_needs_cuda(ctx, offload_params)


def _nvme_needs_cuda(ctx: Context, device: str) -> str | None:
    if device != "nvme" or ctx.hardware.kind == "cuda":
        return None
    return f"NVMe offload needs a CUDA device, not {ctx.hardware.name}"


def granularity_needs_checkpointing(ctx: Context, checkpoint_granularity: str, checkpoint_ratio: float) -> str | None:
    if checkpoint_granularity == "block" or checkpoint_ratio > 0:
        return None
    return "checkpoint_granularity=attention with checkpoint_ratio 0 checkpoints nothing (the same config as block)"


def compile_needs_a_compiler(ctx: Context, compile: str) -> str | None:
    # inductor builds a CPU graph's kernels with a C++ compiler (torch/_inductor/cpp_builder.py) and a CUDA
    # graph's in Triton (torch/_inductor/codegen/triton.py)
    if compile == "off":
        return None
    if ctx.hardware.kind == "cuda":
        return None if ctx.software.triton else "compile on a CUDA device needs triton, which is not installed"
    return None if ctx.software.cxx_compiler else "compile on a CPU device needs a C++ compiler (inductor), none found"


def fp8_not_with_zero3(ctx: Context, precision: str, zero_stage: int) -> str | None:
    # ZeRO-3 frees each gathered weight after its module's forward; a plain Linear's saved weight goes through
    # DeepSpeed's own LinearFunctionForZeroStage3 (deepspeed/runtime/zero/linear.py, memory_efficient_linear), which
    # re-gathers it in backward. torchao's Float8Linear runs its own autograd function (matmul_with_hp_or_float8_args,
    # torchao/float8/float8_linear.py) that saves weight.t(), a view holding the gathered storage until its backward:
    # every converted layer's full weight stays alive through the step (torchao's README asks FSDP users for
    # force_recompute_fp8_weight_in_bwd for this reason). Not measured here (torchao's fp8 matmul needs a CUDA
    # device of compute capability 8.9+), so pruned rather than priced.
    if precision != "fp8" or zero_stage != 3:
        return None
    return ("fp8 with ZeRO-3: torchao's Float8Linear saves each gathered weight for backward outside DeepSpeed's "
            "memory_efficient_linear, so ZeRO-3's weight partitioning would not hold (unmeasured; pruned)")


def zero_knobs_need_zero(ctx: Context, overlap_comm: bool, contiguous_gradients: bool, bucket_scale: int,
                         zero_stage: int) -> str | None:
    # ZeRO 0 reduces through the engine's own all-reduce (engine.py allreduce_gradients), which reads none of
    # zero_optimization's overlap, bucket or contiguity settings: any other value is the same config
    if zero_stage > 0 or (not overlap_comm and contiguous_gradients and bucket_scale == 1):
        return None
    return "overlap_comm, contiguous_gradients and bucket_scale are ZeRO 1-3 settings (ZeRO 0 is the same config)"


def comm_knobs_need_ranks(ctx: Context, overlap_comm: bool, bucket_scale: int) -> str | None:
    # on one rank there is no collective to overlap or to batch: a second reduce bucket (overlap_comm) or a
    # larger one only costs memory
    if ctx.world_size > 1 or (not overlap_comm and bucket_scale == 1):
        return None
    return "overlap_comm and a larger bucket_scale only add memory on one rank (no communication to overlap or batch)"


def adam_mini_installed(ctx: Context, optimizer: str) -> str | None:
    if optimizer != "adam_mini" or ctx.software.adam_mini:
        return None
    return "adam_mini needs the adam-mini package, which is not installed (pip install -e '.[train]')"


def adam_mini_needs_zero0(ctx: Context, optimizer: str, zero_stage: int) -> str | None:
    # ZeRO 1-3 hand a client optimizer one flat 1-D partition per parameter group (stage_1_and_2.py
    # single_partition_of_fp32_groups, stage3.py fp32_partitioned_groups_flat); adam-mini 1.1.1 indexes the
    # state of an embedding, value, projection or MLP weight as a matrix (m[0:n, 0:1]) and raises there
    # (IndexError: too many indices for tensor of dimension 1, measured on DeepSpeed 0.19, stages 1, 2 and 3)
    if optimizer != "adam_mini" or zero_stage == 0:
        return None
    return f"adam-mini cannot step on ZeRO stage {zero_stage}'s flat 1-D partitions (it needs each weight's matrix shape)"


def micro_batch_divides(ctx: Context, micro_batch_size: int, sequence_parallel: int, tensor_parallel: int) -> str | None:
    model_parallel = sequence_parallel * tensor_parallel
    if ctx.global_batch is None or ctx.world_size % model_parallel:  # sp_divides_world / tp_divides_world say why
        return None
    data_parallel = ctx.world_size // model_parallel
    per_step = micro_batch_size * data_parallel
    if ctx.global_batch % per_step == 0:
        return None
    splits = " x ".join([f"tp {tensor_parallel}"] * (tensor_parallel > 1) + [f"sp {sequence_parallel}"] * (sequence_parallel > 1))
    ranks = f"world size {ctx.world_size}" if model_parallel == 1 else \
        f"data-parallel size {data_parallel} (world {ctx.world_size} / {splits})"
    return f"micro_batch_size {micro_batch_size} x {ranks} = {per_step} does not divide the global batch {ctx.global_batch}"


_SP_SOURCE = "deepspeed/runtime/sequence_parallel/ulysses_sp.py"


def sp_needs_ranks(ctx: Context, sequence_parallel: int) -> str | None:
    if sequence_parallel == 1 or ctx.world_size > 1:
        return None
    return "sequence parallelism splits a sequence over ranks; on one rank there is nothing to split it with"


def sp_divides_world(ctx: Context, sequence_parallel: int) -> str | None:
    # parallel_state_sp.initialize_sequence_parallel builds groups of sp consecutive ranks (world % sp == 0)
    if ctx.world_size == 1 or ctx.world_size % sequence_parallel == 0:
        return None
    return f"sequence_parallel {sequence_parallel} does not divide the world size {ctx.world_size}"


def sp_needs_hf_causal_lm(ctx: Context, sequence_parallel: int) -> str | None:
    if sequence_parallel == 1 or (ctx.sequence is not None and ctx.sequence.causal_lm):
        return None
    return ("sequence parallelism needs an hf: causal LM, whose attention DeepSpeed's UlyssesSPAttentionHF wraps "
            "(a plain Workload's attention is not registered with transformers)")


def sp_divides_heads(ctx: Context, sequence_parallel: int) -> str | None:
    # UlyssesSPAttentionHF.__init__ (:131-152): heads % sp == 0; kv heads % sp == 0, or sp % kv == 0 (each kv head
    # then replicated to sp / kv ranks)
    shape = ctx.sequence
    if sequence_parallel == 1 or shape is None:
        return None
    if shape.n_heads % sequence_parallel:
        return f"sequence_parallel {sequence_parallel} does not divide the {shape.n_heads} attention heads ({_SP_SOURCE})"
    kv = shape.n_kv_heads
    if kv % sequence_parallel and sequence_parallel % kv:
        return (f"sequence_parallel {sequence_parallel} and the {kv} key/value heads: neither divides the other "
                f"({_SP_SOURCE})")
    return None


def sp_divides_sequence(ctx: Context, sequence_parallel: int) -> str | None:
    # UlyssesSPDataLoaderAdapter refuses a batch whose length is not a multiple of sp (ulysses_sp.py:706)
    shape = ctx.sequence
    if sequence_parallel == 1 or shape is None or shape.seq_len % sequence_parallel == 0:
        return None
    return f"sequence_parallel {sequence_parallel} does not divide the sequence length {shape.seq_len}"


def sp_not_eager(ctx: Context, sequence_parallel: int, attention: str) -> str | None:
    # register_with_transformers refuses eager (:468-474): its 4-D mask is O(seq^2)
    if sequence_parallel == 1 or attention != "eager":
        return None
    return "DeepSpeed's Ulysses refuses eager attention (its 4-D mask is seq x seq); sdpa or flash"


def sp_needs_zero3(ctx: Context, sequence_parallel: int, zero_stage: int) -> str | None:
    # docs/develop/long-context.md, Finding 1: the SP loss aggregation (an all_gather of the shards' losses, as the
    # DeepSpeed tutorial, accelerate and the HF Trainer do it) gives every SP rank sp x its gradient; ZeRO-3's
    # reduce-scatter divides by the whole world and cancels it, ZeRO 0-2 divide by world / sp and train with sp x
    # the true gradient
    if sequence_parallel == 1 or zero_stage == 3:
        return None
    return (f"sequence parallelism under ZeRO {zero_stage} trains with sp x the gradient (the SP loss aggregation "
            "sums every rank's copy; only ZeRO-3's reduce divides it back): ZeRO-3 only")


def tiling_needs_hf_causal_lm(ctx: Context, tiled_mlp: bool, tiled_loss: bool) -> str | None:
    if not (tiled_mlp or tiled_loss) or (ctx.sequence is not None and ctx.sequence.causal_lm):
        return None
    return ("tiled_mlp and tiled_loss need an hf: causal LM (its MLP modules and its logits head); a plain "
            "Workload's model is not known to tile")


def tiled_mlp_needs_two_tiles(ctx: Context, tiled_mlp: bool, sequence_parallel: int) -> str | None:
    # TiledMLP runs ceil((seq/sp) / hidden) tiles (SequenceShape.mlp_tiles); one tile is the untiled MLP plus a recompute
    shape = ctx.sequence
    if not tiled_mlp or shape is None or shape.mlp_tiles(sequence_parallel) > 1:
        return None
    return (f"tiled_mlp at {shape.seq_len // sequence_parallel} tokens a rank (hidden {shape.hidden_size}) is one tile: "
            "the untiled MLP plus its recompute")


def offload_activations_needs_checkpointing(ctx: Context, offload_activations: str,
                                            checkpoint_ratio: float) -> str | None:
    if offload_activations == "none" or checkpoint_ratio > 0:
        return None
    return "offload_activations moves the checkpointed layers' inputs to the host; with checkpoint_ratio 0 there are none"


def offload_activations_on_a_cpu_device(ctx: Context, offload_activations: str) -> str | None:
    if offload_activations == "none" or ctx.hardware.kind != "cpu":
        return None
    return "the device is the CPU: offloading activations to the host moves nothing off it"


#: every rule, in the order reasons are reported (the parallelism ones from :mod:`autofit.core.parallel_rules`)
RULES: tuple[Rule, ...] = (
    Rule("micro_batch_divides", ("micro_batch_size", "sequence_parallel", "tensor_parallel"), micro_batch_divides),
    Rule("precision_supported", ("precision",), precision_supported),
    Rule("fp8_needs_torchao", ("precision",), fp8_needs_torchao),
    Rule("flash_supported", ("attention",), flash_supported),
    Rule("flash_needs_flash_attn", ("attention",), flash_needs_flash_attn),
    Rule("flash_needs_16_bit", ("attention", "precision"), flash_needs_16_bit),
    Rule("offload_on_a_cpu_device_optimizer", ("offload_optimizer",), offload_on_a_cpu_device_optimizer),
    Rule("offload_on_a_cpu_device_params", ("offload_params",), offload_on_a_cpu_device_params),
    Rule("param_offload_needs_zero3", ("offload_params", "zero_stage"), param_offload_needs_zero3),
    Rule("optimizer_offload_needs_zero", ("offload_optimizer", "zero_stage"), optimizer_offload_needs_zero),
    Rule("optimizer_offloadable", ("offload_optimizer", "optimizer"), optimizer_offloadable),
    Rule("nvme_needs_cuda_optimizer", ("offload_optimizer",), nvme_needs_cuda_optimizer),
    Rule("nvme_needs_cuda_params", ("offload_params",), nvme_needs_cuda_params),
    Rule("deepspeed_op_loadable", ("optimizer", "offload_optimizer"), deepspeed_op_loadable),
    Rule("nvme_offload_ready", ("offload_optimizer", "offload_params"), nvme_offload_ready),
    Rule("granularity_needs_checkpointing", ("checkpoint_granularity", "checkpoint_ratio"), granularity_needs_checkpointing),
    Rule("compile_needs_a_compiler", ("compile",), compile_needs_a_compiler),
    Rule("fp8_not_with_zero3", ("precision", "zero_stage"), fp8_not_with_zero3),
    Rule("zero_knobs_need_zero", ("overlap_comm", "contiguous_gradients", "bucket_scale", "zero_stage"),
         zero_knobs_need_zero),
    Rule("comm_knobs_need_ranks", ("overlap_comm", "bucket_scale"), comm_knobs_need_ranks),
    Rule("adam_mini_installed", ("optimizer",), adam_mini_installed),
    Rule("adam_mini_needs_zero0", ("optimizer", "zero_stage"), adam_mini_needs_zero0),
    Rule("sp_needs_ranks", ("sequence_parallel",), sp_needs_ranks),
    Rule("sp_divides_world", ("sequence_parallel",), sp_divides_world),
    Rule("sp_needs_hf_causal_lm", ("sequence_parallel",), sp_needs_hf_causal_lm),
    Rule("sp_divides_heads", ("sequence_parallel",), sp_divides_heads),
    Rule("sp_divides_sequence", ("sequence_parallel",), sp_divides_sequence),
    Rule("sp_not_eager", ("sequence_parallel", "attention"), sp_not_eager),
    Rule("sp_needs_zero3", ("sequence_parallel", "zero_stage"), sp_needs_zero3),
    Rule("tp_within_a_node", ("tensor_parallel",), tp_within_a_node),
    Rule("tp_divides_world", ("tensor_parallel", "sequence_parallel"), tp_divides_world),
    Rule("tp_needs_a_plan", ("tensor_parallel",), tp_needs_a_plan),
    Rule("tp_needs_an_untied_head", ("tensor_parallel",), tp_needs_an_untied_head),
    Rule("tp_divides_widths", ("tensor_parallel",), tp_divides_widths),
    Rule("tp_without_long_context", ("tensor_parallel", "sequence_parallel", "tiled_mlp", "tiled_loss",
                                     "offload_activations"), tp_without_long_context),
    Rule("tp_not_compiled", ("tensor_parallel", "compile"), tp_not_compiled),
    Rule("hpz_needs_zero3", ("hpz_partition_size", "zero_stage"), hpz_needs_zero3),
    Rule("hpz_is_a_node", ("hpz_partition_size",), hpz_is_a_node),
    Rule("hpz_without_model_parallel", ("hpz_partition_size", "tensor_parallel", "sequence_parallel"),
         hpz_without_model_parallel),
    Rule("hpz_without_param_offload", ("hpz_partition_size", "offload_params"), hpz_without_param_offload),
    Rule("qwz_needs_zero3", ("quantized_weights", "zero_stage"), quantized_needs_zero3),
    Rule("qgz_needs_zero3", ("quantized_gradients", "zero_stage"), quantized_needs_zero3),
    Rule("qwz_runs_here", ("quantized_weights",), qwz_runs_here),
    Rule("qgz_runs_here", ("quantized_gradients",), qgz_runs_here),
    Rule("qgz_without_model_parallel", ("quantized_gradients", "tensor_parallel", "sequence_parallel"),
         qgz_without_model_parallel),
    Rule("tiling_needs_hf_causal_lm", ("tiled_mlp", "tiled_loss"), tiling_needs_hf_causal_lm),
    Rule("tiled_mlp_needs_two_tiles", ("tiled_mlp", "sequence_parallel"), tiled_mlp_needs_two_tiles),
    Rule("offload_activations_needs_checkpointing", ("offload_activations", "checkpoint_ratio"),
         offload_activations_needs_checkpointing),
    Rule("offload_activations_on_a_cpu_device", ("offload_activations",), offload_activations_on_a_cpu_device),
)
