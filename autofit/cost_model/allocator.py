"""PyTorch's CUDA caching allocator, one device and one stream, simulated from its source.

What the allocator reserves beyond the live tensors follows from the order of the requests and
a handful of rules, all in ``DeviceCachingAllocator`` of c10/cuda/CUDACachingAllocator.cpp (read at pytorch/pytorch
001074d2; later versions name the oversize rounding limit ``max_non_split_rounding_size``, default ``kLargeBuffer``,
the constant before; PyTorch 2.11's own histories replay to the byte, docs/results/allocator.md).
:class:`CachingAllocator` replays them:

* ``round_size``: a request is rounded up to a multiple of ``kMinBlockSize`` (512 B), or with
  ``roundup_power2_divisions`` set to the next of N divisions between two powers of two
  (``roundup_power2_next_division``);
* ``get_pool``: a rounded size <= ``kSmallSize`` (1 MiB) is served by the small pool, anything larger by the large
  pool; a block never moves between them;
* ``get_free_block``: the smallest free block of the pool that fits, equal sizes by address (``lower_bound`` in a
  ``std::set`` ordered by ``BlockComparatorSize``: stream, size, address); with ``max_split_size`` set, a request
  under it never takes a block at or over it, and one at or over it takes a block less than
  ``max_non_split_rounding_size`` larger;
* ``alloc_block`` / ``get_allocation_size``: where no free block fits, a new segment (``cudaMalloc``): 2 MiB
  (``kSmallBuffer``) for a small request, 20 MiB (``kLargeBuffer``) for a request under ``kMinLargeAlloc`` (10 MiB),
  else the request rounded up to 2 MiB (``kRoundLarge``);
* ``should_split`` / ``alloc_found_block``: the block is cut at the request's size where the rest is at least
  ``kMinBlockSize`` (small pool, or any pool with expandable segments) or more than ``kSmallSize`` (large pool, a
  request under ``max_split_size``); the request gets the front, the rest stays free;
* ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours of the same segment;
* ``emptyCache`` / ``release_cached_blocks`` / ``release_blocks``: every segment that is one free block goes back
  to the device (``cudaFree``); a segment with any block in use stays whole;
* ``expandable_segments:True`` (``ExpandableSegment``, ``try_allocate_expandable_block``, ``map_block``,
  ``unmap_block``): one segment a pool whose address range (``numSegments(total + total / 8)`` pages) is reserved
  once and backed page by page, 2 MiB pages for the small pool and 20 MiB for the large; a request that no free
  block fits maps the fewest pages after the lowest free space that fits it, a free block's whole pages are
  unmapped by ``empty_cache``.

Reserved bytes are what ``torch.cuda.memory_reserved`` counts (segments, or mapped pages); allocated bytes count
blocks, not requests (``stats.allocated_bytes`` grows by ``block->size``). Out of scope: a failed ``cudaMalloc``
(the retries that free cached blocks, ``release_available_cached_blocks``), other streams (``record_stream``'s
deferred frees), CUDA-graph pools and the garbage-collection threshold. A block is named by its address, as the
allocator's data pointer is; where ``cudaMalloc`` puts a segment is the device's choice, given by
``segment_address`` (default :class:`BumpAddresses`: never reused, ascending).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass

from autofit.core.errors import AutofitError

MIB = 2**20
#: kMinBlockSize: every block is a multiple of 512 B
K_MIN_BLOCK_SIZE = 512
#: kSmallSize: the largest request of the small pool, 1 MiB
K_SMALL_SIZE = 1 * MIB
#: kSmallBuffer: a small-pool segment (and an expandable small pool's page), 2 MiB
K_SMALL_BUFFER = 2 * MIB
#: kLargeBuffer: the segment of a large request under kMinLargeAlloc (and an expandable large pool's page), 20 MiB
K_LARGE_BUFFER = 20 * MIB
#: kMinLargeAlloc: large requests from here on get a segment of their own size
K_MIN_LARGE_ALLOC = 10 * MIB
#: kRoundLarge: such a segment is rounded up to 2 MiB
K_ROUND_LARGE = 2 * MIB
#: where :class:`BumpAddresses` starts (any page-aligned address works; this one looks like a CUDA one)
FIRST_ADDRESS = 0x7F00_0000_0000


@dataclass(frozen=True)
class AllocatorSettings:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the simulator follows (CUDAAllocatorConfig)."""

    max_split_size_bytes: int | None = None
    """``max_split_size_mb``: blocks this large or larger are never split; None: unlimited (the default)."""
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    """``max_non_split_rounding_mb``: how much larger than an oversize request a cached block it takes may be."""
    roundup_power2_divisions: int = 0
    """``roundup_power2_divisions``: 0 (off) or a power of two >= 2, for requests of every size."""
    expandable_segments: bool = False
    """``expandable_segments:True``: segments that grow page by page in one reserved address range."""
    device_bytes: int = 80 * 2**30
    """The device's memory: sets an expandable segment's address range (1 1/8 of it); unused otherwise."""

    def __post_init__(self) -> None:
        if self.max_split_size_bytes is not None and self.max_split_size_bytes <= K_LARGE_BUFFER:
            raise AutofitError(f"max_split_size_bytes must be over kLargeBuffer (20 MiB), but got "
                               f"{self.max_split_size_bytes=}")
        divisions = self.roundup_power2_divisions
        if divisions < 0 or divisions == 1 or divisions & (divisions - 1):
            raise AutofitError(f"roundup_power2_divisions must be 0 or a power of two >= 2, but got {divisions=}")
        if self.max_non_split_rounding_bytes < 0 or self.device_bytes <= 0:
            raise AutofitError(f"sizes must be positive, but got {self.max_non_split_rounding_bytes=}, "
                               f"{self.device_bytes=}")

    def max_split(self) -> int | float:
        """The split limit as a number (``std::numeric_limits<size_t>::max()`` when unset)."""
        return float("inf") if self.max_split_size_bytes is None else self.max_split_size_bytes


