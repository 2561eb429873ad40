"""The search end to end on a tiny model: real DeepSpeed probes on the CPU, fp32, no mocks."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from autofit import Workload
from autofit.errors import AutofitError
from autofit.hardware import get_hardware
from autofit.search import run_search, write_json_atomic
from autofit.space import space_from_dict

HERE = Path(__file__).resolve()
ENTRY = f"{HERE}:tiny_workload"
REPO = HERE.parents[1]
MIB = 2**20


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Tiny(nn.Module):
    def __init__(self, d: int = 64, n_layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x).mean(dim=1), y)


def tiny_workload() -> Workload:
    return Workload(model=Tiny, batch=lambda n: (torch.randn(n, 128, 64), torch.randn(n, 1)), name="tiny")


def big_workload() -> Workload:
    """~67 M parameters: a GiB of AdamW states, sharding matters."""
    return Workload(
        model=lambda: Tiny(d=1024, n_layers=8), batch=lambda n: (torch.randn(n, 8, 1024), torch.randn(n, 1)), name="big"
    )


def _space(micro_batches: list[int]):  # noqa: ANN202
    return space_from_dict(
        {
            "global_batch_size": 16,
            "micro_batch_size": micro_batches,
            "checkpoint_ratio": [0.0],
            "precision": ["fp32"],
            "optimizer": ["sgd"],
            "zero_stage": [0],
            "attention": ["sdpa"],
        },
        name="tiny",
    )


def test_write_json_atomic_replaces_whole_files(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ds.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"b": 2})
    assert json.loads(path.read_text()) == {"b": 2}
    assert [p.name for p in path.parent.iterdir()] == ["ds.json"]


def test_nothing_fits_raises_names_the_smallest_need_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "ds.json"
    with pytest.raises(AutofitError) as info:
        run_search(
            ENTRY,
            tiny_workload(),
            get_hardware("cpu", 2 * MIB),
            _space([1, 2]),
            trials=3,
            storage=f"sqlite:///{tmp_path / 'study.db'}",
            out_path=out,
            progress=False,
        )
    message = str(info.value)
    assert "nothing fits" in message and "smallest candidate" in message and "needs" in message
    assert "10% safety margin" in message
    assert not out.exists()


def test_nothing_fits_on_a_gpu_says_how_many_gpus_would_do(tmp_path: Path) -> None:
    out = tmp_path / "ds.json"
    space = space_from_dict(
        {
            "global_batch_size": 16,
            "micro_batch_size": [1],
            "precision": ["bf16"],
            "optimizer": ["adamw"],
            "zero_stage": [0, 3],
            "attention": ["sdpa"],
        },
        name="gpu",
    )
    with pytest.raises(AutofitError) as info:
        run_search(
            f"{HERE}:big_workload",
            big_workload(),
            get_hardware("h100-80gb", 1200 * MIB),
            space,
            trials=3,
            storage=f"sqlite:///{tmp_path / 'study.db'}",
            out_path=out,
            progress=False,
        )
    message = str(info.value)
    assert "4 GPUs with ZeRO-3 sharding" in message, message
    assert not out.exists()


@pytest.mark.slow
def test_search_emits_a_verified_winner_whose_json_trains(tmp_path: Path) -> None:
    out = tmp_path / "ds_config.json"
    report = tmp_path / "report"
    result = run_search(
        ENTRY,
        tiny_workload(),
        get_hardware("cpu", 1024 * MIB),
        _space([2, 4, 16]),
        trials=3,
        storage=f"sqlite:///{tmp_path / 'study.db'}",
        study_name="tiny",
        out_path=out,
        report_dir=report,
        progress=False,
    )
    ds = json.loads(out.read_text())
    assert ds == result.deepspeed
    assert ds["train_batch_size"] == 16
    assert result.measured["status"] == "ok"
    assert result.measured["peak_bytes"] <= 0.9 * 1024 * MIB
    phases = [t.phase for t in result.trials]
    assert phases.count("verify") >= 1 and 1 <= phases.count("search") <= 3
    searched = [json.dumps(t.config.to_dict(), sort_keys=True) for t in result.trials if t.phase == "search"]
    assert len(searched) == len(set(searched))
    data = result.to_dict()
    assert set(data) >= {"best", "trials", "pruned"}
    assert set(data["best"]) == {"config", "measured", "predicted"}
    json.dumps(data)  # JSON-serialisable as --json prints it
    for name in ("index.html", "report.md", "memory_breakdown.png", "memory_vs_throughput.png", "timeline.png"):
        assert (report / name).stat().st_size > 0, name
    assert "10%" in (report / "index.html").read_text()

    # the emitted JSON runs three steps through deepspeed.initialize, in a fresh process
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(HERE.parent)!r})
        import deepspeed, torch
        from test_search import Tiny
        ds = json.load(open({str(out)!r}))
        ds.pop("autofit")
        deepspeed.init_distributed(dist_backend="gloo")
        model = Tiny()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        for _ in range(3 * ds["gradient_accumulation_steps"]):
            n = ds["train_micro_batch_size_per_gpu"]
            loss = engine(torch.randn(n, 128, 64), torch.randn(n, 1))
            engine.backward(loss)
            engine.step()
        assert engine.global_steps == 3, engine.global_steps
        print("TRAINED", engine.global_steps)
        """
    )
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29517",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        PYTHONPATH=str(REPO),
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "TRAINED 3" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


_RUNNER = """
import sys
sys.path.insert(0, {tests!r})
from test_search import ENTRY, _space, tiny_workload
from autofit.hardware import get_hardware
from autofit.search import run_search
run_search(ENTRY, tiny_workload(), get_hardware("cpu", 1024 * 2**20), _space([1, 16]), trials=4,
           storage={storage!r}, study_name="resume", out_path={out!r}, progress=False)
"""


def _finished_probes(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db, timeout=1) as conn:
            rows = conn.execute("SELECT COUNT(*) FROM trial_user_attributes WHERE key = 'measured'").fetchone()
        return int(rows[0])
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_a_killed_search_resumes_without_repeating_or_losing_probes(tmp_path: Path) -> None:
    db = tmp_path / "study.db"
    storage = f"sqlite:///{db}"
    out = tmp_path / "ds.json"
    code = _RUNNER.format(tests=str(HERE.parent), storage=storage, out=str(out))
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while _finished_probes(db) < 1:
            assert proc.poll() is None, "the search ended before its first probe finished"
            assert time.monotonic() < deadline, "no probe finished in time"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the search and the probe it may have started
        proc.wait()
    assert not out.exists()
    first = _finished_probes(db)

    result = run_search(
        ENTRY,
        tiny_workload(),
        get_hardware("cpu", 1024 * MIB),
        _space([1, 16]),
        trials=4,
        storage=storage,
        study_name="resume",
        out_path=out,
        progress=False,
    )
    resumed = [t for t in result.trials if t.resumed]
    assert len(resumed) == first >= 1
    searched = [
        json.dumps(t.config.to_dict(), sort_keys=True)
        for t in result.trials
        if t.phase == "search" and t.status != "interrupted"
    ]
    assert len(searched) == len(set(searched)) == 2  # each config probed once, over both runs
    # the winner is the best measured over both runs: what an uninterrupted search that measured the same
    # finds (step times on a shared CPU are too noisy to name it in advance)
    best = max((t for t in result.trials if t.phase == "search" and t.within_margin), key=lambda t: t.samples_per_s)
    assert result.config == best.config
    assert json.loads(out.read_text())["train_micro_batch_size_per_gpu"] == best.config.micro_batch_size
