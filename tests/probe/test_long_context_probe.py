"""Real probes with the long-context keys on the CPU (gloo, DS_ACCELERATOR=cpu): Ulysses SP = 2 on two ranks (world 2,
data-parallel 1), TiledMLP and the tiled loss, each measuring a peak and a step like any other probe. How close the
cost model's peak comes is benchmarks/long_context_cpu.py's question; these report it and assert only that it ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.machine.device import get_hardware
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[2]
ENTRY = f"hf:{ROOT / 'examples' / 'hf_configs' / 'llama_gqa'}?seq_len=128"
CPU = get_hardware("cpu")
START_S = 300.0


def _config(**keys: object) -> Config:
    values: dict = dict(micro_batch_size=1, precision="fp32", optimizer="adamw", zero_stage=3, attention="sdpa")
    return Config(**(values | keys))  # type: ignore[arg-type]


def _predicted_bytes(config: Config, world_size: int) -> int:
    import autofit

    result = autofit.estimate(ENTRY.split("?")[0], hardware="cpu", gpus=world_size, seq_len=128,
                              set={k: v for k, v in config.to_dict().items() if k != "grad_accum_steps"})
    return int(result.candidates[0].prediction.peak_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("keys", [dict(sequence_parallel=2), dict(sequence_parallel=2, tiled_mlp=True, tiled_loss=True)],
                         ids=["sp2", "sp2-tiled"])
def test_an_sp2_probe_of_a_tiny_hf_llama_measures_a_peak_and_a_step(keys: dict) -> None:
    config = _config(**keys)
    result = run_probe(probe_spec(ENTRY, config, CPU, world_size=2, steps=1, warmup_steps=1), timeout_s=START_S)
    assert result.status == "ok", result.message
    assert len(result.per_rank_peak_bytes) == 2 and min(result.per_rank_peak_bytes) > 0
    assert result.step_time_s > 0 and result.tokens_per_s
    try:
        predicted = f"{_predicted_bytes(config, 2) / 2**20:.1f} MiB"
    except AutofitError as exc:  # tiled_mlp at one tile a rank: the rules refuse what the probe still runs
        predicted = f"refused ({exc})"
    print(f"{config.label()}: measured {result.peak_bytes / 2**20:.1f} MiB, predicted {predicted}")


@pytest.mark.slow
def test_a_tiled_loss_and_tiled_mlp_probe_on_one_rank_runs() -> None:
    config = _config(zero_stage=0, tiled_mlp=True, tiled_loss=True, checkpoint_ratio=1.0)
    result = run_probe(probe_spec(ENTRY, config, CPU, steps=1, warmup_steps=1), timeout_s=START_S)
    assert result.status == "ok", result.message
    assert result.peak_bytes > 0
