"""A recorded allocation history replayed through :class:`~autofit.cost_model.allocator.CachingAllocator`.

PyTorch's allocator records its own events (``torch.cuda.memory._record_memory_history``, read back from
``torch.cuda.memory._snapshot()["device_traces"]``; ``record_trace`` in c10/cuda/CUDACachingAllocator.cpp):

* ``alloc``: a block handed out; its size is the request as made (``orig_size``, before ``round_size``);
* ``free_requested`` / ``free_completed``: a block given back, and its return to the pool (later than the request
  only for a block used on another stream); their size is the request's too;
* ``segment_alloc`` / ``segment_free``: ``cudaMalloc`` / ``cudaFree`` of a segment, its size the segment's
  (``get_allocation_size``); ``segment_map`` / ``segment_unmap`` for expandable segments, the pages' bytes.

:func:`replay` feeds the requests and completed frees to the simulator and sets what it does beside what the real
allocator did. ``empty_cache`` leaves no event of its own: a run of ``segment_free`` events is one call
(``release_cached_blocks`` frees every free segment at once; a failed ``cudaMalloc``'s release is out of scope).
Where a segment goes is the device's choice: with ``recorded_addresses`` a new segment takes the address of the
recorded ``segment_alloc`` just before the request (where its size agrees), so every block's address can be
compared with the recorded one; without, :class:`~autofit.cost_model.allocator.BumpAddresses`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autofit.core.errors import AutofitError
from autofit.cost_model.allocator import AllocatorSettings, BumpAddresses, CachingAllocator

#: the events that give the device memory, and that take it back
GROW = frozenset({"segment_alloc", "segment_map"})
SHRINK = frozenset({"segment_free", "segment_unmap"})
#: where the stand-in addresses start where the recorded ones are used too: far above any the device gives
APART = 1 << 56

Event = tuple[str, int, int]


@dataclass(frozen=True)
class ReplayResult:
    """The simulator's run of a history beside the real allocator's."""

    n_allocs: int
    """Requests replayed."""
    n_frees: int
    """Completed frees replayed."""
    n_empty_cache: int
    """``empty_cache`` calls inferred (runs of segment frees)."""
    n_unknown_frees: int
    """Frees of blocks allocated before the history began (not replayed: the history did not start clean)."""
    peak_reserved_bytes: int
    """The simulator's reserved peak."""
    recorded_peak_reserved_bytes: int
    """The reserved peak the recorded segment events imply (from 0 at the history's start)."""
    end_reserved_bytes: int
    recorded_end_reserved_bytes: int
    peak_allocated_bytes: int
    """The simulator's allocated peak (block sizes, as ``max_memory_allocated``)."""
    n_segment_allocs: int
    """Device allocations (``cudaMalloc`` / maps) the simulator made."""
    recorded_n_segment_allocs: int
    segment_alloc_bytes: int
    recorded_segment_alloc_bytes: int
    n_segment_frees: int
    recorded_n_segment_frees: int
    n_address_mismatches: int | None
    """Requests whose block the simulator put elsewhere than the real allocator (None: stand-in addresses)."""
    first_mismatch_event: int | None
    """The index of the first such event."""

    def reserved_error(self) -> float:
        """(simulated - recorded) / recorded reserved peak."""
        recorded = self.recorded_peak_reserved_bytes
        return (self.peak_reserved_bytes - recorded) / recorded if recorded else 0.0


def history_events(history: Mapping[str, Any]) -> list[Event]:
    """The events of one compacted history (``benchmarks/gpu/gpu_check_grid.py``'s ``compact_history``: parallel
    lists of action index, address, size, stream) as (action, address, size); one stream only."""
    streams = set(history.get("stream", ()))
    if len(streams) > 1:
        raise AutofitError(f"the simulator has one stream, but the history has {len(streams)}: {sorted(streams)}")
    names = history["actions"]
    return [(names[a], int(addr), int(size)) for a, addr, size in zip(history["action"], history["addr"],
                                                                          history["size"], strict=True)]


def recorded_reserved(events: Iterable[Event]) -> tuple[int, int]:
    """(peak, end) of the reserved bytes the segment events imply, counted from 0."""
    reserved = peak = 0
    for action, _, size in events:
        if action in GROW:
            reserved += size
            peak = max(peak, reserved)
        elif action in SHRINK:
            reserved -= size
    return peak, reserved


def replay(events: Sequence[Event], settings: AllocatorSettings | None = None,
           recorded_addresses: bool = True) -> ReplayResult:
    """Replay ``events`` (``alloc`` and ``free_completed``; segment events as above) through a fresh allocator."""
    pending: deque[tuple[int, int]] = deque()
    stand_in = BumpAddresses(APART if recorded_addresses else BumpAddresses().next_address)

    def segment_address(size: int) -> int:
        if pending and pending[0][1] == size:
            return pending.popleft()[0]
        return stand_in(size)

    allocator = CachingAllocator(settings, segment_address if recorded_addresses else stand_in)
    names: dict[int, int] = {}
    counts = {"alloc": 0, "free": 0, "unknown": 0, "empty": 0, "mismatch": 0}
    first_mismatch, previous = None, ""
    for index, (action, address, size) in enumerate(events):
        if action in GROW and recorded_addresses:
            pending.append((address, size))
        elif action in SHRINK and previous not in SHRINK:
            allocator.empty_cache()
            counts["empty"] += 1
        elif action == "alloc":
            names[address] = allocator.malloc(size)
            pending.clear()
            counts["alloc"] += 1
            if names[address] != address:
                counts["mismatch"] += 1
                first_mismatch = index if first_mismatch is None else first_mismatch
        elif action == "free_completed":
            name = names.pop(address, None)
            counts["free" if name is not None else "unknown"] += 1
            if name is not None:
                allocator.free(name)
        previous = action
    return _result(allocator, events, counts, first_mismatch if recorded_addresses else None, recorded_addresses)


def _result(allocator: CachingAllocator, events: Sequence[Event], counts: Mapping[str, int],
            first_mismatch: int | None, recorded_addresses: bool) -> ReplayResult:
    peak, end = recorded_reserved(events)
    grown = [size for action, _, size in events if action in GROW]
    simulated = [size for action, _, size in allocator.segment_events if action in GROW]
    return ReplayResult(
        n_allocs=counts["alloc"], n_frees=counts["free"], n_empty_cache=counts["empty"],
        n_unknown_frees=counts["unknown"], peak_reserved_bytes=allocator.peak_reserved_bytes,
        recorded_peak_reserved_bytes=peak, end_reserved_bytes=allocator.reserved_bytes, recorded_end_reserved_bytes=end,
        peak_allocated_bytes=allocator.peak_allocated_bytes, n_segment_allocs=len(simulated),
        recorded_n_segment_allocs=len(grown), segment_alloc_bytes=sum(simulated), recorded_segment_alloc_bytes=sum(grown),
        n_segment_frees=allocator.n_segment_frees,
        recorded_n_segment_frees=sum(1 for action, _, _ in events if action in SHRINK),
        n_address_mismatches=counts["mismatch"] if recorded_addresses else None, first_mismatch_event=first_mismatch)
