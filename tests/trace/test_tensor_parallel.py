"""One AutoTP rank's model as the trace builds it (the Linear layers the model's tp_plan names, split by DeepSpeed's
own plan converter), and a plan that prices a TP config from that rank's trace."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "long_context" / "tiny_llama"


def _tiny_llama():
    import transformers

    config = transformers.AutoConfig.from_pretrained(TINY)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def test_the_plan_s_column_layers_keep_their_outputs_share_and_row_layers_their_inputs_share():
    import torch

    from autofit.trace.tensor_parallel import split_linears

    whole, model = _tiny_llama(), _tiny_llama()
    split = split_linears(model, 2)
    shapes = {name: module.weight.shape for name, module in whole.named_modules() if isinstance(module, torch.nn.Linear)}
    column = row = 0
    for name, shape in shapes.items():
        kept = model.get_submodule(name)
        kept = getattr(kept, "shard", kept)  # the gathered head
        if kept.weight.shape == (shape[0] // 2, shape[1]):
            column += 1
        elif kept.weight.shape == (shape[0], shape[1] // 2):
            row += 1
    assert (split.column, split.row) == (column, row) and column > row > 0
    assert split.gathered_features == whole.config.vocab_size
    ids = torch.randint(0, whole.config.vocab_size, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits.shape == (2, 16, whole.config.vocab_size)  # gathered whole, as AutoTP's head returns them
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in whole.parameters())


def test_a_tp_config_is_priced_from_the_rank_s_trace_with_the_group_s_all_reduces():
    import autofit

    keys = {"zero_stage": 0, "micro_batch_size": 2, "checkpoint_ratio": 0.0, "attention": "sdpa", "precision": "fp32",
            "optimizer": "adamw", "compile": "off", "tiled_loss": False, "tiled_mlp": False}
    plans = {tp: autofit.estimate(f"hf:{TINY}", hardware="h100-80gb", gpus=2, seq_len=256, global_batch=8,
                                  set=keys | {"tensor_parallel": tp}) for tp in (1, 2)}
    whole, split = plans[1].candidates[0].prediction, plans[2].candidates[0].prediction
    rank = plans[2].facts.tensor_parallel_ranks["2"]
    assert rank.tensor_parallel == 2 and rank.n_params < plans[2].facts.n_params
    assert split.breakdown.params < whole.breakdown.params
    assert split.breakdown.activations < whole.breakdown.activations
    assert split.time_breakdown["tensor_parallel"] > 0 and "tensor_parallel" not in whole.time_breakdown
    assert split.samples_per_s > 0
