"""The caching allocator's simulator: each rule of c10/cuda/CUDACachingAllocator.cpp on a few requests whose outcome
follows from the rule, and one real H200 history replayed against what the real allocator did."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from autofit.core.errors import AutofitError
from autofit.cost_model.allocator import AllocatorSettings, CachingAllocator, round_size, roundup_power2_next_division
from autofit.cost_model.allocator_replay import history_events, replay

MIB = 2**20
GPU_CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_check"


def blocks(allocator: CachingAllocator) -> list[list[tuple[int, bool]]]:
    """Each segment's blocks, (size, allocated), in address order."""
    return [list(segment.blocks) for segment in allocator.segments()]


def test_requests_are_rounded_to_512_bytes() -> None:
    """round_size: every block is a multiple of kMinBlockSize (512 B), at least one of it."""
    allocator = CachingAllocator()
    allocator.malloc(1)
    allocator.malloc(513)
    assert allocator.allocated_bytes == 512 + 1024
    assert allocator.requested_bytes == 1 + 513


def test_power2_divisions_round_to_the_next_division() -> None:
    """roundup_power2_next_division: the source's own example, 1200 B in 4 divisions is 1280 B; a power of two
    stays. round_size uses it only above kMinBlockSize x divisions (2 KiB for 4), so 1200 B is 1536 B there, and
    4200 B is 5120 B (4096 B + one 1 KiB division) where plain rounding gives 4608 B."""
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(4096, 4) == 4096
    assert round_size(1200, 4) == 1536
    assert (round_size(4200, 4), round_size(4200)) == (5120, 4608)


def test_small_requests_share_a_2_mib_segment() -> None:
    """Requests up to kSmallSize (1 MiB, inclusive) are packed into 2 MiB segments of the small pool."""
    allocator = CachingAllocator()
    allocator.malloc(MIB)
    allocator.malloc(4096)
    assert allocator.reserved_bytes == 2 * MIB
    assert allocator.n_segment_allocs == 1
    assert allocator.segments()[0].small
    assert blocks(allocator) == [[(MIB, True), (4096, True), (MIB - 4096, False)]]