def round_size(size: int, divisions: int = 0) -> int:
    """``round_size``: the block size a request of ``size`` bytes needs."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * -(-size // K_MIN_BLOCK_SIZE)


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` up to the next of ``divisions`` equal steps between the powers of
    two around it (1200 B in 4 divisions: 1280 B)."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    down = size & ~(step - 1)
    return size if down == size else down + step


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc`` is asked for where no cached block fits ``size``."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)


def should_split(block_bytes: int, size: int, small: bool, settings: AllocatorSettings) -> bool:
    """``should_split``: whether a free block of ``block_bytes`` that serves ``size`` is cut, its rest kept free."""
    remaining = block_bytes - size
    if small or settings.expandable_segments:
        return remaining >= K_MIN_BLOCK_SIZE
    return size < settings.max_split() and remaining > K_SMALL_SIZE


class BumpAddresses:
    """Where ``cudaMalloc`` puts segments, as a stand-in: ascending, page-aligned, never reused. Only the order of
    addresses matters to the allocator (equal sizes are taken lowest address first)."""

    def __init__(self, start: int = FIRST_ADDRESS) -> None:
        self.next_address = start

    def __call__(self, size: int) -> int:
        address = self.next_address
        self.next_address += K_SMALL_BUFFER * -(-size // K_SMALL_BUFFER)
        return address


@dataclass(frozen=True)
class Segment:
    """One segment as ``torch.cuda.memory_snapshot`` lists it (an expandable segment: each mapped range)."""

    address: int
    """Its first byte."""
    small: bool
    """Whether it belongs to the small pool."""
    blocks: tuple[tuple[int, bool], ...]
    """Its blocks in address order: (size in bytes, allocated)."""

    def total_bytes(self) -> int:
        return sum(size for size, _ in self.blocks)


class _Expandable:
    """``ExpandableSegment``: a reserved address range of ``n_pages`` pages, some mapped."""

    __slots__ = ("base", "page", "n_pages")

    def __init__(self, base: int, page: int, n_pages: int) -> None:
        self.base, self.page, self.n_pages = base, page, n_pages

    def covering(self, ptr: int, size: int) -> tuple[int, int]:
        """``map``'s pages: from ``segmentLeft(ptr)`` to ``segmentRight(ptr + size)``."""
        return (ptr - self.base) // self.page, -(-(ptr + size - self.base) // self.page)

    def inside(self, ptr: int, size: int) -> tuple[int, int]:
        """``unmap``'s pages: the whole pages within [ptr, ptr + size)."""
        return -(-(ptr - self.base) // self.page), (ptr + size - self.base) // self.page


class _Block:
    """``Block``: a piece of a segment, free or allocated, linked to its neighbours in the segment."""

    __slots__ = ("ptr", "size", "requested", "allocated", "small", "mapped", "segment", "prev", "next")

    def __init__(self, ptr: int, size: int, small: bool, mapped: bool = True, segment: _Expandable | None = None):
        self.ptr, self.size, self.small, self.mapped, self.segment = ptr, size, small, mapped, segment
        self.requested, self.allocated = 0, False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        """``Block::splice``: put this block between two neighbours."""
        if before is not None:
            before.next = self
        if after is not None:
            after.prev = self
        self.prev, self.next = before, after


class _Pool:
    """``BlockPool``: the free blocks of one pool, ordered by (size, address), and its unmapped ranges by address."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, _Block] = {}
        self.unmapped_keys: list[int] = []
        self.unmapped: dict[int, _Block] = {}

    def insert(self, block: _Block) -> None:
        insort(self.keys, (block.size, block.ptr))
        self.blocks[block.ptr] = block

    def remove(self, block: _Block) -> None:
        del self.keys[bisect_left(self.keys, (block.size, block.ptr))]
        del self.blocks[block.ptr]

    def insert_unmapped(self, block: _Block) -> None:
        insort(self.unmapped_keys, block.ptr)
        self.unmapped[block.ptr] = block

    def remove_unmapped(self, block: _Block) -> None:
        del self.unmapped_keys[bisect_left(self.unmapped_keys, block.ptr)]
        del self.unmapped[block.ptr]


def _expandable_size(block: _Block) -> int:
    """``get_free_block``'s ``expandable_size``: a block's size plus the unmapped range right after it."""
    after = block.next
    return block.size + (after.size if after is not None and not after.mapped else 0)


class CachingAllocator:
    """``DeviceCachingAllocator`` for one device and one stream: ``malloc``, ``free`` and ``empty_cache`` move its
    blocks as the source does, and its counters read as ``torch.cuda.memory_stats`` does."""

    def __init__(self, settings: AllocatorSettings | None = None,
                 segment_address: Callable[[int], int] | None = None) -> None:
        self.settings = settings or AllocatorSettings()
        self._address = segment_address or BumpAddresses()
        self._small, self._large = _Pool(small=True), _Pool(small=False)
        self._live: dict[int, _Block] = {}
        self._bases: list[int] = []
        self._segment_bytes: dict[int, int] = {}
        self._events: list[tuple[str, int, int]] = []
        self.allocated_bytes = self.reserved_bytes = self.requested_bytes = 0
        self.peak_allocated_bytes = self.peak_reserved_bytes = 0
        self.n_segment_allocs = self.n_segment_frees = 0

    @property
    def segment_events(self) -> tuple[tuple[str, int, int], ...]:
        """What the device was asked for, as the allocator's trace names it: (``segment_alloc`` / ``segment_free`` /
        ``segment_map`` / ``segment_unmap``, address, bytes)."""
        return tuple(self._events)

    @property
    def n_segments(self) -> int:
        """Segments held now (``cudaMalloc`` ones and expandable ranges; ``memory_stats``' ``segment.all``)."""
        return len(self._bases)

    def malloc(self, size: int) -> int:
        """``malloc``: a block for a request of ``size`` bytes; returns its address, the block's name."""
        if size <= 0:
            raise AutofitError(f"a request must be at least one byte (torch asks nothing for 0), but got {size=}")
        rounded = round_size(size, self.settings.roundup_power2_divisions)
        pool = self._small if rounded <= K_SMALL_SIZE else self._large
        block = self._free_block(pool, rounded)
        if block is None:
            block = self._new_block(pool, rounded)
        if should_split(block.size, rounded, pool.small, self.settings):
            rest = block
            block = _Block(rest.ptr, rounded, pool.small, segment=rest.segment)
            block.splice(rest.prev, rest)
            rest.ptr, rest.size = rest.ptr + rounded, rest.size - rounded
            pool.insert(rest)
        block.allocated, block.requested = True, size
        self._live[block.ptr] = block
        self.allocated_bytes += block.size
        self.requested_bytes += size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block.ptr

    def free(self, address: int) -> None:
        """``free`` and ``free_block``: the block at ``address`` back to its pool, merged with free neighbours."""
        block = self._live.pop(address, None)
        if block is None:
            raise AutofitError(f"no block is allocated at {address=:#x}")
        block.allocated = False
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        pool = self._small if block.small else self._large
        for neighbour in (block.prev, block.next):
            self._merge(pool, block, neighbour)
        pool.insert(block)

    def empty_cache(self) -> None:
        """``emptyCache`` (``release_cached_blocks``): every whole free segment back to the device, the large
        pool's first; an expandable segment's free whole pages unmapped."""
        for pool in (self._large, self._small):
            self._release_blocks(pool)

    def segments(self) -> tuple[Segment, ...]:
        """The segments held now, by address, each with its blocks (``torch.cuda.memory_snapshot``)."""
        found = [*self._live.values(), *self._small.blocks.values(), *self._large.blocks.values()]
        heads = sorted((b for b in found if b.prev is None or not b.prev.mapped), key=lambda b: b.ptr)
        views = []
        for head in heads:
            blocks: list[tuple[int, bool]] = []
            block: _Block | None = head
            while block is not None and block.mapped:
                blocks.append((block.size, block.allocated))
                block = block.next
            views.append(Segment(head.ptr, head.small, tuple(blocks)))
        return tuple(views)

    def _free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: the smallest free block of ``pool`` that fits (lowest address among equals), under the
        ``max_split_size`` rules; taken out of the pool."""
        index = bisect_left(pool.keys, (size, 0))
        if index == len(pool.keys):
            return None
        block = pool.blocks[pool.keys[index][1]]
        while block.segment is not None and index + 1 < len(pool.keys):
            after = pool.blocks[pool.keys[index + 1][1]]
            if _expandable_size(after) >= _expandable_size(block):
                break  # a segment's free tail counts what it can still map: a smaller block that fits goes first
            index, block = index + 1, after
        limit = self.settings.max_split()
        if size < limit <= block.size:
            return None
        if size >= limit and block.size >= size + self.settings.max_non_split_rounding_bytes:
            return None
        pool.remove(block)
        return block

    def _new_block(self, pool: _Pool, size: int) -> _Block:
        """``alloc_block``: a new segment (``cudaMalloc`` of ``get_allocation_size``), or with expandable segments
        the pages that make room (``try_allocate_expandable_block``)."""
        if self.settings.expandable_segments:
            return self._expandable_block(pool, size)
        nbytes = allocation_size(size)
        ptr = self._take_range(nbytes)
        self._record("segment_alloc", ptr, nbytes, +1)
        return _Block(ptr, nbytes, pool.small)

    def _take_range(self, nbytes: int) -> int:
        """An address for a new segment from ``segment_address``, checked against the segments held."""
        ptr = self._address(nbytes)
        index = bisect_left(self._bases, ptr)
        below = self._bases[index - 1] if index else None
        if (below is not None and below + self._segment_bytes[below] > ptr) or (
                index < len(self._bases) and self._bases[index] < ptr + nbytes):
            raise AutofitError(f"segment_address gave {ptr=:#x} ({nbytes} B), which overlaps a segment held")
        self._bases.insert(index, ptr)
        self._segment_bytes[ptr] = nbytes
        return ptr

    def _record(self, action: str, ptr: int, nbytes: int, sign: int) -> None:
        """A device allocation or release: reserved bytes, their peak, the counters, the event."""
        self.reserved_bytes += sign * nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        if sign > 0:
            self.n_segment_allocs += 1
        else:
            self.n_segment_frees += 1
        self._events.append((action, ptr, nbytes))

    def _merge(self, pool: _Pool, block: _Block, other: _Block | None) -> None:
        """``try_merge_blocks``: ``other``, a free neighbour in the same mapping state, joins ``block`` (which is
        in no pool's set while its address and size change)."""
        if other is None or other.allocated or other.mapped != block.mapped:
            return
        if block.prev is other:
            block.ptr = other.ptr
            block.prev = other.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = other.next
            if block.next is not None:
                block.next.prev = block
        block.size += other.size
        if other.mapped:
            pool.remove(other)
        else:
            pool.remove_unmapped(other)

    def _release_blocks(self, pool: _Pool) -> None:
        """``release_blocks``: each free block that is a whole segment ``cudaFree``d (``release_block``); each free
        block of an expandable segment unmapped (``unmap_block``), the segment released once it is all unmapped."""
        to_unmap = []
        for _, ptr in list(pool.keys):
            block = pool.blocks[ptr]
            if block.segment is not None:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                pool.remove(block)
                self._drop_range(block.ptr)
                self._record("segment_free", block.ptr, block.size, -1)
        for block in to_unmap:
            self._unmap_block(pool, block)
            if block.prev is None and block.next is None:
                pool.remove_unmapped(block)
                self._drop_range(block.ptr)

    def _drop_range(self, ptr: int) -> None:
        del self._bases[bisect_left(self._bases, ptr)]
        del self._segment_bytes[ptr]

    def _expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``try_allocate_expandable_block``: the lowest free space of ``pool``'s expandable segments that fits
        ``size`` (``find_expandable_block``; a new segment where none does), its missing pages mapped."""
        block = self._find_expandable(pool, size)
        if not block.mapped:
            self._map_block(pool, block, min(block.size, size))
        while block.size < size:
            after = block.next
            assert after is not None  # _find_expandable saw the room: free blocks then unmapped pages
            self._map_block(pool, after, min(size - block.size, after.size))
            block = after
        pool.remove(block)
        return block

    def _find_expandable(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the first unmapped range (by address; with the free block before it) from
        which ``size`` bytes of free or unmapped space follow; else a new segment, all of it unmapped."""
        for ptr in pool.unmapped_keys:
            block = pool.unmapped[ptr]
            if block.prev is not None and not block.prev.allocated:
                block = block.prev
            room = 0
            walk: _Block | None = block
            while room < size and walk is not None and not walk.allocated:
                room, walk = room + walk.size, walk.next
            if room >= size:
                return block
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        total = self.settings.device_bytes
        n_pages = -(-(total + total // 8) // page)
        segment = _Expandable(self._take_range(n_pages * page), page, n_pages)
        block = _Block(segment.base, n_pages * page, pool.small, mapped=False, segment=segment)
        pool.insert_unmapped(block)
        return block

    def _map_block(self, pool: _Pool, block: _Block, size: int) -> None:
        """``map_block``: back the pages covering ``block``'s first ``size`` bytes; the rest of its range stays
        unmapped; the mapped part merges with free neighbours and joins the pool."""
        segment = block.segment
        assert segment is not None and not block.mapped
        begin, end = segment.covering(block.ptr, size)
        mapped = (end - begin) * segment.page
        pool.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.ptr + mapped, block.size - mapped, pool.small, mapped=False, segment=segment)
            rest.splice(block, block.next)
            pool.insert_unmapped(rest)
            block.size = mapped
        ptr = block.ptr
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.insert(block)
        self._record("segment_map", ptr, mapped, +1)

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
        """``unmap_block``: give back the whole pages inside the free ``block``; the parts of pages at its ends stay
        mapped free blocks; the unmapped range merges with unmapped neighbours."""
        segment = block.segment
        assert segment is not None
        begin, end = segment.inside(block.ptr, block.size)
        if begin >= end:
            return
        pool.remove(block)
        ptr, nbytes = segment.base + begin * segment.page, (end - begin) * segment.page
        if ptr > block.ptr:
            before = _Block(block.ptr, ptr - block.ptr, pool.small, segment=segment)
            before.splice(block.prev, block)
            pool.insert(before)
        if block.ptr + block.size > ptr + nbytes:
            after = _Block(ptr + nbytes, block.ptr + block.size - ptr - nbytes, pool.small, segment=segment)
            after.splice(block, block.next)
            pool.insert(after)
        block.ptr, block.size, block.mapped = ptr, nbytes, False
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.insert_unmapped(block)
        self._record("segment_unmap", ptr, nbytes, -1)
