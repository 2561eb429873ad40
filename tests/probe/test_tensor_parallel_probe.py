"""Real AutoTP probes on the CPU (gloo, DS_ACCELERATOR=cpu): TP = 2 on two ranks of a tiny hf: Llama, the plan's own
DeepSpeed JSON through ``deepspeed.initialize``, ZeRO 0 and 3. How close the predicted peak comes is
benchmarks/parallel/autotp_probe.py's question; this asserts that it trains and reports it."""

from __future__ import annotations

from pathlib import Path

import pytest

from autofit.machine.device import get_hardware
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[2]
ENTRY = f"hf:{ROOT / 'examples' / 'hf_configs' / 'llama_gqa'}"
CPU = get_hardware("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_a_tp2_probe_of_a_tiny_hf_llama_trains_three_steps_on_two_ranks(stage: int) -> None:
    import autofit

    keys = {"tensor_parallel": 2, "zero_stage": stage, "micro_batch_size": 2, "checkpoint_ratio": 0.0,
            "attention": "sdpa", "precision": "fp32", "optimizer": "adamw"}
    estimate = autofit.estimate(ENTRY, hardware="cpu", gpus=2, seq_len=128, global_batch=4, set=keys)
    candidate = estimate.candidates[0]
    spec = probe_spec(f"{ENTRY}?seq_len=128", candidate.config, CPU, world_size=2, steps=3, warmup_steps=1,
                      facts=estimate.facts)
    assert "train_batch_size" not in spec.deepspeed and spec.deepspeed["tensor_parallel"]["autotp_size"] == 2
    result = run_probe(spec, timeout_s=300.0)
    assert result.status == "ok", result.message
    assert len(result.per_rank_peak_bytes) == 2 and result.step_time_s > 0 and len(result.step_times_s) >= 3
    print(f"{candidate.config.label()}: measured {result.peak_bytes / 2**20:.1f} MiB, predicted "
          f"{candidate.prediction.peak_bytes / 2**20:.1f} MiB")
