"""Host (CPU RAM) memory of one node: model builds, offloaded states and partitions, pinned buffers.

Every rank of a node is a process on the same host, so the node needs ``ranks_per_node`` times
what one rank holds there. One rank holds, at its peak, the larger of two phases:

* **build** -- ZeRO 0-2 build the fp32 model on the host (``4 x Psi_all``) and DeepSpeed casts it
  there tensor by tensor before moving it to the device (engine.py ``_cast_module_mixed_precision``,
  then ``module.to(device)``): ``4 x Psi_all + w x largest tensor``. ZeRO-3 builds under
  ``deepspeed.zero.Init``, which makes each module on the device and partitions it at once
  (partition_parameters.py ``Init._post_init_method``): nothing whole on the host. This is
  DeepSpeed's own ``estimate_zero3_model_states_mem_needs(zero_init=True)`` reasoning (its CPU
  term is ``largest_layer x 4 x gpus_per_node``), and ``4 x total x gpus_per_node`` without zero.Init.
* **steady** -- what offload keeps on the host, per rank, from DeepSpeed's source:
  optimizer offload, ZeRO 1/2 (stage_1_and_2.py): the fp32 partition (``single_partition_of_fp32_groups``,
  4 B/elem), its fp32 gradient (``initialize_optimizer_states``, 4 B/elem), the optimizer states, a
  host buffer of the largest parameter for the copy down (``temp_grad_buffer_for_cpu_offload``, w B/elem)
  and, with gradient accumulation, a w-byte accumulator per partition element (``accumulated_grads_in_cpu``).
  Optimizer offload, ZeRO-3 (stage3.py): the fp32 partition, its fp32 gradient (``subgroup_gradient_buffer``),
  the optimizer states and the w-byte gradient partition (``grad_partitions_flat_buffer`` on ``self.device='cpu'``).
  Parameter offload, ZeRO-3: the w-byte parameter partition (``param_groups_fp16_flat_cpu_memory``).
  NVMe offload keeps those partitions on the drive and pins swap buffers instead (:mod:`autofit.ds.swap_buffers`):
  the parameter swapper's ``buffer_count x buffer_size`` pool and fp16 reuse buffer, the optimizer swapper's
  ``buffer_count`` fp32 sub-group buffers; the optimizer's gradients stay on the host (fp32 and w-byte,
  counted whole: an upper bound, the fp32 one is swapped between steps).
  Pinned or not, these are host pages; pinning only makes them unswappable.

Plus the process itself (:data:`HOST_RUNTIME_BYTES`). A CPU device *is* the host: there the
device peak of every rank is what the node needs.
"""

from __future__ import annotations

from autofit.core.config import WORKING_BYTES, Config
from autofit.core.hardware import Hardware
from autofit.cost_model.facts import ModelFacts
from autofit.cost_model.long_context import offloaded_activation_bytes
from autofit.cost_model.states import FP32, optimizer_state_bytes
from autofit.ds.swap_buffers import optimizer_swap_pinned_bytes, param_swap_pinned_bytes

#: host RSS of one CUDA training rank before any model: Python, torch, DeepSpeed and the CUDA
#: runtime's host-side libraries. An assumed figure, not one measured on a GPU machine; a CPU process
#: with torch and DeepSpeed imported holds 245 MiB.
HOST_RUNTIME_BYTES = 2 * 2**30


def host_build_bytes(config: Config, facts: ModelFacts) -> float:
    """Host bytes of one rank while it builds the model (see the module docstring)."""
    if config.zero_stage == 3:
        return 0.0
    w = WORKING_BYTES[config.precision]
    return float(FP32 * facts.n_params + (w if w != FP32 else 0) * facts.largest_param_numel)


def host_steady_bytes(config: Config, facts: ModelFacts, world_size: int) -> float:
    """Host bytes one rank keeps through training: offloaded states, partitions and buffers."""
    if config.zero_stage == 0:
        return 0.0
    w = WORKING_BYTES[config.precision]
    shard = facts.n_trainable_params / world_size
    held = 0.0
    if config.offload_optimizer == "nvme":  # ZeRO-3 only (rules.optimizer_offload_needs_zero)
        held += (FP32 + w) * shard + optimizer_swap_pinned_bytes(facts.n_trainable_params, world_size)
    elif config.offload_optimizer != "none":
        held += 2 * FP32 * shard + optimizer_state_bytes(config.optimizer, facts, shard, flat=True)
        if config.zero_stage == 3:
            held += w * shard
        else:
            held += w * facts.largest_param_numel + (w * shard if config.grad_accum_steps > 1 else 0.0)
    if config.offload_params != "none" and config.zero_stage == 3:
        partitioned = facts.n_trainable_params - facts.n_persistent_params
        if config.offload_params == "nvme":
            held += param_swap_pinned_bytes(facts.largest_param_numel, partitioned, world_size, w)
        else:
            held += w * partitioned / world_size
    return held


def host_peak_bytes(config: Config, facts: ModelFacts, hardware: Hardware, world_size: int, device_peak: int) -> int:
    """Host bytes one node needs: ``ranks_per_node x`` one rank's peak (the device peak on a CPU)."""
    ranks = hardware.ranks_on_a_node(world_size)
    if hardware.kind == "cpu":
        return int(ranks * device_peak)
    per_rank = HOST_RUNTIME_BYTES + max(host_build_bytes(config, facts), host_steady_bytes(config, facts, world_size))
    per_rank += offloaded_activation_bytes(config, facts)  # checkpointed inputs on the host (long_context.py)
    return int(ranks * per_rank)
