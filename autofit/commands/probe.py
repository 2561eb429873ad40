"""``autofit probe``: run one candidate (the fastest predicted that fits, after ``--set``) for a few real steps.

The command calls :func:`probe_target` with the :class:`Target` its options make and prints the
:class:`ProbeAnswer` (docs/design.md, "JSON output": ``autofit probe --json``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autofit.commands.options import quiet
from autofit.core.software import Software
from autofit.cost_model import ModelFacts, Prediction
from autofit.planning.estimate import Candidate
from autofit.planning.estimate import estimate as price_candidates
from autofit.planning.target import Setup, Target, prepare
from autofit.probe.ops import prepare_ops
from autofit.probe.result import ProbeResult
from autofit.probe.run import run_probe
from autofit.probe.snapshot import fragmentation_advice
from autofit.probe.spec import probe_spec


@dataclass(frozen=True)
class ProbeAnswer:
    """What ``autofit probe`` answers: the probe's measurement and the cost model's prediction of the same
    candidate."""

    measured: ProbeResult
    """The probe (:func:`autofit.probe.run.run_probe`)."""
    predicted: Prediction
    """The candidate's prediction."""

    @property
    def ok(self) -> bool:
        """Whether the probe ran its steps (else the command exits 2)."""
        return self.measured.status == "ok"

    def result(self) -> ProbeResult:
        """The probe with the candidate's prediction beside it."""
        return self.measured.with_predicted(self.predicted.record())

    def to_dict(self) -> dict[str, Any]:
        """``autofit probe --json``'s document: the probe's JSON with ``predicted``."""
        return self.result().to_json()


def probe_target(target: Target, *, mode: str = "real", steps: int = 3, warmup: int = 1, timeout_s: float = 600.0,
                 snapshot_path: str | None = None, say: Callable[[str], None] = quiet) -> ProbeAnswer:
    """``autofit probe``: price the space, then probe its fastest candidate predicted to fit (the fastest of all
    where none fits) in ``mode`` (``real``: DeepSpeed steps on the device; ``fake``: the model on fake tensors,
    memory only); ``snapshot_path``: CUDA, the allocator's history recorded there."""
    setup = prepare(target, probes_here=True)
    if mode == "real":
        setup.check_nodes()  # nodes that cannot be placed: one line before the trace and the ops
    result = price_candidates(setup.plan())
    chosen = (result.fitting or result.candidates)[0]
    software = built_ops(chosen, setup, say) if mode == "real" else setup.software
    say(f"probing {chosen.config.label()} ({mode})")
    measured = measure(setup, chosen, result.facts, software, mode=mode, steps=steps, warmup=warmup,
                       timeout_s=timeout_s, snapshot_path=snapshot_path)
    advice = fragmentation_advice(measured.device_memory)
    if advice:
        say(f"autofit: {advice}")
    return ProbeAnswer(measured, chosen.prediction)


def built_ops(chosen: Candidate, setup: Setup, say: Callable[[str], None]) -> Software:
    """Build or load the DeepSpeed ops ``chosen`` needs, as its own step (not in the probe's time); the setup's
    software with the failed builds marked (AdamW runs as ``torch_adam`` where FusedAdam failed)."""
    report = prepare_ops([chosen.config], setup.hardware, setup.software)
    for line in report.lines():
        say(line)
    return report.software(setup.software)


def measure(setup: Setup, chosen: Candidate, facts: ModelFacts | None, software: Software, *, mode: str, steps: int,
            warmup: int, timeout_s: float, snapshot_path: str | None) -> ProbeResult:
    """The one probe of ``chosen`` (:func:`autofit.probe.run.run_probe`); ``facts``: the traced model's, for the
    DeepSpeed buckets its JSON sizes."""
    spec = probe_spec(setup.entry_point, chosen.config, setup.hardware, setup.world_size, mode=mode, steps=steps,
                      warmup_steps=warmup, software=software, facts=facts, memory_snapshot=snapshot_path)
    return run_probe(spec, timeout_s=timeout_s, hosts=setup.hosts)
