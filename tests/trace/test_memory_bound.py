"""The trace's memory-bound bytes: what the kernels that do no matmul read and write (a roofline's memory side)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autofit.core.config import Config
from autofit.planning.plan import trace_for
from autofit.trace.traffic import memory_bound_bytes
from autofit.workload.types import Workload

aten = torch.ops.aten


def _bytes(func, *args):  # noqa: ANN001, ANN202 - the op, called as the trace sees it
    return memory_bound_bytes(func, args, {}, func(*args))


def test_views_matmuls_and_allocations_move_no_bytes() -> None:
    with FakeTensorMode():
        x, w = torch.empty(64, 128), torch.empty(128, 256)
        assert _bytes(aten.view.default, x, [128, 64]) == 0
        assert _bytes(aten.t.default, w) == 0
        assert _bytes(aten.mm.default, x, w) == 0
        assert _bytes(aten.empty_like.default, x) == 0
        assert _bytes(aten.relu.default, x) > 0


def test_an_embedding_lookup_reads_its_rows_not_the_table() -> None:
    with FakeTensorMode():
        ids = torch.zeros(8, 16, dtype=torch.long)
        small = _bytes(aten.embedding.default, torch.empty(1_000, 64), ids)
        large = _bytes(aten.embedding.default, torch.empty(100_000, 64), ids)
    assert small == large > 0


class _Block(nn.Module):
    def __init__(self, extra_elementwise: bool) -> None:
        super().__init__()
        self.up, self.down, self.extra = nn.Linear(32, 128), nn.Linear(128, 32), extra_elementwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.extra:
            h = h * torch.sigmoid(h)
        return self.down(h).pow(2).mean()


def _facts(extra: bool):  # noqa: ANN202
    workload = Workload(model=lambda: _Block(extra), batch=lambda n: torch.randn(n, 16, 32), name=f"block{extra}")
    config = Config(micro_batch_size=4, checkpoint_ratio=0.0, precision="fp32", optimizer="sgd", zero_stage=0)
    return trace_for(workload, [config])


def test_the_trace_counts_elementwise_traffic_apart_from_flops() -> None:
    """The same matmuls with two more elementwise ops: the same FLOPs, more memory-bound bytes, growing with the
    micro-batch."""
    plain, gated = _facts(False), _facts(True)

    def at(facts, n: int, attr: str) -> float:  # noqa: ANN001
        return facts.at_checkpointed("fp32", "sdpa", 0, n, attr)

    assert at(gated, 4, "flops") == pytest.approx(at(plain, 4, "flops"), rel=0.01)
    assert at(gated, 4, "memory_bound_bytes") > 1.3 * at(plain, 4, "memory_bound_bytes") > 0
    assert at(plain, 8, "memory_bound_bytes") > 1.5 * at(plain, 4, "memory_bound_bytes")


def test_a_compiler_fuses_the_chain_between_two_matmuls() -> None:
    """Fused, the gate's two elementwise ops move what they read from the first matmul and what the second matmul
    reads (plus what backward reads of them), not every intermediate: less than eager adds, and never more."""
    plain, gated = _facts(False), _facts(True)

    def at(facts, attr: str) -> float:  # noqa: ANN001
        return facts.at_checkpointed("fp32", "sdpa", 0, 4, attr)

    for facts in (plain, gated):
        assert 0 < at(facts, "fused_memory_bound_bytes") < at(facts, "memory_bound_bytes")
    eager_added = at(gated, "memory_bound_bytes") - at(plain, "memory_bound_bytes")
    fused_added = at(gated, "fused_memory_bound_bytes") - at(plain, "fused_memory_bound_bytes")
    assert 0 <= fused_added < eager_added


def test_what_backward_or_a_matmul_reads_reaches_memory() -> None:
    """A chain's output that a matmul reads is written; one only the chain reads is not; a forward output read in
    backward is written (forward and backward compile as two graphs)."""
    from autofit.trace.traffic import Traffic

    with FakeTensorMode():
        x, w = torch.empty(64, 64), torch.empty(64, 64)
        traffic = Traffic()
        h = aten.relu.default(x)
        traffic.record(aten.relu.default, (x,), {}, h)
        g = aten.mul.Tensor(h, h)
        traffic.record(aten.mul.Tensor, (h, h), {}, g)
        assert traffic.writes == 0  # nothing outside the chain has read h or g
        traffic.record(aten.mm.default, (g, w), {}, aten.mm.default(g, w))
        assert traffic.writes == 64 * 64 * 4  # g, which the matmul reads; h stays in registers
        traffic.start_backward()
        traffic.record(aten.neg.default, (h,), {}, aten.neg.default(h))
        assert traffic.writes == 2 * 64 * 64 * 4  # h, saved for backward
