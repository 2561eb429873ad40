"""The CUDA caching allocator's history, recorded inside a probe rank asked for a memory snapshot.

Seed 001 ("Memory Debugging") records the history with ``torch.cuda.memory._record_memory_history()`` and saves
it with ``torch.cuda.memory._dump_snapshot("memory.pickle")``; the pickle opens in PyTorch's viewer
(https://pytorch.org/memory_viz). The parent side (which probe asks for it, and what the figures say) is
:mod:`autofit.probe.snapshot`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: allocation events the history keeps (PyTorch's example value); older ones are dropped
MAX_ENTRIES = 100_000


def start_recording(torch: Any) -> None:
    """Record every CUDA allocation and free from now on, with its Python and C++ stack."""
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def dump(torch: Any, path: str | Path) -> None:
    """Write the recorded history to ``path`` (a pickle for https://pytorch.org/memory_viz) and stop recording."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
