"""The hand-offs between the probe and its ranks, one record each way.

:class:`ProbeSpec`: what the probe asks of its ranks, written by the parent (:func:`autofit.probe.spec.probe_spec`
builds it; :func:`autofit.probe.launch.launch` writes it as ``spec.json``, :func:`autofit.probe.elastic.launch_agents`
as one line on each agent's stdin) and read back by each rank (:mod:`autofit.probe.rank.worker`) with
:meth:`ProbeSpec.from_json`.

:class:`RankResult`: what one probe rank reports, written by the rank as ``rank<R>.json``, read by the probe.
The rank (:mod:`autofit.probe.rank.worker`, or :mod:`autofit.probe.rank.fake`) writes every field, whatever it
measured; the probe (:func:`autofit.probe.run.run_probe`, through :func:`read_rank_result`) reads it back
strictly (:func:`autofit.core.boundary.read_record`), and a file it cannot read as this record makes that
rank an ``error`` that says why, never a rank that measured 0 bytes.

No torch import: the parent reads these.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from autofit.core.boundary import OOM_ON, STATUSES, OomOn, Status, read_record
from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.hardware import Hardware

MODES = ("real", "fake")
"""How a probe runs: ``real`` DeepSpeed steps, or ``fake`` (the model on fake tensors at full size, memory only)."""


@dataclass(frozen=True)
class ProbeSpec:
    """One probe, as its ranks run it (``spec.json``): the workload, the candidate and its DeepSpeed JSON, the
    device, the steps. Built in the parent (:func:`autofit.probe.spec.probe_spec`), so that every value a rank
    needs is decided once, where the plan is."""

    entry: str
    """The workload's entry point (``path.py:function``, ``package.module:function`` or ``hf:…``), which each
    rank loads (:func:`autofit.workload.entry.load_workload`)."""
    config: Config
    """The candidate that runs."""
    hardware: Hardware
    """The device: ``hardware.kind`` picks the backend and the meter; ``memory_bytes`` is the budget."""
    deepspeed: dict[str, Any]
    """The candidate's DeepSpeed JSON (:func:`autofit.ds.emit.deepspeed_config`), as ``deepspeed.initialize``
    gets it, its ``autofit`` section included."""
    nccl_bytes: int = 0
    """CUDA: what NCCL will hold outside the allocator once it connects
    (:func:`autofit.cost_model.cuda_runtime.nccl_buffer_bytes`); the allocator's cap leaves room for it. 0 on
    the CPU."""
    world_size: int = 1
    """Data-parallel ranks the probe runs (fake mode: simulated by one process)."""
    mode: str = "real"
    """``real`` (DeepSpeed steps) or ``fake`` (the model on fake tensors at full size, memory only)."""
    steps: int = 3
    """Measured optimizer steps, >= 1."""
    warmup_steps: int = 1
    """Untimed optimizer steps before them, >= 0."""
    memory_snapshot: str | None = None
    """CUDA: the absolute path rank 0 writes the allocator's history to (:mod:`autofit.probe.snapshot`); None:
    none recorded."""
    result_dir: str = ""
    """Where each rank writes ``rank<R>.json``: set by the launcher (:meth:`launched`), not by the builder."""
    spawn_time: float = 0.0
    """Seconds since the epoch the launcher started the ranks (their ``process_start_s`` counts from it)."""

    def __post_init__(self) -> None:
        self.check(self.mode, self.world_size, self.steps, self.warmup_steps)
        if self.nccl_bytes < 0:
            raise AutofitError(f"probe spec nccl_bytes must be >= 0, but got {self.nccl_bytes!r}")

    @staticmethod
    def check(mode: str, world_size: int, steps: int, warmup_steps: int) -> None:
        """An :class:`AutofitError` naming the first of these a probe cannot run with."""
        if mode not in MODES:
            raise AutofitError(f"probe mode must be real or fake, but got {mode!r}")
        if world_size < 1:
            raise AutofitError(f"world_size must be >= 1, but got {world_size!r}")
        if steps < 1 or warmup_steps < 0:
            raise AutofitError(f"probe needs steps >= 1 and warmup_steps >= 0, but got {steps=}, {warmup_steps=}")

    def budget_bytes(self) -> int | None:
        """The memory watchdog's limit: a CPU device's ``memory_bytes`` in real mode (docs/design.md, "Memory,
        measured"); None where nothing watches (CUDA caps its allocator instead; fake mode allocates nothing)."""
        return self.hardware.memory_bytes if self.hardware.kind == "cpu" and self.mode == "real" else None

    def launched(self, result_dir: str | None = None) -> ProbeSpec:
        """This spec as a launcher hands it on now: ``spawn_time`` now, and ``result_dir`` where given."""
        return replace(self, spawn_time=time.time(), result_dir=self.result_dir if result_dir is None else result_dir)

    def to_json(self) -> dict[str, Any]:
        """Every field by its name; ``config`` as its dict, ``hardware`` as its fields (what :meth:`from_json`
        reads)."""
        return asdict(self) | {"config": self.config.to_dict(), "hardware": asdict(self.hardware)}

    @classmethod
    def from_json(cls, data: object) -> ProbeSpec:
        """The spec :meth:`to_json` wrote; an :class:`AutofitError` names a missing, unknown or mistyped key."""
        return read_record(cls, data, "a probe's spec", {"config": _config_of, "hardware": _hardware_of})


def _config_of(data: object) -> Config:
    if not isinstance(data, dict):
        raise AutofitError(f"a probe's spec: config must be a JSON object, but got {data!r}")
    return Config.from_dict(data)


def _hardware_of(data: object) -> Hardware:
    return read_record(Hardware, data, "a probe's spec: hardware")


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
    warmup_times_s: list[float] = field(default_factory=list)
    """Seconds of each untimed warm-up step, in order (:func:`autofit.probe.rank.steps.run_steps`)."""
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
