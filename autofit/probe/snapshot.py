"""The winner's CUDA memory snapshot, and what it says about the caching allocator.

Seed 001 ("Memory Debugging") records the allocator's history with
``torch.cuda.memory._record_memory_history()`` and saves it with
``torch.cuda.memory._dump_snapshot("memory.pickle")``; the pickle opens in PyTorch's viewer
(https://pytorch.org/memory_viz: every allocation over time, with the stack that made it). A probe
asked for a snapshot (``run_probe(..., memory_snapshot=PATH)``) records from just before the model is
built through the measured steps, so the picture covers docs/design.md's measured span.

Fragmentation (seeds 001 and 003) shows as memory the caching allocator reserved but no tensor
used at the peak: ``max_memory_reserved`` far above ``max_memory_allocated``. Then the advice is
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (PyTorch's CUDA semantics notes: segments grow in
place instead of leaving split blocks behind), or seed 003's ``max_split_size_mb:128``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: allocation events the history keeps (PyTorch's example value); older ones are dropped
MAX_ENTRIES = 100_000
#: reserved-but-unused bytes at the peak, as a share of reserved, past which the allocator is fragmented
FRAGMENTED_SHARE = 0.2
#: ... and in bytes: a small device or a small model wastes a few MiB to block rounding, which is no news
FRAGMENTED_MIN_BYTES = 512 * 2**20
ALLOC_CONF_ADVICE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def start_recording(torch: Any) -> None:
    """Record every CUDA allocation and free from now on, with its Python and C++ stack."""
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def dump(torch: Any, path: str | Path) -> None:
    """Write the recorded history to ``path`` (a pickle for https://pytorch.org/memory_viz) and stop recording."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)


def fragmentation_advice(device_memory: dict[str, Any]) -> str | None:
    """One line of advice when the allocator reserved far more than the tensors used at the peak, else None.

    ``device_memory``: a CUDA probe's ``max_memory_reserved_bytes`` and ``max_memory_allocated_bytes``
    (:class:`autofit.probe.ProbeResult`); a CPU probe has neither and gets None.
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
