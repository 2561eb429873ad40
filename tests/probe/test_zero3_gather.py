"""ZeRO-3's gathered parameters on real ranks (gloo, DS_ACCELERATOR=cpu), against the cost model.

DeepSpeed gathers a module into one flat tensor of ``partition x world`` elements, the rank's own share copied in
(``partition_parameters.py`` ``_all_gather_dtype``), and its parameters become views of that tensor while their own
partition stays allocated: a gathered module is whole beside its partition. On one rank nothing is gathered
(``NoGatherHandle``: the parameter is a view of its partition). The model here has eight small layers, so the gather
window holds all of them and the gathered bytes are most of a rank's parameters; pricing only the other ranks' share
put the two-rank prediction 45.5 MiB (13 %) under its measured peak (301.5 against 347.0 MiB; now 342.1, −1.4 %).
The layers are 512 wide so that the gathered bytes, not the CPU runtime (a few MiB that differ by environment: a
256-wide copy measured 111.2 MiB here and 117.7 in a fresh CI venv), set what the test sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.machine.device import get_hardware
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

#: eight layers of width 512 and a small vocabulary: the layers' parameters, not one large embedding, are the model
DEEP_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 512,
              "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": False}
SEQ_LEN = 32
KEYS = {"micro_batch_size": 1, "precision": "fp32", "optimizer": "adamw", "zero_stage": 3, "attention": "sdpa",
        "checkpoint_ratio": 0.0, "checkpoint_granularity": "block", "offload_optimizer": "none", "offload_params": "none",
        "compile": "off", "overlap_comm": False, "contiguous_gradients": True, "bucket_scale": 1, "sequence_parallel": 1,
        "tiled_mlp": False, "tiled_loss": False, "offload_activations": "none"}


@pytest.mark.slow
def test_two_zero3_ranks_hold_each_gathered_module_whole_beside_their_partition(tmp_path: Path) -> None:
    import autofit

    folder = tmp_path / "deep_llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DEEP_LLAMA))
    estimate = autofit.estimate(f"hf:{folder}", hardware="cpu", gpus=2, seq_len=SEQ_LEN, set=KEYS)
    assert estimate.candidates, estimate.rejected
    predicted = estimate.candidates[0].prediction.peak_bytes
    spec = probe_spec(f"hf:{folder}?seq_len={SEQ_LEN}", Config(**KEYS), get_hardware("cpu"), world_size=2, steps=1,
                      warmup_steps=1, facts=estimate.facts)
    result = run_probe(spec, timeout_s=300.0)
    assert result.status == "ok", result.message
    print(f"two ZeRO-3 ranks: predicted {predicted / 2**20:.1f} MiB, measured {result.peak_bytes / 2**20:.1f} MiB")
    # the bug this guards against puts the prediction 13 % under; the CPU runtime around the gathered bytes moves a
    # few percent with the environment (docs/results/memory.md has the measurements)
    assert predicted == pytest.approx(result.peak_bytes, rel=0.06)
