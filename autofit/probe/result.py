"""What one probe measured (:class:`ProbeResult`): status, peak memory, step time, per-rank detail; the
JSON of ``autofit probe --json`` and of a search's trials.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from autofit.core.boundary import OOM_ON, STATUSES, OomOn, Status, read_record
from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.cost_model.prediction import PredictionRecord
from autofit.probe.records import MODES

__all__ = ["MODES", "ProbeResult"]


#: a failure status wins over a rank's ``ok``; ``oom`` wins over the errors it causes in its peers
_STATUS_RANK: dict[Status, int] = {"oom": 3, "timeout": 2, "error": 1, "ok": 0}


@dataclass(frozen=True)
class ProbeResult:
    """What one probe measured; :meth:`to_json` is the ``autofit probe`` JSON of docs/design.md, what a search
    stores for each probe and reads back with :meth:`from_json`."""

    config: Config
    """The candidate that ran."""
    status: Status
    """``ok``, ``oom`` (out of device memory, or past the budget on the CPU), ``timeout`` or ``error``."""
    peak_bytes: int
    """Most device memory any rank held, model construction through the measured steps
    (for ``oom``: what was held when it stopped)."""
    step_time_s: float
    """Median seconds of one optimizer step (``grad_accum_steps`` micro-batches); 0.0 when not measured."""
    samples_per_s: float
    """``micro_batch_size x grad_accum_steps x world_size / step_time_s``; 0.0 when not measured."""
    tokens_per_s: float | None
    """``samples_per_s x tokens_per_sample`` when the workload has tokens."""
    message: str | None
    """One line: why it failed, or a note (fake mode)."""
    overhead_s: float
    """Seconds before the first step: process start + imports + model build + ``deepspeed.initialize``, and the
    step that compiles where the config compiles (``phases_s["compile_s"]``): start-up, never step time."""
    per_rank_peak_bytes: list[int] = field(default_factory=list)
    """``peak_bytes`` of each rank, rank order."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Rank 0's overhead by phase: process_start_s, imports_s, model_build_s, initialize_s, steps_s, and where the
    model is compiled compile_s (its first step, within steps_s)."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Fake mode: bytes by category at the peak (params, grads, optimizer, activations, other)."""
    world_size: int = 1
    """Data-parallel ranks the probe ran with."""
    mode: str = "real"
    """``real`` (DeepSpeed steps) or ``fake`` (FakeTensorMode, memory only)."""
    wall_s: float = 0.0
    """Seconds the whole probe took, seen from the caller."""
    predicted: PredictionRecord | None = None
    """The cost model's prediction for this config, filled in by the caller (:meth:`with_predicted`)."""
    step_times_s: list[float] = field(default_factory=list)
    """Every timed step of the slowest rank, in order (their median is ``step_time_s``): taken once the warm-up
    steps settled, as many as it took them to agree (:func:`autofit.probe.rank.steps.run_steps`)."""
    warmup_times_s: list[float] = field(default_factory=list)
    """That rank's untimed warm-up steps, in order: the first step's extra time (the allocator's growth, first
    kernels, autotuning), reported apart from the step time, never averaged into it."""
    optimizer_time_s: float = 0.0
    """Median seconds of the optimizer's ``engine.step`` within one step (the update itself; 0.0 when not
    measured): the search calibrates the optimizer's cost from it apart from forward and backward."""
    device_memory: dict[str, int | None] = field(default_factory=dict)
    """CUDA, rank 0: ``nvml_peak_bytes`` (NVML's per-process peak, None where NVML lists no row for the
    pid), ``max_memory_reserved_bytes`` and ``context_bytes``: the sources of ``peak_bytes``; and
    ``max_memory_allocated_bytes``, the tensors' own peak (reserved far above it: fragmentation,
    :func:`autofit.probe.snapshot.fragmentation_advice`)."""
    oom_on: OomOn | None = None
    """For ``oom``: ``device`` (the GPU, or the budget of a CPU device) or ``host`` (the host's RAM: a CPU
    allocation failed or the kernel's OOM killer ended a rank); None otherwise."""

    per_rank_build_bytes: list[int] = field(default_factory=list)
    """Memory each rank held once the model was built, before ``deepspeed.initialize`` (real mode)."""
    per_rank_initialize_bytes: list[int] = field(default_factory=list)
    """The peak of each rank through ``deepspeed.initialize`` (build included; real mode): where it equals
    the probe's peak, initialization set it, not the steps."""
    launcher: str = "direct"
    """How the ranks were started: ``direct`` (subprocesses of this one) or ``torch.distributed.run``
    (one elastic agent per node, the ranks' c10d rendezvous)."""
    per_rank_param_elements: list[int] = field(default_factory=list)
    """Parameter elements each rank held once the model was built: its partition under ZeRO-3 (zero.Init)."""
    optimizer_state_bytes: int = 0
    """Rank 0's optimizer state tensors after the measured steps (each storage once; real mode): what the
    cost model's ``optimizer_state_bytes`` prices for that rank's shard."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise AutofitError(f"probe status must be one of {', '.join(STATUSES)}, but got {self.status!r}")
        if self.oom_on is not None and self.oom_on not in OOM_ON:
            raise AutofitError(f"oom_on must be device, host or None, but got {self.oom_on!r}")

    @property
    def fits(self) -> bool:
        return self.status == "ok"

    def with_predicted(self, predicted: PredictionRecord | None) -> ProbeResult:
        return replace(self, predicted=predicted)

    def to_json(self) -> dict[str, Any]:
        """Every field by its name; ``config`` as its dict, ``predicted`` as its JSON, ``{}`` when there is none."""
        out = asdict(self)
        out["config"] = self.config.to_dict()
        out["predicted"] = self.predicted.to_json() if self.predicted is not None else {}
        return out

    @classmethod
    def from_json(cls, data: object) -> ProbeResult:
        """The result :meth:`to_json` wrote (``predicted: {}`` reads as None); an :class:`AutofitError` names a
        missing, unknown or mistyped key."""
        return read_record(cls, data, "a probe result", {"config": _config_of, "predicted": _predicted_of})


def _config_of(data: object) -> Config:
    if not isinstance(data, dict):
        raise AutofitError(f"a probe result: config must be a JSON object, but got {data!r}")
    return Config.from_dict(data)


def _predicted_of(data: object) -> PredictionRecord | None:
    if not isinstance(data, dict):
        raise AutofitError(f"a probe result: predicted must be a JSON object, but got {data!r}")
    return PredictionRecord.from_json(data, "a probe result: predicted") if data else None
