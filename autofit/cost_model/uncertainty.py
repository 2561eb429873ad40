"""How sure an unprobed GPU plan is: the prior's error on every GPU row measured so far.

``python -m benchmarks.gpu.gpu_truth`` prices every committed GPU row again (``benchmarks/results/gpu_truth.json``);
its range of ``(predicted - measured) / measured`` is the band a plan that no probe has corrected can expect on a GPU.
Where the peak's band reaches below zero the prior was optimistic on some row (the layers' activations whose sizes
decide the caching allocator's reserve, :mod:`autofit.cost_model.allocation_sequence`): a config predicted at ``p``
has measured up to ``p / (1 + low)``. So the safety margin that holds the worst row measured is ``-low``
(:func:`margin_holding`): ``p <= (1 - margin) x memory`` then keeps ``p / (1 + low)`` within the memory. The search
corrects itself from its first probe and verifies its winner's measured peak, so these bands speak for what is never
probed on the target: ``autofit estimate``, the ladder, ``--seq-len max``.

The numbers here are that benchmark's, rounded; tests/cost_model/test_uncertainty.py holds them to its committed
results, so a new GPU run that moves the band moves them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ErrorBand:
    """``(predicted - measured) / measured`` over the GPU rows measured so far, lowest and highest."""

    quantity: str
    low: float
    high: float
    rows: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"quantity": self.quantity, "low": self.low, "high": self.high, "rows": self.rows, "source": self.source}


#: NVML's per-process peak against the predicted peak
CUDA_PEAK = ErrorBand("peak_bytes", low=-0.019, high=0.086, rows=26, source="benchmarks/results/gpu_truth.json")
#: steady-state samples/s against the predicted (rows whose step times were logged)
CUDA_THROUGHPUT = ErrorBand("samples_per_s", low=-0.189, high=1.060, rows=22,
                            source="benchmarks/results/gpu_truth.json")


def margin_holding(band: ErrorBand) -> float:
    """The safety margin under which a config's worst measured peak (``predicted / (1 + low)``) stays within the
    device's memory: ``-low``; 0 for a band that never fell short."""
    return max(0.0, -band.low)


def cuda_bands() -> dict[str, Any]:
    """What an unprobed CUDA plan states of its own accuracy (the JSON's ``expected_error``)."""
    return {"peak_bytes": CUDA_PEAK.to_dict(), "samples_per_s": CUDA_THROUGHPUT.to_dict(),
            "margin_holding_worst_peak": margin_holding(CUDA_PEAK)}


def cuda_band_line(margin: float) -> str:
    """One line for an unprobed CUDA plan's text: the band, and the margin that holds it where ``margin`` does not."""
    peak = CUDA_PEAK
    line = (f"unprobed on a GPU: the predicted peak has been {peak.low:+.0%} to {peak.high:+.0%} off NVML's measured "
            f"one on {peak.rows} GPU rows, the predicted samples/s {CUDA_THROUGHPUT.low:+.0%} to "
            f"{CUDA_THROUGHPUT.high:+.0%}")
    holding = margin_holding(peak)
    if margin < holding:
        line += f"; --margin {holding:.2f} holds the worst of them (this plan's is {margin:g})"
    return line
