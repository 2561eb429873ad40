"""DeepSpeed's NVMe swap buffers: their size in the emitted JSON and the pinned host memory they take.

Dependency-free (no DeepSpeed import) so that :mod:`autofit.ds.emit` and :mod:`autofit.cost_model.host`
share one set of numbers; ``tests/ds/test_swap_buffers.py`` checks the constants against DeepSpeed's.

**Parameter swapper** (deepspeed/runtime/swap_tensor/partitioned_param_swapper.py,
``AsyncPartitionedParameterSwapper``): ``_configure_aio`` allocates ``buffer_count`` buffers of
``buffer_size`` elements, each rounded up to ``numel_alignment = AIO_ALIGNED_BYTES x intra_op_parallelism
/ element_size`` (``_io_aligned_numel``), in page-locked host memory (``new_cpu_locked_tensor``, whatever
``pin_memory`` says), in the model's dtype. ``get_buffer`` asserts ``numel <= buffer_size`` for each
parameter partition it swaps, where ZeRO-3 hands it ``partition_size = aligned_size // world_size``
(partition_parameters.py ``_partition``: the parameter padded to a multiple of the world size). DeepSpeed's
default ``buffer_size`` is 1e8 elements (deepspeed/runtime/zero/offload_config.py), smaller than a 7 B
LLaMA's 131 M-element embedding on one rank. ZeRO-3 adds one more pinned buffer with the largest
sub-group's fp16 partition when parameters live on NVMe (stage3.py, ``reserve_partitioned_swap_space``).

**Optimizer swapper** (deepspeed/runtime/swap_tensor/optimizer_utils.py, ``OptimizerSwapper``):
``buffer_count`` pinned buffers of the largest sub-group partition (``largest_numel``, io-aligned), in the
master dtype (fp32) (``SwapBufferManager``, swap_tensor/utils.py).
"""

from __future__ import annotations

import math

#: deepspeed/runtime/swap_tensor/utils.py ``AIO_ALIGNED_BYTES``: each aio thread reads/writes this multiple
AIO_ALIGNED_BYTES = 1024
#: deepspeed/runtime/swap_tensor/constants.py ``AIO_INTRA_OP_PARALLELISM_DEFAULT`` (autofit emits no ``aio`` section)
AIO_INTRA_OP_PARALLELISM = 1
#: deepspeed/runtime/zero/offload_config.py ``DeepSpeedZeroOffloadParamConfig.buffer_count``'s default
PARAM_SWAP_BUFFER_COUNT = 5
#: deepspeed/runtime/zero/offload_config.py ``DeepSpeedZeroOffloadParamConfig.buffer_size``'s default
DEFAULT_PARAM_SWAP_BUFFER_ELEMENTS = 100_000_000
#: deepspeed/runtime/zero/offload_config.py ``DeepSpeedZeroOffloadOptimizerConfig.buffer_count``'s default
OPTIMIZER_SWAP_BUFFER_COUNT = 4
#: deepspeed/runtime/zero/config.py ``sub_group_size``'s default: ZeRO-3 steps the optimizer per sub-group this big
SUB_GROUP_ELEMENTS = 1_000_000_000
#: bytes of an fp32 master element (the optimizer swapper's dtype)
MASTER_BYTES = 4


def io_aligned(numel: int, element_bytes: int) -> int:
    """``numel`` rounded up as the swappers' ``_io_aligned_numel`` does."""
    alignment = AIO_ALIGNED_BYTES * AIO_INTRA_OP_PARALLELISM // element_bytes
    remainder = numel % alignment
    return numel if remainder == 0 else numel + alignment - remainder


def param_swap_buffer_elements(largest_param_numel: int, world_size: int, element_bytes: int) -> int:
    """The ``offload_param.buffer_size`` that holds the largest parameter's partition on ``world_size`` ranks.

    ``get_buffer``'s check is ``partition_size <= buffer_size`` with ``partition_size`` the parameter padded to
    a multiple of ``world_size``, divided by it; the result is io-aligned (the buffers are cut at aligned offsets).
    """
    partition = math.ceil(largest_param_numel / world_size)
    return io_aligned(max(partition, 1), element_bytes)


def param_swap_pinned_bytes(largest_param_numel: int, partitioned_numel: float, world_size: int,
                            element_bytes: int) -> float:
    """Pinned host bytes of one rank's parameter swapper: the buffer pool plus ZeRO-3's fp16 reuse buffer.

    ``partitioned_numel``: the elements ZeRO-3 partitions (the persistent ones stay whole on the device).
    """
    buffer = param_swap_buffer_elements(largest_param_numel, world_size, element_bytes)
    reuse = io_aligned(math.ceil(min(partitioned_numel / world_size, SUB_GROUP_ELEMENTS)), element_bytes)
    return float((PARAM_SWAP_BUFFER_COUNT * buffer + reuse) * element_bytes)


def optimizer_swap_pinned_bytes(trainable_numel: float, world_size: int) -> float:
    """Pinned host bytes of one rank's optimizer swapper: ``buffer_count`` fp32 buffers of its largest sub-group."""
    largest = io_aligned(math.ceil(min(trainable_numel / world_size, SUB_GROUP_ELEMENTS)), MASTER_BYTES)
    return float(OPTIMIZER_SWAP_BUFFER_COUNT * largest * MASTER_BYTES)


def nvme_swap_bytes(offload_params: str, offload_optimizer: str, optimizer_state_bytes: float,
                    partitioned_numel: float, trainable_numel: float, world_size: int, ranks_on_node: int,
                    element_bytes: int) -> float:
    """Bytes one node's ranks write to the NVMe directory: each rank's w-byte parameter partition
    (``zero_stage_3/<dtype>params/rank<R>``, partitioned_param_swapper.py) and its fp32 master partition, fp32
    gradient and ``optimizer_state_bytes`` of optimizer states (``zero_stage_3/optimizer``, optimizer_utils.py)."""
    per_rank = 0.0
    if offload_params == "nvme":
        per_rank += element_bytes * partitioned_numel / world_size
    if offload_optimizer == "nvme":
        per_rank += 2 * MASTER_BYTES * trainable_numel / world_size + optimizer_state_bytes
    return per_rank * ranks_on_node
