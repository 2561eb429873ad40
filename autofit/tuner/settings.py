"""The search's knobs, in one frozen dataclass: what ``autofit run`` exposes and what it keeps fixed."""

from __future__ import annotations

from dataclasses import dataclass

from autofit.core.errors import AutofitError
from autofit.cost_model.budget import DEFAULT_MARGIN, EXACT_PAST_BUDGET, check_margin


@dataclass(frozen=True)
class SearchSettings:
    """How long a search probes, how it stops and how it verifies. Defaults are ``autofit run``'s."""

    trials: int = 20
    """Most search probes of the study (probes an earlier run of the study made count)."""
    timeout_s: float | None = None
    """Wall seconds of this call's search (verification may run past it, once); None: no limit."""
    margin: float = DEFAULT_MARGIN
    """Share of the device memory every candidate must leave free: usable = ``(1 - margin) x`` memory, what
    predictions are judged against and the verified winner's measured peak must stay within
    (:mod:`autofit.cost_model.budget`)."""
    stop_tolerance: float = 0.05
    """The least doubt the stop rule gives a prediction: a candidate predicted within ``1 / (1 + this)`` of
    the best measured may still beat it and is probed."""
    max_stop_tolerance: float = 0.30
    """The stop rule's doubt never grows past this, however poorly the model explains the probes."""
    min_probes: int = 3
    """Probes before the stop rule may end the search: one probe calibrates a scale, not the ranking."""
    probe_steps: int = 5
    """Timed steps of a search probe (their median is the step time): within one probe they agree to a few
    %, and next to the ~7 s of start-up on a CPU five cost little."""
    verify_steps: int = 5
    """Timed steps of a verification probe."""
    probe_timeout_s: float = 300.0
    """Seconds one probe may take for start-up and its steps, before the allowance for slow steps below."""
    probe_seconds: float = 60.0
    """Seconds of timed steps one probe aims for: a config predicted slower than ``probe_seconds / probe_steps``
    a step gets fewer timed steps (a 57 M-parameter model at 8 micro-batches a step is predicted at 19 s a step
    on a 2-core CPU: five such steps and a warm-up overrun the 300 s timeout under load) ..."""
    min_timed_steps: int = 2
    """... but never fewer than this."""
    timeout_slack: float = 3.0
    """A probe may take ``probe_timeout_s`` plus this times its predicted duration (a warm-up and the timed
    steps at the calibrated step time); each probe that timed out before doubles the whole limit ..."""
    max_timeout_doublings: int = 3
    """... at most this many times (a resumed study's old timeouts must not make a probe wait for hours)."""
    min_probe_timeout_s: float = 30.0
    """A probe is never given less than this, even near the overall deadline."""
    memory_band_floor: float = 0.02
    """A candidate predicted past the usable budget by less than the memory model's uncertainty is still
    probed (its measured peak decides): at least the median |error| of benchmarks/accuracy/memory_accuracy.py (~2 %),
    widened to the calibrated model's largest miss on the probes so far, ..."""
    memory_band_cap: float = 0.10
    """... at most this."""
    last_resort_probes: int = 6
    """Probes past ``trials`` the search may make while nothing measured has fit, on the smallest candidate
    of each family not yet measured, before it says nothing fits."""
    outlier_factor: float = 2.0
    """A search probe whose measured / predicted throughput is this far (either way) from the other probes'
    median ratio is measured again before it moves the calibration or the stop rule."""
    max_verifications: int = 3
    """Configs verified before giving up (each a probe)."""
    contenders: int = 3
    """Configs verified together: the best measured and up to two close runners-up."""
    contender_within: float = 0.20
    """A runner-up measured within this of the best is verified too: two probes of one config on a
    shared 2-core machine differ by up to ~25 % (ViT, 5 runs; ResNet mb1x4 SGD 25.1 then 19.8
    samples/s within one search), so one probe cannot separate them."""

    def __post_init__(self) -> None:
        for name in ("trials", "min_probes", "probe_steps", "verify_steps", "min_timed_steps", "max_verifications",
                     "max_timeout_doublings",
                     "contenders"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AutofitError(f"{name} must be an integer >= 1, but got {value!r}")
        object.__setattr__(self, "margin", check_margin(self.margin))
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise AutofitError(f"timeout must be positive, but got {self.timeout_s!r}")
        for name in ("probe_timeout_s", "min_probe_timeout_s", "probe_seconds", "timeout_slack"):
            if not getattr(self, name) > 0:
                raise AutofitError(f"{name} must be positive, but got {getattr(self, name)!r}")
        if not 0.0 <= self.stop_tolerance <= self.max_stop_tolerance:
            raise AutofitError(
                f"stop_tolerance must be within [0, max_stop_tolerance={self.max_stop_tolerance}], "
                f"but got {self.stop_tolerance!r}"
            )
        if not 0.0 <= self.memory_band_floor <= self.memory_band_cap:
            raise AutofitError(
                f"memory_band_floor must be within [0, memory_band_cap={self.memory_band_cap}], "
                f"but got {self.memory_band_floor!r}"
            )
        if not self.memory_band_cap <= EXACT_PAST_BUDGET:  # past it a plan's peaks may be lower bounds
            raise AutofitError(f"memory_band_cap must be at most {EXACT_PAST_BUDGET}, but got {self.memory_band_cap!r}")
        if isinstance(self.last_resort_probes, bool) or not isinstance(self.last_resort_probes, int) \
                or self.last_resort_probes < 0:
            raise AutofitError(f"last_resort_probes must be an integer >= 0, but got {self.last_resort_probes!r}")
        if not self.outlier_factor > 1.0:
            raise AutofitError(f"outlier_factor must be > 1, but got {self.outlier_factor!r}")
        if not 0.0 <= self.contender_within < 1.0:
            raise AutofitError(f"contender_within must be within [0, 1), but got {self.contender_within!r}")
