"""Fit the cost model's :class:`Coefficients` to probe results. Pure: no torch, no I/O.

A probe measures a step time and a peak; the analytic model predicted both from
coefficients it could only guess (how close a kernel gets to the datasheet, what
the runtime holds). Each function here takes observations and returns refined
coefficients, so the next prediction is closer and the search probes better.

Time. The step-time model of :mod:`autofit.cost_model.time` is linear in a few
reciprocal coefficients::

    t = W / eff[dtype] + M * micro_batch_overhead_s + S * step_overhead_s
        + B / optimizer_bytes_per_s + R

with ``W`` the FLOPs over the datasheet FLOP/s (seconds at 100 % efficiency),
``M`` the micro-batches per step, ``S`` = 1, ``B`` the optimizer bytes touched
and ``R`` everything else (communication, offload, and on CUDA the kernels that do no matmul, priced at
the prior's bandwidth: :attr:`Coefficients.memory_bound_bytes_per_s` is not fitted). A probe also times the
optimizer's own ``engine.step`` apart: then only forward and backward (``W, M, R``)
are fitted here, against the step less the update, and the update is the
optimizer's factor below. :func:`time_terms` reads
``W, M, S, B, R`` off the model itself by finite differences (the model is
linear in each, so one difference per coefficient is exact), which keeps this
module correct whatever the time formulas become. :func:`fit_time` then solves
the least-squares problem in relative residuals (each probe weighs the same
whatever its step time), with a ridge pull toward the prior so that a single
probe moves mostly the term that dominates it, and non-negativity. Dtypes no
probe has measured move with the measured ones (the same ratio to their prior):
a CPU is not assumed to have fast bf16, nor slow, until one bf16 probe says so.
``overlap_efficiency`` (how much of the compute beside a collective hides it) is
not linear in the step time: :func:`fit_overlap` searches it on a grid, after the rest.
A last factor per optimizer (:attr:`Calibration.time_factors`) scales the optimizer
step alone (update + per-step bookkeeping), measured / predicted: what a bandwidth
formula cannot know (a bitsandbytes or Python optimizer on a CPU). An optimizer no
probe has run moves with the measured ones (their geometric mean), as dtypes do.

Memory. :func:`fit_memory` learns a correction of the predicted peak family by family
(:mod:`autofit.cost_model.memory_correction`): a probe's measured / predicted ratio corrects its
own family (precision, optimizer, ZeRO stage, offload, attention) and, fading with distance, its
neighbours, shrunk toward the median of all probes where a family has none; an out-of-memory probe
raises its own family past its budget, not the whole space.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from autofit.core.boundary import Status, as_status
from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.cost_model import Coefficients, ModelFacts, Prediction, predict
from autofit.cost_model.coefficients import MAX_EFFICIENCY
from autofit.cost_model.cuda_runtime import learned_outside_allocator_bytes, runtime_bytes
from autofit.cost_model.memory_correction import MemoryCorrection, fit_correction

#: clamp of a fitted compute efficiency (achieved / datasheet FLOP/s; above 1 where the datasheet undersells the
#: device, :data:`~autofit.cost_model.coefficients.MAX_EFFICIENCY`)
EFFICIENCY_RANGE = (1e-5, MAX_EFFICIENCY)
#: clamp of the factor on one optimizer's update time
TIME_FACTOR_RANGE = (0.02, 50.0)
#: weight of the pull toward the prior (u = 1), against one probe's relative residual: small, so it only
#: decides what the probes leave open (with one probe: the least change, spread by term size)
RIDGE = 1e-3

Predictor = Callable[[Config, ModelFacts, Hardware, int, Coefficients], Prediction]


@dataclass(frozen=True)
class Observation:
    """One finished probe, as calibration sees it."""

    config: Config
    """What ran."""
    status: Status
    """``ok``, ``oom``, ``timeout`` or ``error`` (ok and oom carry information; a timeout, a bound on the step)."""
    peak_bytes: int
    """Measured peak (for oom: what was held when it stopped)."""
    step_time_s: float
    """Measured seconds per optimizer step (0.0 unless ok)."""
    budget_bytes: int
    """The memory budget the probe ran under (what an oom ran out of)."""
    optimizer_time_s: float = 0.0
    """Measured seconds of the optimizer update within that step (0.0 when not timed apart)."""
    time_lower_bound_s: float = 0.0
    """For a timeout: the least one step can have taken (the probe's time less its start-up, over the steps it
    did not finish); 0.0 otherwise or when unknown."""
    outside_allocator_bytes: int | None = None
    """CUDA: what the probe held outside the caching allocator at its peak (NVML's peak less
    ``max_memory_reserved``, :func:`autofit.cost_model.cuda_runtime.measured_outside_allocator_bytes`); None
    where not measured (the CPU, NVML without per-process rows)."""

    @property
    def split(self) -> bool:
        """Whether the update was timed apart from forward and backward."""
        return self.status == "ok" and 0.0 < self.optimizer_time_s < self.step_time_s

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Observation:
        return cls(
            config=Config.from_dict(data["config"]),
            status=as_status(data["status"]),
            peak_bytes=int(data.get("peak_bytes", 0)),
            step_time_s=float(data.get("step_time_s", 0.0)),
            budget_bytes=int(data.get("budget_bytes", 0)),
            optimizer_time_s=float(data.get("optimizer_time_s", 0.0)),
            time_lower_bound_s=float(data.get("time_lower_bound_s", 0.0)),
            outside_allocator_bytes=(int(data["outside_allocator_bytes"])
                                     if data.get("outside_allocator_bytes") is not None else None),
        )


@dataclass(frozen=True)
class TimeTerms:
    """The step-time model of one config, linear in the calibrated reciprocals."""

    dtype: str
    """Compute dtype whose efficiency scales ``work_s``."""
    work_s: float
    """``W``: compute seconds at 100 % efficiency."""
    n_micro: float
    """``M``: multiplies ``micro_batch_overhead_s``."""
    n_steps: float
    """``S``: multiplies ``step_overhead_s``."""
    optimizer_bytes: float
    """``B``: divided by ``optimizer_bytes_per_s``."""
    rest_s: float
    """``R``: seconds no calibrated coefficient touches."""


@dataclass(frozen=True)
class Calibration:
    """Coefficients fitted from probes, plus a residual time factor per optimizer."""

    coefficients: Coefficients
    """What :func:`autofit.cost_model.predict` takes."""
    time_factors: dict[str, float] = field(default_factory=dict)
    """Optimizer -> measured / fitted-predicted optimizer step, for the optimizers probes ran."""
    default_time_factor: float = 1.0
    """The factor of an optimizer no probe ran: the geometric mean of ``time_factors``."""
    n_observations: int = 0
    """Probes the fit used (ok and oom)."""
    memory: MemoryCorrection | None = None
    """The memory correction by family; None: ``coefficients.memory_scale`` everywhere."""

    def predict(
        self, config: Config, facts: ModelFacts, hardware: Hardware, world_size: int, predictor: Predictor = predict
    ) -> Prediction:
        """The cost model's prediction with the fitted coefficients, the memory correction of ``config``'s
        family and the optimizer's factor applied."""
        coefficients = self.coefficients
        if self.memory is not None:
            coefficients = coefficients.with_(memory_scale=self.memory.scale_for(config))
        prediction = predictor(config, facts, hardware, world_size, coefficients)
        factor = self.time_factors.get(config.optimizer, self.default_time_factor)
        update_s = prediction.time_breakdown.get("optimizer", 0.0)
        if factor == 1.0 or update_s <= 0.0:
            return prediction
        step = prediction.step_time_s + (factor - 1.0) * update_s
        speedup = prediction.step_time_s / step
        return replace(
            prediction,
            step_time_s=step,
            samples_per_s=prediction.samples_per_s * speedup,
            tokens_per_s=prediction.tokens_per_s * speedup if prediction.tokens_per_s is not None else None,
            time_breakdown=prediction.time_breakdown | {"optimizer": factor * update_s},
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "coefficients": self.coefficients.to_dict(),
            "time_factors": dict(self.time_factors),
            "default_time_factor": self.default_time_factor,
            "n_observations": self.n_observations,
            "memory_scale_by_family": {
                "/".join(map(str, f)): scale for f, scale in (self.memory.families() if self.memory else {}).items()
            },
        }


