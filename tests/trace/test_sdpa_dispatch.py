"""SDPA priced as the target dispatches it: with attention dropout a CUDA target's fused kernels hold no more than
eager (MHA, GQA, MQA); a CPU target's math path is kept; key/value heads SDPA broadcasts are labelled as the math path."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from autofit.core.errors import AutofitError
from autofit.core.software import Software
from autofit.core.space import space_from_dict
from autofit.machine.device import get_hardware
from autofit.planning.plan import Plan
from autofit.trace import trace_workload
from autofit.trace.sdpa import MATH_BROADCAST
from autofit.workload.hf import hf_workload
from autofit.workload.types import Workload

SPACE = {"global_batch_size": 2, "micro_batch_size": [2], "precision": ["bf16"], "optimizer": ["adamw"],
         "zero_stage": [0], "checkpoint_ratio": [0.0], "compile": ["off"], "overlap_comm": [False],
         "bucket_scale": [1], "offload_optimizer": ["none"], "offload_params": ["none"],
         "attention": ["eager", "sdpa"]}


def _peaks(folder: str, hardware: str) -> dict[str, int]:
    """Each kernel's predicted peak, planned alone (a CUDA plan does not search eager beside sdpa)."""
    workload = hf_workload(folder, seq_len=64)
    peaks = {}
    for kernel in SPACE["attention"]:
        space = space_from_dict({**SPACE, "attention": [kernel]}, name="kernels")
        plan = Plan.make(folder, workload, get_hardware(hardware), space, software=Software())
        peaks |= {config.attention: prediction.peak_bytes for config, prediction in plan.price()}
    return peaks


def _llama(tmp_path: Path, kv_heads: int) -> str:
    from transformers import LlamaConfig

    folder = tmp_path / f"llama-kv{kv_heads}"
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=kv_heads, attention_dropout=0.1, max_position_embeddings=128,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_sdpa_with_dropout_is_priced_no_higher_than_eager_on_a_gpu(tmp_path: Path, kv_heads: int) -> None:
    peaks = _peaks(_llama(tmp_path, kv_heads), "h100-80gb")
    assert peaks["sdpa"] <= peaks["eager"], peaks


def test_a_cpu_plan_keeps_sdpas_math_path_under_dropout(tmp_path: Path) -> None:
    folder = _llama(tmp_path, 2)
    workload = hf_workload(folder, seq_len=64)
    kwargs = {"precisions": ("fp32",), "attentions": ("sdpa",), "micro_batches": (2,)}
    cpu = trace_workload(workload, sdpa_dispatch="cpu", **kwargs).profiles["fp32/sdpa/full"].points[0]
    cuda = trace_workload(workload, sdpa_dispatch="cuda", **kwargs).profiles["fp32/sdpa/full"].points[0]
    assert cpu.activation_bytes > cuda.activation_bytes  # the CPU saves the scores and the dropout mask


def test_broadcast_heads_are_labelled_as_sdpas_math_path() -> None:
    from tiny_attention import broadcast_mqa_workload

    facts = trace_workload(broadcast_mqa_workload(), attentions=("sdpa",), micro_batches=(1,))
    assert facts.attention_traces.get("sdpa") == MATH_BROADCAST


def test_a_build_error_is_not_retried_at_full_depth() -> None:
    import torch

    builds: list[str | None] = []

    def model(attention: str | None = None) -> nn.Module:
        builds.append(attention)
        if attention == "sdpa" and len(builds) > 1:  # the meta build passes; the traced one refuses the kernel
            raise ValueError("this model does not support sdpa")
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(16)])

    workload = Workload(model=model, batch=lambda n: torch.randn(n, 8), loss=lambda m, b: m(b).sum(), name="refuses")
    with pytest.raises(AutofitError) as info:
        trace_workload(workload, attentions=("sdpa",), micro_batches=(1,))
    assert "does not support sdpa" in str(info.value) and "\n" not in str(info.value)
    assert len(builds) <= 3, builds  # the meta build, the structure's, the kernel's check: no whole-model retry

