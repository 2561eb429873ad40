"""What both the GPU check's driver (benchmarks/gpu/gpu_check.py) and its steps (benchmarks/gpu/gpu_check_steps.py)
read (and its grid and host steps): the profiles (the GPU's and the CPU dry run's), the models of the grid, where the
wheels go, the host's line, and how a step's JSON and the allocator's histories are written (replaced whole)."""

from __future__ import annotations

import gzip
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("install", "env", "ops", "host", "grid", "run", "pytest")
GIB = 2**30


@dataclass(frozen=True)
class GridModel:
    """One model of the grid: every micro-batch x ZeRO stage x checkpoint ratio, in bf16 with AdamW."""

    name: str
    entry: str
    """An ``hf:`` folder built from its config (random weights), with its ``seq_len``."""
    hidden_size: int
    micro_batches: tuple[int, ...]
    zero_stages: tuple[int, ...]
    checkpoint_ratios: tuple[float, ...]
    held_out: bool
    """True: no constant is ever fitted to this model's rows (they only judge)."""
    history_micro_batches: tuple[int, ...] = ()
    """The allocator's whole event history is recorded at these micro-batches."""
    expandable: tuple[tuple[int, int, float], ...] = ()
    """(micro-batch, stage, ratio) measured once more with ``expandable_segments:True``."""
    limit_s: float = 100.0

    def items(self, precision: str, optimizer: str) -> list[dict[str, Any]]:
        """The configs ``benchmarks/gpu/gpu_check_grid.py`` measures, in order (the expandable ones second)."""
        from autofit.core.config import Config

        items = []
        cells = [(mb, z, r, None) for z in self.zero_stages for r in self.checkpoint_ratios for mb in self.micro_batches]
        # second, not last: a grid cut at its limit has measured them
        cells[1:1] = [(mb, z, r, "expandable_segments:True") for mb, z, r in self.expandable]
        for mb, z, r, alloc_conf in cells:
            config = Config(micro_batch_size=mb, precision=precision, zero_stage=z, checkpoint_ratio=r,
                            optimizer=optimizer, attention="sdpa")
            items.append({"label": config.label() + (" expandable" if alloc_conf else ""), "config": config.to_dict(),
                          "history": mb in self.history_micro_batches and alloc_conf is None,
                          "alloc_conf": alloc_conf})
        return items


@dataclass(frozen=True)
class Profile:
    """What the GPU check and its dry run differ in: the models, the device, the limits."""

    grid: tuple[GridModel, ...]
    run_entry: str
    """The search's model (an ``hf:`` entry)."""
    seq_len: int
    run_micro_batch: int
    hardware: str
    optimizer: str
    precision: str
    limits_s: dict[str, float]
    budget_s: float
    """All steps together."""
    steps: int = 10
    """Steps each grid config runs, every one timed."""
    run_set: tuple[str, ...] = ()
    """``--set`` of the search, keeping it short."""
    trials: int = 3
    """The search's ``--trials`` (its verification probes come after them)."""
    pytest_paths: tuple[str, ...] = ("tests",)
    env: dict[str, str] = field(default_factory=dict)
    host_quick: bool = False


QWEN = "benchmarks/models/hf/qwen2_0p5b"
GPU = Profile(
    grid=(
        GridModel("qwen2_0p5b", f"hf:{QWEN}?seq_len=1024", 896, micro_batches=(1, 4, 16), zero_stages=(0, 3),
                  checkpoint_ratios=(0.0, 1.0), held_out=False, history_micro_batches=(1, 4),
                  expandable=((16, 0, 0.0),), limit_s=90),
        GridModel("stablelm_2_1p6b", "hf:benchmarks/models/families/stablelm-2-1.6b?seq_len=1024", 2048,
                  micro_batches=(2, 8), zero_stages=(0, 3), checkpoint_ratios=(0.0, 1.0), held_out=True,
                  history_micro_batches=(2,), limit_s=80),
    ),
    run_entry=f"hf:{QWEN}", seq_len=1024, run_micro_batch=4, hardware="auto", optimizer="adamw", precision="bf16",
    # measured on an H100 machine of 16 cores (2026-11-27): FusedAdam's nvcc build 41 s, a 0.5 B probe 29-31 s
    # (imports 14-15 s, model build 7-9 s); 120 s of `autofit run` ended in its second trial (3 trials and a
    # verifying probe need about 55 s of planning and 4 x 30 s)
    limits_s={"install": 25, "env": 25, "ops": 60, "host": 60, "grid": 170, "run": 175, "pytest": 20},
    budget_s=535,
    run_set=("compile=off", "offload_optimizer=none", "offload_params=none", "attention=sdpa"),
    pytest_paths=("tests/probe/test_cuda.py::test_cuda_nvml_row_is_found_by_uuid_under_cuda_visible_devices",),
)

TINY = "examples/hf_configs"
DRY = Profile(
    grid=(
        GridModel("llama_gqa", f"hf:{TINY}/llama_gqa?seq_len=128", 64, micro_batches=(1, 2), zero_stages=(0, 3),
                  checkpoint_ratios=(0.0, 1.0), held_out=False, history_micro_batches=(1,),
                  expandable=((2, 0, 0.0),), limit_s=90),
        GridModel("mistral_sliding", f"hf:{TINY}/mistral_sliding?seq_len=128", 64, micro_batches=(2,),
                  zero_stages=(0, 3), checkpoint_ratios=(1.0,), held_out=True, limit_s=60),
    ),
    run_entry=f"hf:{TINY}/llama_gqa", seq_len=128, run_micro_batch=2, hardware="cpu", optimizer="sgd",
    precision="fp32",
    # a fresh venv JIT-builds DeepSpeed's CPU communication op first: over a minute on 2 busy cores, and every
    # later step waits on its lock
    limits_s={"install": 30, "env": 60, "ops": 300, "host": 60, "grid": 200, "run": 150, "pytest": 90},
    budget_s=1000, steps=3,
    run_set=("compile=off", "zero_stage=0", "checkpoint_granularity=block", "attention=sdpa", "micro_batch_size=2",
             "checkpoint_ratio=0"),
    trials=1,
    pytest_paths=("tests/probe/test_cuda.py",),
    env={"DS_ACCELERATOR": "cpu"},
    host_quick=True,
)

#: where --install puts the wheels
SITE = "/tmp/site"


def host_line() -> str:
    return f"Python {platform.python_version()} on {platform.machine()}"


def save(path: str, found: dict[str, Any]) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(found, indent=1, default=str))
    tmp.replace(path)


def save_histories(path: str, histories: dict[str, Any]) -> None:
    tmp = Path(path).with_suffix(".tmp")
    with gzip.open(tmp, "wt") as sink:
        json.dump(histories, sink)
    tmp.replace(path)
