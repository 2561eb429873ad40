"""The CPU probe's reading of process memory (autofit.probe.rank.memory), in real processes under the probe's own
allocator setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autofit.probe.launch import MMAP_THRESHOLD_BYTES

MIB = 2**20

#: 64 MiB of 64 KiB tensors (a page or more: mapped), freed; then 64 MiB of 1 KiB tensors (glibc's heap), freed
MAPPED_THEN_SMALL = """
import torch
from autofit.probe.rank.memory import rss_bytes, settled_rss_bytes
warm = [torch.ones(n) for n in (256, 16384)]  # the kernel's code and the threads, before the baseline
del warm
start = settled_rss_bytes()
mapped = [torch.ones(16384) for _ in range(1024)]
held_mapped = rss_bytes() - start
del mapped
after_mapped = rss_bytes() - start
small = [torch.ones(256) for _ in range(65536)]
held = rss_bytes() - start
del small
print(held_mapped, after_mapped, held, rss_bytes() - start, settled_rss_bytes() - start)
"""


@pytest.mark.slow
def test_small_blocks_freed_stay_resident_until_settled_and_a_freed_tensor_of_a_page_or_more_returns_at_once() -> None:
    """What the footprint reads (settled) leaves out the heap's holes; a mapped tensor is gone from RSS when freed,
    so the probe's peak follows live tensors of a page or more."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD_BYTES), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", MAPPED_THEN_SMALL], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    held_mapped, after_mapped, held, freed, settled = (int(v) for v in done.stdout.split())
    # a page or more: mapped, and gone with the tensor (but those glibc found room for at the heap's top, which
    # grows by 128 KiB at a time, M_TOP_PAD: 7 MiB of 68 here)
    assert held_mapped > 64 * MIB and after_mapped < held_mapped / 4
    assert held > 64 * MIB  # the small tensors' bytes, and their headers beside them
    assert freed > held - 8 * MIB  # freed below the threshold: still resident, holes in the heap
    assert settled < held / 4  # handed back (the Python objects' arenas and torch's own allocations aside)