def compute_dtype(config: Config, hardware: Hardware) -> str:
    """The dtype whose efficiency prices ``config`` (as :mod:`autofit.cost_model.time` picks it)."""
    return config.precision if config.precision in hardware.peak_flops else "fp32"


def time_terms(
    config: Config,
    facts: ModelFacts,
    hardware: Hardware,
    world_size: int,
    coefficients: Coefficients,
    predictor: Predictor = predict,
) -> TimeTerms:
    """``W, M, S, B, R`` of ``config``, read off the model by one finite difference per coefficient."""
    dtype = compute_dtype(config, hardware)
    c0 = coefficients
    eff0 = c0.efficiency(dtype)

    def t(c: Coefficients) -> float:
        return predictor(config, facts, hardware, world_size, c).step_time_s

    t0 = t(c0)
    # t is linear in 1/eff: halving eff adds exactly W / eff0
    half = dict(c0.compute_efficiency) | {dtype: eff0 / 2}
    work_s = max(0.0, (t(c0.with_(compute_efficiency=half)) - t0) * eff0)
    n_micro = max(0.0, t(c0.with_(micro_batch_overhead_s=c0.micro_batch_overhead_s + 1.0)) - t0)
    n_steps = max(0.0, t(c0.with_(step_overhead_s=c0.step_overhead_s + 1.0)) - t0)
    opt0 = c0.optimizer_bytes_per_s
    optimizer_bytes = max(0.0, (t(c0.with_(optimizer_bytes_per_s=opt0 / 2)) - t0) * opt0)
    rest_s = t0 - work_s / eff0 - n_micro * c0.micro_batch_overhead_s - n_steps * c0.step_overhead_s
    rest_s -= optimizer_bytes / opt0
    return TimeTerms(dtype, work_s, n_micro, n_steps, optimizer_bytes, max(0.0, rest_s))


