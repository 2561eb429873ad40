"""The winner's CUDA memory snapshot, and what it says about the caching allocator: the parent's side.

A probe asked for a snapshot (``probe_spec(..., memory_snapshot=PATH)``) records the allocator's history in its
rank (:mod:`autofit.probe.rank.memory_history`, seed 001's ``_record_memory_history`` and ``_dump_snapshot``) from
just before the model is built through the measured steps, so the picture covers docs/design.md's measured span;
the pickle opens in PyTorch's viewer (https://pytorch.org/memory_viz: every allocation over time, with the stack
that made it).

Fragmentation (seeds 001 and 003) shows as memory the caching allocator reserved but no tensor
used at the peak: ``max_memory_reserved`` far above ``max_memory_allocated``. Then the advice is
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (PyTorch's CUDA semantics notes: segments grow in
place instead of leaving split blocks behind), or seed 003's ``max_split_size_mb:128``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec

if TYPE_CHECKING:
    from autofit.core.config import Config
    from autofit.core.hardware import Hardware
    from autofit.core.software import Software
    from autofit.cost_model.facts import ModelFacts
    from autofit.probe.result import ProbeResult

#: reserved-but-unused bytes at the peak, as a share of reserved, past which the allocator is fragmented
FRAGMENTED_SHARE = 0.2
#: ... and in bytes: a small device or a small model wastes a few MiB to block rounding, which is no news
FRAGMENTED_MIN_BYTES = 512 * 2**20
ALLOC_CONF_ADVICE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
#: the snapshot's file name in a report's folder
SNAPSHOT_NAME = "memory_snapshot.pickle"


def fragmentation_advice(device_memory: dict[str, Any]) -> str | None:
    """One line of advice when the allocator reserved far more than the tensors used at the peak, else None.

    ``device_memory``: a CUDA probe's ``max_memory_reserved_bytes`` and ``max_memory_allocated_bytes``
    (:class:`autofit.probe.result.ProbeResult`); a CPU probe has neither and gets None.
    """
    reserved = device_memory.get("max_memory_reserved_bytes")
    allocated = device_memory.get("max_memory_allocated_bytes")
    if not reserved or allocated is None:
        return None
    unused = int(reserved) - int(allocated)
    if unused < FRAGMENTED_MIN_BYTES or unused < FRAGMENTED_SHARE * int(reserved):
        return None
    gib = 2**30
    return (
        f"the allocator reserved {int(reserved) / gib:.2f} GiB at the peak but tensors used {int(allocated) / gib:.2f} GiB "
        f"({unused / int(reserved):.0%} fragmented): set {ALLOC_CONF_ADVICE} (or max_split_size_mb:128) "
        f"and probe again"
    )


def _quiet(line: str) -> None:
    """The default ``say``: progress goes nowhere."""


def winner_snapshot(entry: str, winner: Config, hardware: Hardware, world_size: int, facts: ModelFacts | None,
                    report_dir: str | Path, *, software: Software | None = None,
                    say: Callable[[str], None] = _quiet) -> ProbeResult:
    """Probe the search's winner once more (one measured step, its own subprocess) with the CUDA allocator's
    history recorded into ``report_dir``/:data:`SNAPSHOT_NAME`, on the search's device and world size with its
    traced facts; the probe's result, whose ``device_memory`` the report shows. ``entry``: the workload's entry
    point; ``software``: what the machine runs (``--nvme-path``), this one's by default; ``say``: progress lines,
    the fragmentation advice (:func:`fragmentation_advice`) among them. On a CPU device nothing is recorded
    (``run_probe`` ignores the snapshot there): callers ask for it on CUDA only."""

    path = Path(report_dir) / SNAPSHOT_NAME
    say(f"autofit: recording the winner's CUDA memory snapshot into {path}")
    spec = probe_spec(entry, winner, hardware, world_size, steps=1, software=software, facts=facts,
                      memory_snapshot=path)
    measured = run_probe(spec, timeout_s=300.0)
    advice = fragmentation_advice(measured.device_memory)
    if advice:
        say(f"autofit: {advice}")
    return measured
