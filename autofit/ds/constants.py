"""The DeepSpeed settings autofit pins in every emitted JSON and the cost model prices.

Dependency-free, so that :mod:`autofit.ds.emit` (which writes them) and :mod:`autofit.cost_model`
and :mod:`autofit.trace` (which price them) import the same numbers without importing each
other. Sizes are in elements, as DeepSpeed's ZeRO config reads them; DeepSpeed's own defaults
are 5e8 / 5e8 / 5e7 / 1e9 / 1e5 (deepspeed/runtime/zero/config.py).
"""

from __future__ import annotations

#: ``zero_optimization.reduce_bucket_size``: gradients reduced per bucket (stage_1_and_2.py, stage3.py)
REDUCE_BUCKET_ELEMENTS = 50_000_000
#: ``zero_optimization.allgather_bucket_size``: parameters all-gathered per bucket after the step (ZeRO 1/2)
ALLGATHER_BUCKET_ELEMENTS = 50_000_000
#: ``stage3_prefetch_bucket_size``: parameters ZeRO-3 fetches ahead of the module that runs
STAGE3_PREFETCH_ELEMENTS = 50_000_000
#: ``stage3_max_live_parameters``: most gathered parameters ZeRO-3 keeps before releasing
STAGE3_MAX_LIVE_ELEMENTS = 1_000_000_000
#: ``stage3_max_reuse_distance``: a released parameter stays gathered if it is used again within this many
#: elements of the module order (partitioned_param_coordinator.py ``__params_to_release``)
STAGE3_MAX_REUSE_ELEMENTS = 1_000_000_000
#: ``stage3_param_persistence_threshold``: parameters smaller than this stay whole on every rank
STAGE3_PERSISTENCE_THRESHOLD = 100_000