def fit_time(
    observations: Sequence[Observation],
    facts: ModelFacts,
    hardware: Hardware,
    world_size: int,
    prior: Coefficients,
    predictor: Predictor = predict,
) -> Coefficients:
    """Least squares of the measured step times over ``1/eff[dtype]``, the overheads and ``1/optimizer_bytes_per_s``.

    Unknowns are scaled by their prior (``u = value / prior``), rows by the measured
    time: minimise ``sum_i ((sum_j a_ij u_j + R_i) / t_i - 1)^2 + RIDGE^2 sum_j (u_j - 1)^2``
    subject to ``u_j >= 0`` (active set: a negative unknown is pinned at 0 and the rest refitted).
    Then timeouts bound the dtypes no probe measured (:func:`slower_where_timed_out`).
    """
    ok = [o for o in observations if o.status == "ok" and o.step_time_s > 0]
    fitted = _fit_measured(ok, facts, hardware, world_size, prior, predictor) if ok else prior
    measured_dtypes = {compute_dtype(o.config, hardware) for o in ok}
    timeouts = [o for o in observations if o.status == "timeout" and o.time_lower_bound_s > 0
                and compute_dtype(o.config, hardware) not in measured_dtypes]
    return slower_where_timed_out(fitted, timeouts, facts, hardware, world_size, predictor)


def slower_where_timed_out(
    coefficients: Coefficients,
    timeouts: Sequence[Observation],
    facts: ModelFacts,
    hardware: Hardware,
    world_size: int,
    predictor: Predictor = predict,
) -> Coefficients:
    """A timed-out probe is a censored measurement: its step took at least ``time_lower_bound_s``. Where the
    model predicts it faster, its compute dtype's efficiency is lowered just enough (the least change that
    honours the bound). :func:`fit_time` passes only the timeouts of dtypes no ok probe measured: there the
    timeout is the only word on the dtype (bf16 emulated by a CPU), while a timeout beside measured steps of
    its dtype says more of the machine's load or of that one config than of the dtype."""
    for obs in sorted(timeouts, key=lambda o: -o.time_lower_bound_s):
        term = time_terms(obs.config, facts, hardware, world_size, coefficients, predictor)
        predicted = predictor(obs.config, facts, hardware, world_size, coefficients).step_time_s
        short = obs.time_lower_bound_s - predicted
        if short <= 0 or term.work_s <= 0:
            continue
        slower = term.work_s / (term.work_s / coefficients.efficiency(term.dtype) + short)
        efficiency = dict(coefficients.compute_efficiency) | {term.dtype: _clamp(slower, *EFFICIENCY_RANGE)}
        coefficients = coefficients.with_(compute_efficiency=efficiency)
    return coefficients


