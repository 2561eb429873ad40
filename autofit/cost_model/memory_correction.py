"""How far the memory model misses, learned where it was measured. Pure: no torch, no I/O.

A probe's measured peak over the uncorrected prediction is a *ratio* for that config. One global
ratio (the median of every probe, raised past every out-of-memory budget) lets a miss in one
corner of the space condemn all of it: two OOMs of bf16 + Lion + CPU offload once pruned fp32 SGD
too. The misses of an analytic memory model are not global, though: they come from the terms a
family of configs has (offload buffers, an optimizer's states, a precision's casts, a ZeRO stage's
buckets). So the correction of a config is a kernel-weighted mean of the ratios of the families
measured near it, shrunk toward the global median where nothing near it was measured:

    scale(c) = (W0 * g + sum_F w(c, F) * r_F) / (W0 + sum_F w(c, F)),     w(c, F) = DECAY ** d(c, F)

with ``r_F`` the median ratio of the probes of family ``F``, ``g`` the median of all ok probes,
``d`` the number of :data:`FAMILY_KEYS` on which ``c`` differs from ``F`` (micro-batch and checkpoint
ratio scale the same terms, so they do not count), ``DECAY`` = 0.1 and ``W0`` = 0.1: a peak is
measured to ~1 % (benchmarks/probe/probe_accuracy.py), so one probe of a config's own family outweighs
its neighbours' and the global median ten to one; families, not probes, are weighed (ten probes of
AdamW say no more about SGD than one does).

An out-of-memory probe at budget ``B`` says the true peak of its config is above ``B``: its family
must predict at least ``q = OOM_HEADROOM * B / base`` for it. That lower bound applies in full to its
own family and fades with the same kernel elsewhere: ``scale(c) >= 1 + (q - 1) * DECAY ** d``.

Why a kernel and not per-term corrections fitted over the breakdown: a probe gives one number (the
peak), and the breakdown's parts move together with the micro-batch; a regression over five parts
from a handful of peaks is under-determined, while "near configs miss alike" needs no more data than
it has and reduces to one global scale when every probe is of one family.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autofit.core.config import Config

#: the keys whose values select different memory terms: a config's memory "family"
FAMILY_KEYS = ("precision", "optimizer", "zero_stage", "offload_optimizer", "offload_params", "attention", "compile",
               "tensor_parallel", "hpz_partition_size")
#: weight of a measured family per family key on which it differs from the config being corrected
DECAY = 0.1
#: weight of the global median ratio, against the config's own family's
GLOBAL_WEIGHT = 0.1
#: an OOM at budget B means the true peak is above B: predict at least this much above B for that config
OOM_HEADROOM = 1.02
#: clamp of a correction: beyond it the analytic model is broken, not miscalibrated
SCALE_RANGE = (0.25, 8.0)


def family(config: Config) -> tuple[object, ...]:
    """The values of :data:`FAMILY_KEYS`: configs that share them share every memory term."""
    return tuple(getattr(config, key) for key in FAMILY_KEYS)


def distance(a: tuple[object, ...], b: tuple[object, ...]) -> int:
    """How many family keys differ."""
    return sum(x != y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class MemoryCorrection:
    """The learned ratios of measured to predicted peak, and how they carry to other configs."""

    global_scale: float = 1.0
    """Median measured / uncorrected predicted peak over ok probes (the prior's scale without any)."""
    ratios: tuple[tuple[tuple[object, ...], float], ...] = ()
    """``(family, median ratio of its ok probes)`` of each measured family."""
    oom_bounds: tuple[tuple[tuple[object, ...], float], ...] = ()
    """``(family, q)`` of each out-of-memory probe: its family must predict at least ``q`` x uncorrected."""

    def scale_for(self, config: Config) -> float:
        """The factor on ``config``'s uncorrected peak (see the module docstring)."""
        mine = family(config)
        weights = [(DECAY ** distance(mine, f), r) for f, r in self.ratios]
        total = GLOBAL_WEIGHT + sum(w for w, _ in weights)
        scale = (GLOBAL_WEIGHT * self.global_scale + sum(w * r for w, r in weights)) / total
        for f, q in self.oom_bounds:
            scale = max(scale, 1.0 + (q - 1.0) * DECAY ** distance(mine, f))
        return _clamp(scale)

    def families(self) -> dict[tuple[object, ...], float]:
        """The correction of each measured family (for the report)."""
        seen = {f for f, _ in self.ratios} | {f for f, _ in self.oom_bounds}
        return {f: self.scale_for(_family_config(f)) for f in sorted(seen, key=str)}


def _family_config(values: tuple[object, ...]) -> Config:
    """A config with a family's :data:`FAMILY_KEYS` values (the rest default)."""
    # the values came from family() of a Config, so each is of its field's type: Any lets them through
    fields: dict[str, Any] = dict(zip(FAMILY_KEYS, values, strict=True))
    return Config(**fields)


def fit_correction(
    measured: Sequence[tuple[Config, str, int, int]], base: Callable[[Config], float], prior_scale: float = 1.0,
    fixed: float = 0.0,
) -> MemoryCorrection:
    """The correction from ``(config, status, peak_bytes, budget_bytes)`` probes; ``base(config)`` is the
    uncorrected predicted peak. ok probes give ratios, oom probes lower bounds; others say nothing.

    ``fixed``: an additive term of every peak that the ratio must not scale (CUDA's runtime: context, NCCL's
    buffers, cuBLAS's workspace, :mod:`autofit.cost_model.cuda_runtime`): the ratio is then that of what is
    left, ``(peak - fixed) / (base - fixed)``. 0 (the CPU): the ratio of the whole peaks."""
    by_family: dict[tuple[object, ...], list[float]] = {}
    for c, status, peak, _ in measured:
        if status == "ok" and peak > fixed and base(c) > fixed:
            by_family.setdefault(family(c), []).append((peak - fixed) / (base(c) - fixed))
    all_ratios = [r for rs in by_family.values() for r in rs]
    ratios = tuple((f, statistics.median(rs)) for f, rs in by_family.items())
    bounds = tuple(
        (family(c), OOM_HEADROOM * (budget - fixed) / (base(c) - fixed))
        for c, status, _, budget in measured
        if status == "oom" and budget > fixed and base(c) > fixed
    )
    global_scale = statistics.median(all_ratios) if all_ratios else prior_scale
    return MemoryCorrection(global_scale=_clamp(global_scale), ratios=ratios, oom_bounds=bounds)


def _clamp(scale: float) -> float:
    return min(SCALE_RANGE[1], max(SCALE_RANGE[0], scale))
