"""A prediction as it travels: :class:`PredictionRecord`, the ``predicted`` object of docs/design.md's "JSON
output" (a candidate's of ``autofit estimate --json``, a probe's, a trial's and the winner's of ``autofit run
--json``), written with :meth:`~PredictionRecord.to_json` and read back, from a study or a stored winner, with
:meth:`~PredictionRecord.from_json` (:func:`autofit.core.boundary.read_record`).

The cost model's own :class:`autofit.cost_model.Prediction` adds whether the config fits and why not; its
:meth:`~autofit.cost_model.Prediction.record` is this. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autofit.core.boundary import read_record
from autofit.cost_model.memory import MemoryBreakdown


@dataclass(frozen=True)
class PredictionRecord:
    """What the cost model predicted for one config on one device: memory and time."""

    peak_bytes: int
    """Most memory the training process holds on one device, construction through steps."""
    host_peak_bytes: int
    """Most host (CPU RAM) bytes one node needs (:mod:`autofit.cost_model.host`)."""
    breakdown: MemoryBreakdown
    """``peak_bytes`` split into params, grads, optimizer, activations and other."""
    step_time_s: float
    """One optimizer step (all micro-batches of the accumulation)."""
    samples_per_s: float
    """Global samples per second over all data-parallel ranks."""
    tokens_per_s: float | None
    """``samples_per_s x tokens_per_sample`` for token workloads; None for others."""
    time_breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per step by cause: compute, recompute, communication, offload, overhead."""

    def to_json(self) -> dict[str, Any]:
        """The ``predicted`` JSON object, keys in the order docs/design.md lists them."""
        return {
            "peak_bytes": self.peak_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "breakdown": self.breakdown.to_dict(),
            "step_time_s": self.step_time_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "time_breakdown": self.time_breakdown,
        }

    @classmethod
    def from_json(cls, data: object, what: str = "a prediction") -> PredictionRecord:
        """The record :meth:`to_json` wrote; an :class:`AutofitError` names ``what``, and the key that is missing,
        unknown or of the wrong type."""
        return read_record(cls, data, what, {"breakdown": lambda value: _breakdown_of(value, what)})


def _breakdown_of(data: object, what: str) -> MemoryBreakdown:
    return read_record(MemoryBreakdown, data, f"{what}: breakdown")