def _fit_measured(
    ok: Sequence[Observation],
    facts: ModelFacts,
    hardware: Hardware,
    world_size: int,
    prior: Coefficients,
    predictor: Predictor,
) -> Coefficients:
    """:func:`fit_time`'s least squares over the probes that ran (``ok``, not empty)."""
    import numpy as np

    terms = [time_terms(o.config, facts, hardware, world_size, prior, predictor) for o in ok]
    dtypes = sorted({t.dtype for t in terms})
    names = [f"eff:{d}" for d in dtypes] + ["micro_batch_overhead_s", "step_overhead_s", "optimizer"]
    prior_values = [1.0 / prior.efficiency(d) for d in dtypes] + [
        prior.micro_batch_overhead_s,
        prior.step_overhead_s,
        1.0 / prior.optimizer_bytes_per_s,
    ]
    # an unknown whose prior is 0 (no overhead assumed) is scaled by a small nominal value instead
    scales = [v if v > 0 else 1e-3 for v in prior_values]
    n = len(names)
    rows, rhs = [], []
    for obs, term in zip(ok, terms, strict=True):
        compute = [0.0] * n
        compute[dtypes.index(term.dtype)] = term.work_s
        compute[n - 3] = term.n_micro
        update = [0.0] * n
        update[n - 2], update[n - 1] = term.n_steps, term.optimizer_bytes
        if obs.split:  # forward + backward against the step less the update (the update is its optimizer's)
            a, measured = compute, obs.step_time_s - obs.optimizer_time_s
        else:
            a, measured = [c + u for c, u in zip(compute, update, strict=True)], obs.step_time_s
        rows.append([a_j * s_j / measured for a_j, s_j in zip(a, scales, strict=True)])
        rhs.append((measured - term.rest_s) / measured)
    for j in range(n):
        # pull toward the prior value (u_j = prior/scale: 1 for a positive prior, 0 for a zero one)
        row = [0.0] * n
        row[j] = RIDGE
        rows.append(row)
        rhs.append(RIDGE * prior_values[j] / scales[j])
    u = _nonnegative_lstsq(np.asarray(rows), np.asarray(rhs))
    return _fitted_coefficients([float(u_j * s_j) for u_j, s_j in zip(u, scales, strict=True)], dtypes, prior)


def _fitted_coefficients(values: list[float], dtypes: list[str], prior: Coefficients) -> Coefficients:
    """The solved unknowns of :func:`fit_time` (``1/eff`` per measured dtype, the two overheads,
    ``1/optimizer_bytes_per_s``) as coefficients; unmeasured dtypes keep their prior ratio to the measured
    ones (the geometric mean of the measured dtypes' moves)."""
    n = len(values)
    fitted: dict[str, float] = {}
    for d, inv in zip(dtypes, values[: len(dtypes)], strict=True):
        fitted[d] = _clamp(1.0 / inv if inv > 0 else EFFICIENCY_RANGE[1], *EFFICIENCY_RANGE)
    moves = [math.log(fitted[d] / prior.efficiency(d)) for d in dtypes]
    move = math.exp(sum(moves) / len(moves))
    efficiency = {
        d: fitted.get(d, _clamp(prior.efficiency(d) * move, *EFFICIENCY_RANGE)) for d in prior.compute_efficiency
    }
    inv_opt = values[n - 1]
    return prior.with_(
        compute_efficiency=efficiency,
        micro_batch_overhead_s=max(0.0, values[n - 3]),
        step_overhead_s=max(0.0, values[n - 2]),
        optimizer_bytes_per_s=1.0 / inv_opt if inv_opt > 0 else prior.optimizer_bytes_per_s * 1e3,
    )


#: the overlap efficiencies :func:`fit_overlap` tries
OVERLAP_GRID = tuple(i / 20 for i in range(21))


def fit_overlap(
    observations: Sequence[Observation],
    facts: ModelFacts,
    hardware: Hardware,
    world_size: int,
    prior: Coefficients,
    predictor: Predictor = predict,
) -> Coefficients:
    """``overlap_efficiency`` from the probes whose predicted step time depends on it (communication that
    DeepSpeed overlaps: several ranks, a device with streams): the value of :data:`OVERLAP_GRID` with the least
    squared relative error of the step times, the others fitted already. The step time is not linear in it
    (``max`` of compute and communication), hence a search over the grid rather than a column of
    :func:`fit_time`'s least squares. No such probe: the prior's value stands."""
    ok = [o for o in observations if o.status == "ok" and o.step_time_s > 0]

    def step(o: Observation, value: float) -> float:
        return predictor(o.config, facts, hardware, world_size, prior.with_(overlap_efficiency=value)).step_time_s

    telling = [o for o in ok if step(o, 0.0) != step(o, 1.0)]
    if not telling:
        return prior

    def loss(value: float) -> float:
        return sum((step(o, value) / o.step_time_s - 1.0) ** 2 for o in telling)

    return prior.with_(overlap_efficiency=min(OVERLAP_GRID, key=lambda v: (loss(v), abs(v - prior.overlap_efficiency))))


