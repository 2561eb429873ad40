"""What a script run yields across its process boundary: the files DeepSpeed's engine writes in the user's script.

- :class:`DeepSpeedMetric`: the metric file of a run with ``autotuning.metric_path`` (deepspeed/runtime/engine.py,
  ``_autotuning_exit``): the timers' means, ``latency``, ``FLOPS_per_gpu`` and ``throughput``; read by
  :mod:`autofit.script.prober` (a candidate's step) and :mod:`autofit.script.profile` (the FLOPs).
- :class:`ModelInfo`: the model-info file of a run with ``autotuning.model_info.profile``
  (``autotuning_model_info`` in engine.py); read by :mod:`autofit.script.profile`.

Both are read strictly (:func:`autofit.core.boundary.read_record`): a key DeepSpeed renames is an error naming it, not
a 0 in the measurement. Field names are DeepSpeed's keys.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autofit.core.boundary import read_record
from autofit.core.errors import AutofitError

#: DeepSpeed's timer means are in microseconds (utils/timer.py ``get_mean``: milliseconds x 1000)
US = 1e-6
#: timers ``get_mean`` leaves out when they never ran (``if name in self.timers``)
_TIMERS = frozenset({"fwd", "bwd", "step"})


@dataclass(frozen=True)
class DeepSpeedMetric:
    """DeepSpeed's metric file: the profiled steps' timings (microseconds), rank 0's view."""

    latency: float
    """Microseconds of one optimizer step: ``grad_accum_steps x (fwd + bwd + step)``."""
    FLOPS_per_gpu: float
    """The flops profiler's forward count x3 (forward and backward) per second of ``latency``."""
    throughput: float
    """``train_batch_size x 10^6 / latency``: samples per second, all ranks."""
    rank: int
    """The rank that wrote the file (``print_json_dist`` in deepspeed/utils/logging.py adds it; -1 without a
    process group)."""
    fwd: float = 0.0
    """Mean microseconds of one micro-batch's forward (``fwd`` global timer); 0.0 when DeepSpeed wrote none."""
    bwd: float = 0.0
    """Mean microseconds of one micro-batch's backward."""
    step: float = 0.0
    """Mean microseconds of one micro-batch's ``engine.step`` (the update at the boundary)."""

    def __post_init__(self) -> None:
        if not self.latency > 0:
            raise AutofitError(f"DeepSpeed's metric: latency must be > 0 microseconds, but got {self.latency!r}")

    @property
    def step_time_s(self) -> float:
        """Seconds of one optimizer step."""
        return self.latency * US

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> DeepSpeedMetric:
        """The file DeepSpeed wrote; the timers it never ran may be absent, any other key missing or unknown is an
        :class:`AutofitError` naming it."""
        return read_record(cls, data, "DeepSpeed's metric file", optional=_TIMERS)


@dataclass(frozen=True)
class ModelInfo:
    """DeepSpeed's model-info profile: parameters counted at initialize, one forward's activation memory."""

    num_params: int
    """Every parameter of the model (x the model-parallel size)."""
    trainable_num_params: int
    """Those with ``requires_grad``."""
    activation_mem_per_gpu: int
    """Bytes one forward of the profiled micro-batch allocated (``memory_allocated()`` around it; RSS on the CPU)."""
    rank: int
    """The rank that wrote the file (``print_json_dist`` adds it; -1 without a process group)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> ModelInfo:
        return read_record(cls, data, "DeepSpeed's model-info file")


def read_deepspeed_file(path: Path, what: str) -> dict[str, Any] | None:
    """The JSON object DeepSpeed wrote at ``path``; None when there is no such file (the run ended before it)."""

    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise AutofitError(f"DeepSpeed's {what} file {path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise AutofitError(f"DeepSpeed's {what} file {path} is not a JSON object")
    return data
