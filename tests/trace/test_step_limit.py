"""A trace step past its limit (``AUTOFIT_TRACE_STEP_S``) ends the trace with one line, and never the process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from torch import nn

from autofit.trace import trace_workload
from autofit.trace.step import TRACE_STEP_ENV, TraceTooSlow
from autofit.workload.types import Workload


class _Slow(nn.Module):
    """A Python loop of many small ops, as a state-space model's reference scan runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x):  # noqa: ANN001, ANN201
        for _ in range(10_000):
            x = self.layer(x).tanh()
            time.sleep(0.001)
        return x.sum()


def test_a_trace_step_past_its_limit_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv(TRACE_STEP_ENV, "0.5")
    workload = Workload(model=_Slow, batch=lambda n: torch.randn(n, 8), name="slow")
    started = time.perf_counter()
    with pytest.raises(TraceTooSlow) as info:
        trace_workload(workload, micro_batches=(1,))
    assert time.perf_counter() - started < 30 and "\n" not in str(info.value) and "slow" in str(info.value)


def test_a_step_past_its_limit_answers_metadata_queries_and_stops_at_the_next_tensor_op() -> None:
    """C++ asks a tensor's device where it cannot unwind a Python exception (autograd's set_history): the limit must
    not raise there, only before an op that makes tensors."""
    import torch

    from autofit.trace.step import LiveBytes, fake_mode, make_tracker

    with fake_mode("fake"):
        x = torch.randn(4, 8)
        with make_tracker(LiveBytes(deadline=0.0, name="late")):
            assert torch.ops.prim.device.default(x) == x.device
            assert torch.ops.aten.sym_size.int(x, 0) == 4
            with pytest.raises(TraceTooSlow):
                torch.ops.aten.add.Tensor(x, x)


STRESS = """
import gc, os, sys, torch
from torch import nn
from autofit.trace import trace_workload
from autofit.trace.step import TRACE_STEP_ENV, TraceTooSlow
from autofit.workload.types import Workload
os.environ[TRACE_STEP_ENV] = "0.1"
gc.set_threshold(50, 1, 1)  # collections at many more points of the step, as a long test session's history makes them
class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 8)
    def forward(self, x):
        for _ in range(100_000):
            x = self.layer(x).tanh()
        return x.sum()
for i in range(25):
    try:
        trace_workload(Workload(model=Slow, batch=lambda n: torch.randn(n, 8), name=f"slow{i}"), micro_batches=(1,))
    except TraceTooSlow:
        pass
print("stopped 25 times")
"""


@pytest.mark.slow
def test_stopping_slow_steps_many_times_never_aborts_the_process(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "stress.py"
    script.write_text(STRESS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "AUTOFIT_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0 and "stopped 25 times" in done.stdout, done.stderr[-2000:]