def fit_memory(
    observations: Sequence[Observation],
    facts: ModelFacts,
    hardware: Hardware,
    world_size: int,
    prior: Coefficients,
    predictor: Predictor = predict,
) -> MemoryCorrection:
    """The memory correction learned from ok and oom probes, family by family (:mod:`.memory_correction`); on
    CUDA the ratio is fitted to the peak less the additive runtime term, which is not a ratio
    (:func:`autofit.cost_model.cuda_runtime.runtime_bytes`)."""
    unscaled = prior.with_(memory_scale=1.0)

    def base(config: Config) -> float:
        return float(predictor(config, facts, hardware, world_size, unscaled).peak_bytes)

    measured = [(o.config, o.status, o.peak_bytes, o.budget_bytes) for o in observations]
    fixed = runtime_bytes(hardware, world_size, prior.outside_allocator_bytes)
    return fit_correction(measured, base, prior.memory_scale, fixed)


def fit_runtime(observations: Sequence[Observation], hardware: Hardware, prior: Coefficients) -> Coefficients:
    """CUDA: ``prior`` with the outside-allocator offset the probes measured (their median; the first probe's
    alone until there are more); the prior's where none measured it, and on the CPU."""
    if hardware.kind != "cuda":
        return prior
    learned = learned_outside_allocator_bytes(
        [o.outside_allocator_bytes for o in observations if o.status in ("ok", "oom")])
    return prior if learned is None else prior.with_(outside_allocator_bytes=learned)


def fit_time_factors(
    observations: Sequence[Observation],
    facts: ModelFacts,
    hardware: Hardware,
    world_size: int,
    coefficients: Coefficients,
    predictor: Predictor = predict,
) -> dict[str, float]:
    """Optimizer -> median of measured / predicted update time with the fitted coefficients, clamped.

    The measured optimizer step is the probe's own timing of ``engine.step`` at the accumulation
    boundary; a probe without it (an older study) leaves the step less the predicted forward and backward.
    """
    by_optimizer: dict[str, list[float]] = {}
    for o in observations:
        if o.status != "ok" or o.step_time_s <= 0:
            continue
        prediction = predictor(o.config, facts, hardware, world_size, coefficients)
        update_s = prediction.time_breakdown.get("optimizer", 0.0)
        if update_s <= 0:
            continue
        if o.split:
            measured = o.optimizer_time_s
        else:
            measured = o.step_time_s - (prediction.step_time_s - update_s)
        by_optimizer.setdefault(o.config.optimizer, []).append(measured / update_s)
    return {k: _clamp(statistics.median(v), *TIME_FACTOR_RANGE) for k, v in by_optimizer.items()}


def calibrate(
    observations: Sequence[Observation],
    facts: ModelFacts,
    hardware: Hardware,
    world_size: int,
    prior: Coefficients | None = None,
    predictor: Predictor = predict,
) -> Calibration:
    """Everything probes say, in one :class:`Calibration` (time, then memory, then residual factors)."""
    prior = fit_runtime(observations, hardware, prior or Coefficients.for_hardware(hardware))
    coefficients = fit_time(observations, facts, hardware, world_size, prior, predictor)
    coefficients = fit_overlap(observations, facts, hardware, world_size, coefficients, predictor)
    memory = fit_memory(observations, facts, hardware, world_size, coefficients, predictor)
    coefficients = coefficients.with_(memory_scale=memory.global_scale)
    factors = fit_time_factors(observations, facts, hardware, world_size, coefficients, predictor)
    default = math.exp(statistics.fmean(math.log(f) for f in factors.values())) if factors else 1.0
    used = sum(1 for o in observations if o.status in ("ok", "oom"))
    return Calibration(
        coefficients=coefficients, time_factors=factors, default_time_factor=default, n_observations=used, memory=memory
    )


def _nonnegative_lstsq(a: Any, b: Any) -> Any:
    """``argmin |a x - b|`` with ``x >= 0``, by pinning negative unknowns at 0 until none is left."""
    import numpy as np

    free = np.ones(a.shape[1], dtype=bool)
    x = np.zeros(a.shape[1])
    for _ in range(a.shape[1] + 1):
        x = np.zeros(a.shape[1])
        if free.any():
            x[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        negative = x < 0
        if not negative.any():
            return x
        free &= ~negative
    return np.clip(x, 0.0, None)


def _clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


__all__ = [
    "Calibration",
    "Observation",
    "TimeTerms",
    "calibrate",
    "fit_memory",
    "fit_runtime",
    "fit_overlap",
    "fit_time",
    "fit_time_factors",
    "slower_where_timed_out",
    "time_terms",
]
