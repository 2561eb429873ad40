"""The ZeRO bucket sizes of a config, derived from the model: what :mod:`autofit.ds.emit` writes and
:mod:`autofit.cost_model` prices, from one function. Dependency-free (no torch, no DeepSpeed).

DeepSpeed's own defaults (deepspeed/runtime/zero/config.py: reduce and all-gather buckets 5e8, prefetch 5e7,
max live 1e9, persistence 1e5) do not depend on the model. The Hugging Face integration's ``auto`` values do
(transformers/integrations/deepspeed.py, ``HfTrainerDeepSpeedConfig.trainer_config_finalize``, transformers
5.24: ``reduce_bucket_size = hidden_size * hidden_size``, ``stage3_prefetch_bucket_size = int(0.9 * hidden_size
* hidden_size)``, ``stage3_param_persistence_threshold = 10 * hidden_size``, with ``hidden_size`` the model
config's ``hidden_size``, else ``max(hidden_sizes)``): a bucket of one ``hidden x hidden`` matrix, so a
transformer layer's gradients go in a few collectives, each large enough to run near the link's bandwidth.
autofit takes those, times the config's ``bucket_scale``, and the all-gather bucket the reduce bucket's size
(the integration leaves it at DeepSpeed's default; ZeRO 1/2 all-gather the updated partition in
``numel x world / allgather_bucket_size`` shards, runtime/utils.py ``all_gather_dp_groups``, where NCCL has no
``all_gather_into_tensor``). ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` stay at
DeepSpeed's 1e9 (the integration leaves them too): the prefetch bucket is the knob, and the live window
:func:`autofit.cost_model.states.stage3_live_elements` prices is bounded by both.

Where the model's hidden size is unknown (0: a script-mode run, a model without a ``hidden_size`` and without
Linear layers), the sizes autofit pinned before it searched them stand (:data:`FALLBACK_ELEMENTS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from autofit.ds.constants import (
    ALLGATHER_BUCKET_ELEMENTS,
    REDUCE_BUCKET_ELEMENTS,
    STAGE3_MAX_LIVE_ELEMENTS,
    STAGE3_MAX_REUSE_ELEMENTS,
    STAGE3_PERSISTENCE_THRESHOLD,
    STAGE3_PREFETCH_ELEMENTS,
)

#: the bucket sizes used where the hidden size is unknown (elements)
FALLBACK_ELEMENTS = REDUCE_BUCKET_ELEMENTS
#: DeepSpeed asserts ``allgather_bucket_size % nccl_start_alignment_factor == 0`` (stage_1_and_2.py: 2, a
#: 4-byte boundary of 16-bit elements); every size is rounded up to a multiple of it
ALIGNMENT = 2


@dataclass(frozen=True)
class ZeroBuckets:
    """Sizes in elements, as DeepSpeed's ``zero_optimization`` section reads them."""

    reduce_bucket_size: int
    allgather_bucket_size: int
    stage3_prefetch_bucket_size: int
    stage3_max_live_parameters: int
    stage3_max_reuse_distance: int
    stage3_param_persistence_threshold: int


def zero_buckets(hidden_size: int, bucket_scale: int = 1) -> ZeroBuckets:
    """The bucket sizes of a model of ``hidden_size`` at ``bucket_scale`` (module docstring)."""
    if hidden_size > 0:
        square = hidden_size * hidden_size
        reduce, prefetch = square, int(0.9 * square)
        persistence = 10 * hidden_size
        allgather = reduce
    else:
        reduce, allgather, prefetch = REDUCE_BUCKET_ELEMENTS, ALLGATHER_BUCKET_ELEMENTS, STAGE3_PREFETCH_ELEMENTS
        persistence = STAGE3_PERSISTENCE_THRESHOLD
    return ZeroBuckets(
        reduce_bucket_size=_aligned(bucket_scale * reduce),
        allgather_bucket_size=_aligned(bucket_scale * allgather),
        stage3_prefetch_bucket_size=_aligned(bucket_scale * prefetch),
        stage3_max_live_parameters=STAGE3_MAX_LIVE_ELEMENTS,
        stage3_max_reuse_distance=STAGE3_MAX_REUSE_ELEMENTS,
        stage3_param_persistence_threshold=persistence,
    )


def persistence_threshold(hidden_size: int) -> int:
    """ZeRO-3's ``stage3_param_persistence_threshold`` for a model of ``hidden_size``: parameters with fewer
    elements stay whole on every rank (stage3.py ``persistent_parameters``). Not scaled by ``bucket_scale``."""
    return zero_buckets(hidden_size).stage3_param_persistence_threshold


def _aligned(n: int) -> int:
    return max(ALIGNMENT, -(-int(n) // ALIGNMENT) * ALIGNMENT)