def test_a_mid_size_request_gets_a_20_mib_segment_which_a_second_one_shares() -> None:
    """Large requests under kMinLargeAlloc (10 MiB) get a kLargeBuffer (20 MiB) segment, split because more than
    kSmallSize is left; the next such request is served from the rest."""
    allocator = CachingAllocator()
    allocator.malloc(3 * MIB // 2)
    allocator.malloc(3 * MIB // 2)
    assert allocator.reserved_bytes == 20 * MIB
    assert allocator.n_segment_allocs == 1
    assert blocks(allocator) == [[(3 * MIB // 2, True), (3 * MIB // 2, True), (17 * MIB, False)]]


def test_a_request_of_10_mib_or_more_gets_its_own_segment_rounded_to_2_mib() -> None:
    """From kMinLargeAlloc on, the segment is the request rounded up to kRoundLarge (2 MiB); 1 MiB left over is
    not more than kSmallSize, so the block is not split and the whole 12 MiB is allocated."""
    allocator = CachingAllocator()
    allocator.malloc(11 * MIB)
    assert allocator.reserved_bytes == 12 * MIB
    assert allocator.allocated_bytes == 12 * MIB
    assert blocks(allocator) == [[(12 * MIB, True)]]


def test_a_freed_block_is_split_for_a_smaller_request() -> None:
    """A cached block that fits is used before cudaMalloc, cut at the request where more than 1 MiB is left."""
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(30 * MIB))
    allocator.malloc(8 * MIB)
    assert allocator.n_segment_allocs == 1
    assert blocks(allocator) == [[(8 * MIB, True), (22 * MIB, False)]]


def test_the_smallest_free_block_that_fits_is_taken() -> None:
    """Best fit: of the free 30 MiB and 12 MiB blocks, an 11 MiB request takes the 12 MiB one, whole."""
    allocator = CachingAllocator()
    big, small = allocator.malloc(30 * MIB), allocator.malloc(12 * MIB)
    allocator.free(big)
    allocator.free(small)
    assert allocator.malloc(11 * MIB) == small
    assert allocator.n_segment_allocs == 2


def test_equal_free_blocks_are_taken_lowest_address_first() -> None:
    """Blocks of one size are ordered by address (BlockComparatorSize), so the lower one serves first."""
    allocator = CachingAllocator()
    first, second = allocator.malloc(12 * MIB), allocator.malloc(12 * MIB)
    allocator.free(second)
    allocator.free(first)
    assert allocator.malloc(12 * MIB) == min(first, second)


def test_neighbouring_free_blocks_coalesce() -> None:
    """free_block merges a freed block with its free neighbours of the same segment, so a segment whose blocks are
    all free is one block again."""
    allocator = CachingAllocator()
    a, b, c = (allocator.malloc(4 * MIB) for _ in range(3))
    allocator.free(a)
    allocator.free(b)
    assert blocks(allocator) == [[(8 * MIB, False), (4 * MIB, True), (8 * MIB, False)]]
    allocator.free(c)
    assert blocks(allocator) == [[(20 * MIB, False)]]


def test_empty_cache_gives_back_only_whole_free_segments() -> None:
    """release_blocks frees a segment only where it is one free block; one with a block in use stays."""
    allocator = CachingAllocator()
    allocator.malloc(4 * MIB)
    allocator.free(allocator.malloc(4 * MIB))
    allocator.free(allocator.malloc(40 * MIB))
    allocator.empty_cache()
    assert allocator.reserved_bytes == 20 * MIB
    assert allocator.n_segment_frees == 1
    assert allocator.peak_reserved_bytes == 60 * MIB
    assert blocks(allocator) == [[(4 * MIB, True), (16 * MIB, False)]]


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    """With max_split_size_mb (40 MiB here), a cached block at or over it serves no request under it, and serves one
    over it only within max_non_split_rounding (20 MiB), unsplit."""
    allocator = CachingAllocator(AllocatorSettings(max_split_size_bytes=40 * MIB))
    oversize = allocator.malloc(60 * MIB)
    allocator.free(oversize)
    allocator.malloc(30 * MIB)
    assert allocator.n_segment_allocs == 2
    assert allocator.malloc(45 * MIB) == oversize
    assert allocator.allocated_bytes == 30 * MIB + 60 * MIB


def test_an_expandable_segment_grows_in_place() -> None:
    """expandable_segments: the large pool maps 20 MiB pages in one address range, so a request a little larger
    than a freed one reuses its pages and maps only what is missing, where cudaMalloc would add a segment."""
    expandable = CachingAllocator(AllocatorSettings(expandable_segments=True))
    expandable.free(expandable.malloc(30 * MIB))
    expandable.malloc(32 * MIB)
    assert expandable.reserved_bytes == 40 * MIB
    expandable.malloc(30 * MIB)
    assert expandable.reserved_bytes == 80 * MIB
    assert [action for action, _, _ in expandable.segment_events] == ["segment_map", "segment_map"]
    assert len(expandable.segments()) == 1
    plain = CachingAllocator()
    plain.free(plain.malloc(30 * MIB))
    plain.malloc(32 * MIB)
    assert plain.reserved_bytes == 62 * MIB


def test_empty_cache_unmaps_only_free_whole_pages() -> None:
    """unmap_block gives back the pages wholly inside a free block; a page partly in use stays mapped; a segment all
    unmapped is released."""
    allocator = CachingAllocator(AllocatorSettings(expandable_segments=True))
    kept, freed = allocator.malloc(10 * MIB), allocator.malloc(25 * MIB)
    assert allocator.reserved_bytes == 40 * MIB
    allocator.free(freed)
    allocator.empty_cache()
    assert allocator.reserved_bytes == 20 * MIB
    assert blocks(allocator) == [[(10 * MIB, True), (10 * MIB, False)]]
    allocator.free(kept)
    allocator.empty_cache()
    assert (allocator.reserved_bytes, allocator.n_segments, allocator.segments()) == (0, 0, ())


@pytest.mark.parametrize("expandable", [False, True])
def test_random_requests_keep_the_books(expandable: bool) -> None:
    """Over random requests and frees of every size class: the segments' blocks add up to what is reserved and the
    allocated ones to what is allocated, no two free blocks sit side by side (coalescing), and once all is freed
    empty_cache gives everything back."""
    rng = random.Random(48)
    allocator = CachingAllocator(AllocatorSettings(expandable_segments=expandable))
    live: list[int] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(allocator.malloc(rng.choice([rng.randint(1, 4096), rng.randint(1, 3 * MIB),
                                                     rng.randint(3 * MIB, 64 * MIB)])))
        if rng.random() < 0.01:
            allocator.empty_cache()
    segments = allocator.segments()
    assert sum(s.total_bytes() for s in segments) == allocator.reserved_bytes
    assert sum(size for s in segments for size, allocated in s.blocks if allocated) == allocator.allocated_bytes
    assert all(a or b for s in segments for (_, a), (_, b) in zip(s.blocks, s.blocks[1:], strict=False))
    for address in live:
        allocator.free(address)
    allocator.empty_cache()
    assert (allocator.reserved_bytes, allocator.allocated_bytes, allocator.segments()) == (0, 0, ())


def test_bad_input_is_refused() -> None:
    allocator = CachingAllocator()
    with pytest.raises(AutofitError, match="size"):
        allocator.malloc(0)
    with pytest.raises(AutofitError, match="address"):
        allocator.free(12345)
    with pytest.raises(AutofitError, match="roundup_power2_divisions"):
        AllocatorSettings(roundup_power2_divisions=3)
    with pytest.raises(AutofitError, match="max_split_size_bytes"):
        AllocatorSettings(max_split_size_bytes=MIB)


def test_a_real_h200_history_replays_exactly() -> None:
    """The smallest clean history (the allocator held nothing when it began): a 1.6 B model's ZeRO-3 config from
    the model's copy through deepspeed.initialize (its empty_cache calls included) and 3 steps. Every block lands
    where the real allocator put it, the segments are the same, and the reserved peak is the real one (the row's
    max_memory_reserved, over all 10 steps)."""
    label = "mb2x1 bf16 adamw z3 ckpt0 sdpa"
    with gzip.open(GPU_CHECK / "h200_2026-11-28_run2_alloc_history_stablelm_2_1p6b.json.gz") as f:
        events = history_events(json.load(f)[label])
    rows = json.loads((GPU_CHECK / "h200_2026-11-28_run2.json").read_text())
    row = next(r for r in rows["steps"]["grid"]["result"]["models"]["stablelm_2_1p6b"]["rows"] if r["label"] == label)
    assert row["before"]["reserved_bytes"] == 0
    result = replay(events)
    assert result.n_address_mismatches == 0
    assert result.n_empty_cache > 0
    assert (result.n_segment_allocs, result.n_segment_frees) == (result.recorded_n_segment_allocs,
                                                                 result.recorded_n_segment_frees)
    assert result.peak_reserved_bytes == result.recorded_peak_reserved_bytes == row["max_memory_reserved_bytes"]
