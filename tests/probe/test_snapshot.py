"""The fragmentation advice read from a probe's allocator figures, and the report's snapshot section."""

from __future__ import annotations

from pathlib import Path

from autofit.core.config import Config
from autofit.probe.result import ProbeResult
from autofit.probe.snapshot import ALLOC_CONF_ADVICE, fragmentation_advice
from autofit.report.folder import snapshot_section

GIB = 2**30


def _probe(reserved: int, allocated: int) -> ProbeResult:
    memory = {"max_memory_reserved_bytes": reserved, "max_memory_allocated_bytes": allocated,
              "nvml_peak_bytes": reserved + GIB // 2, "context_bytes": GIB // 2}
    return ProbeResult(Config(), "ok", reserved + GIB // 2, 1.0, 4.0, None, None, 10.0, device_memory=memory)


def test_reserved_far_above_allocated_advises_expandable_segments() -> None:
    advice = fragmentation_advice(_probe(reserved=70 * GIB, allocated=50 * GIB).device_memory)
    assert advice is not None and ALLOC_CONF_ADVICE in advice and "29% fragmented" in advice


def test_a_small_or_a_proportionally_small_gap_is_no_fragmentation() -> None:
    assert fragmentation_advice(_probe(reserved=70 * GIB, allocated=66 * GIB).device_memory) is None  # 6%
    assert fragmentation_advice(_probe(reserved=GIB, allocated=GIB * 6 // 10).device_memory) is None  # 410 MiB
    assert fragmentation_advice({}) is None  # a CPU probe reports no allocator figures


def test_the_report_section_names_the_snapshot_and_the_advice(tmp_path: Path) -> None:
    title, text, _, rows = snapshot_section(_probe(reserved=70 * GIB, allocated=50 * GIB))
    assert title == "CUDA memory snapshot"
    assert "memory_snapshot.pickle" in text and ALLOC_CONF_ADVICE in text
    assert ["max_memory_allocated_bytes", "50.00 GiB"] in rows
    _, calm, _, _ = snapshot_section(_probe(reserved=70 * GIB, allocated=68 * GIB))
    assert "no sign of fragmentation" in calm
