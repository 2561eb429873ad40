"""What a plan leaves out before tracing and pricing it because a twin of it is never worse
(:func:`without_dominated_attention`), and the trace that brings it back where the twin cannot run the model
(:func:`traced_beside_sdpa`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.cost_model.facts import ModelFacts
from autofit.trace.step import NoKernelRuns

#: what completes a trace for some configs (:func:`autofit.planning.plan.completed_facts` of one workload and device):
#: the configs, a trace made earlier (or None) and what to call before tracing
Complete = Callable[[tuple[Config, ...], ModelFacts | None, Callable[[int], None] | None], ModelFacts]
Rejected = list[tuple[dict[str, Any], str]]


def traced_beside_sdpa(complete: Complete, configs: tuple[Config, ...], hardware: Hardware,
                       facts: ModelFacts | None, before_tracing: Callable[[int], None] | None
                       ) -> tuple[ModelFacts, tuple[Config, ...], Rejected]:
    """The facts of ``configs`` less those :func:`without_dominated_attention` leaves out, those configs and the
    rejection; where their SDPA cannot run the model (nothing then stands in for eager), the facts of all
    ``configs``, and no rejection."""
    searched, dominated = without_dominated_attention(configs, hardware)
    traced: ModelFacts | None
    try:
        traced = complete(searched, facts, before_tracing)
        if not dominated or "sdpa" not in traced.untraced_kernels:
            return traced, searched, dominated
    except NoKernelRuns:  # no kernel but eager left to run the model
        if not dominated:
            raise
        traced = facts
    return complete(configs, traced, None), configs, []


#: why eager attention is not a candidate of a CUDA plan that has SDPA (:func:`without_dominated_attention`)
EAGER_BESIDE_SDPA = ("attention=eager is not searched beside sdpa on CUDA: SDPA computes the same attention, with a "
                     "fused kernel (flash, memory-efficient, cuDNN) where one takes the call and with eager's own "
                     "math where none does, so it never holds more memory or takes longer (--set attention=eager "
                     "plans eager)")


def without_dominated_attention(configs: tuple[Config, ...], hardware: Hardware
                                ) -> tuple[tuple[Config, ...], Rejected]:
    """``configs`` less those with eager attention where the device is CUDA and SDPA is among the kernels, and one
    rejection saying why (:data:`EAGER_BESIDE_SDPA`): each eager config has an SDPA twin that is never worse, so
    tracing and pricing it buys nothing. On a CPU, where
    PyTorch's SDPA runs its own flash kernel or eager's math at the CPU's speed, eager stays a candidate."""
    if hardware.kind != "cuda" or not {"eager", "sdpa"} <= {c.attention for c in configs}:
        return configs, []
    return tuple(c for c in configs if c.attention != "eager"), [({"attention": "eager"}, EAGER_BESIDE_SDPA)]
