"""DeepSpeed's AutoTP in the JSON: ``tensor_parallel.autotp_size`` (``deepspeed/runtime/tensor_parallel/config.py``),
written by :mod:`autofit.ds.emit` and read back here by what runs the JSON (a probe rank)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: DeepSpeed's AutoTP section and its degree key
TENSOR_PARALLEL, AUTOTP_SIZE = "tensor_parallel", "autotp_size"


def with_tensor_parallel(ds: dict[str, Any], tensor_parallel: int) -> dict[str, Any]:
    """``ds`` with AutoTP on and without ``train_batch_size``: DeepSpeed checks the batch keys against two worlds under
    TP, the whole one where ``deepspeed.initialize`` builds its config (``deepspeed/runtime/config.py``, no ``mpu``)
    and the data-parallel one in ZeRO-3's ``zero.Init`` (the engine's TP groups as ``mpu``), so a ``train_batch_size``
    right for one fails the other's assertion (docs/results/autotp_cpu.md); left out, each derives its own from the
    micro-batch and the accumulation, and the HF Trainer and Accelerate fill only an ``"auto"`` one."""
    out = {key: value for key, value in ds.items() if key != "train_batch_size"}
    out[TENSOR_PARALLEL] = {AUTOTP_SIZE: tensor_parallel}
    return out


def tp_degree(ds: Mapping[str, Any]) -> int:
    """The JSON's AutoTP degree (0 and 1 are off in DeepSpeed's config: 1 here)."""
    section = ds.get(TENSOR_PARALLEL)
    size = section.get(AUTOTP_SIZE, 1) if isinstance(section, Mapping) else 1
    return max(1, int(size or 1))
