"""What one probe rank reports: :class:`RankResult`, written by the rank as ``rank<R>.json``, read by the probe.

The rank (:mod:`autofit.probe.rank.worker`, or :mod:`autofit.probe.rank.fake`) writes every field, whatever it
measured; the probe (:func:`autofit.probe.run.run_probe`, through :func:`read_rank_result`) reads it back
strictly (:func:`autofit.core.boundary.read_record`), and a file it cannot read as this record makes that
rank an ``error`` that says why, never a rank that measured 0 bytes.

No torch import: the parent reads these.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autofit.core.boundary import OOM_ON, STATUSES, OomOn, Status, read_record
from autofit.core.errors import AutofitError


@dataclass(frozen=True)
class RankResult:
    """One rank's measurement, or why it has none (``rank<R>.json``)."""

    rank: int
    """The rank's ``RANK``."""
    status: Status
    """``ok``, ``oom`` (its device, its CPU budget or the host ran out), ``timeout`` (the probe's deadline, set by
    the parent) or ``error``."""
    message: str | None = None
    """One line: why it failed, a note (fake mode), or None."""
    oom_on: OomOn | None = None
    """For ``oom``: ``device`` or ``host``; None otherwise."""
    traceback: str | None = None
    """The end of the traceback of the exception that ended the rank, if one did."""
    peak_bytes: int = 0
    """Most memory the rank held, model build through the measured steps (docs/design.md, "Memory, measured");
    for ``oom``: what it held when it stopped; fake mode: the simulated device's peak."""
    per_rank_peak_bytes: list[int] = field(default_factory=list)
    """Fake mode: the peak of every simulated rank (one process simulates them all); empty in real mode."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Seconds by phase: ``process_start_s``, ``imports_s``, ``model_build_s``, ``initialize_s``, ``steps_s``."""
    step_times_s: list[float] = field(default_factory=list)
    """Seconds of each timed optimizer step, in order."""
    step_time_s: float = 0.0
    """Their median (0.0 when none was timed)."""
    optimizer_time_s: float = 0.0
    """Median seconds of ``engine.step`` at the accumulation boundary within a step (0.0 when not timed)."""
    loss: float | None = None
    """The loss at the last timed step (NaN or infinite when it did not stay finite; None when no step ran)."""
    device_memory: dict[str, int | None] = field(default_factory=dict)
    """CUDA: the sources of ``peak_bytes`` (:meth:`autofit.probe.rank.meter.Meter.report`); empty on the CPU."""
    n_checkpointed: int = 0
    """Layers the candidate's checkpointing wrapped."""
    optimizer_state_bytes: int = 0
    """Bytes of the optimizer's state tensors after the steps (each storage once)."""
    tokens_per_sample: int | None = None
    """The workload's tokens per sample, None for non-token workloads or when the workload was not loaded."""
    elastic_run_id: str | None = None
    """``TORCHELASTIC_RUN_ID`` where ``torch.distributed.run`` started the rank, else None."""
    build_peak_bytes: int = 0
    """Memory held once the model was built, before ``deepspeed.initialize``."""
    initialize_peak_bytes: int = 0
    """The peak through ``deepspeed.initialize`` (build included)."""
    param_elements: int = 0
    """Parameter elements the rank held once the model was built (its ZeRO-3 partition)."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Fake mode: bytes by category at the peak (params, grads, optimizer, activations, other)."""
    n_params: int = 0
    """Fake mode: the model's parameters, as traced."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise AutofitError(f"rank result status must be one of {', '.join(STATUSES)}, but got {self.status!r}")
        if self.oom_on is not None and self.oom_on not in OOM_ON:
            raise AutofitError(f"rank result oom_on must be device, host or None, but got {self.oom_on!r}")
        if self.rank < 0 or self.peak_bytes < 0:
            raise AutofitError(f"rank result needs rank >= 0 and peak_bytes >= 0, but got {self.rank=}, {self.peak_bytes=}")

    def to_json(self) -> dict[str, Any]:
        """Every field, by its name (what :meth:`from_json` reads)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> RankResult:
        """The record :meth:`to_json` wrote; an :class:`AutofitError` names a missing, unknown or mistyped key."""
        return read_record(cls, data, "a probe rank's result")


def write_rank_result(path: Path, result: RankResult) -> None:
    """Write atomically, so the parent never reads half a file. ``allow_nan``: a NaN loss is a finding."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_json(), allow_nan=True))
    os.replace(tmp, path)


def read_rank_result(path: Path, rank: int) -> RankResult | None:
    """The result rank ``rank`` wrote at ``path``; None when it wrote none. A file that is not a
    :class:`RankResult` (not JSON, a key renamed, a value of the wrong type) is that rank's ``error``,
    saying why: its measurement cannot be trusted, and a 0 read in its place would look like one."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        return RankResult.from_json(json.loads(text))
    except (ValueError, AutofitError) as exc:
        return RankResult(rank=rank, status="error", message=f"rank {rank} wrote an unreadable result {path.name}: {exc}"[:500])
