"""A CUDA plan does not trace or price eager attention beside SDPA, which is never worse there; it says so once, and
plans eager where SDPA cannot run the model, where the user names eager, and on a CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autofit.core.space import space_from_dict
from autofit.machine.device import get_hardware
from autofit.planning.dominated import EAGER_BESIDE_SDPA
from autofit.planning.plan import Plan
from autofit.workload.types import Workload

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

SPACE = {"global_batch_size": 4, "micro_batch_size": [1, 4], "precision": ["fp32", "bf16"], "optimizer": ["adamw"],
         "zero_stage": [0], "checkpoint_ratio": [0.0], "compile": ["off"], "overlap_comm": [False],
         "bucket_scale": [1], "offload_optimizer": ["none"], "offload_params": ["none"],
         "attention": ["eager", "sdpa"]}


@pytest.fixture(autouse=True)
def no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOFIT_NO_CACHE", "1")


def small_gpt(sdpa_runs: bool = True) -> Workload:
    """A 2-layer GPT built with either kernel; with ``sdpa_runs=False`` its SDPA build fails, as a model whose class
    refuses SDPA does."""

    def build(attention: str = "eager") -> nn.Module:
        if attention == "sdpa" and not sdpa_runs:
            raise ValueError("this model does not support SDPA")
        return gpt.GPT(vocab_size=128, seq_len=32, d_model=32, n_layers=2, n_heads=2, attention=attention)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (n, 32))
        return {"input_ids": ids, "labels": ids.clone()}

    return Workload(model=build, batch=batch, layers=lambda m: m.blocks, name="small-gpt",
                    attention_kernels=("eager", "sdpa"))


def _plan(workload: Workload, hardware: str, fixed: dict[str, object] | None = None) -> Plan:
    return Plan.make("small-gpt", workload, get_hardware(hardware), space_from_dict(SPACE, name="kernels"),
                     fixed=fixed)


def test_a_cuda_plan_neither_traces_nor_prices_eager_beside_sdpa_and_says_why_once() -> None:
    plan = _plan(small_gpt(), "h100-80gb")
    assert {c.attention for c in plan.candidates} == {"sdpa"}
    assert [reason for config, reason in plan.rejected if config == {"attention": "eager"}] == [EAGER_BESIDE_SDPA]
    assert {profile.attention for profile in plan.facts.profiles.values()} == {"sdpa"}


def test_eager_is_planned_where_sdpa_cannot_run_the_model() -> None:
    plan = _plan(small_gpt(sdpa_runs=False), "h100-80gb")
    assert {c.attention for c in plan.candidates} == {"eager"}
    reasons = [reason for config, reason in plan.rejected if "attention" in config]
    assert EAGER_BESIDE_SDPA not in reasons
    assert any(reason.startswith("attention=sdpa could not be traced") for reason in reasons)


def test_eager_named_by_the_user_and_eager_on_a_cpu_are_planned() -> None:
    named = _plan(small_gpt(), "h100-80gb", fixed={"attention": "eager"})
    assert {c.attention for c in named.candidates} == {"eager"}
    cpu = _plan(small_gpt(), "cpu")
    assert {c.attention for c in cpu.candidates} == {"eager", "sdpa"}
    assert all(reason != EAGER_BESIDE_SDPA for _, reason in cpu.rejected)
