"""The model's hidden size, which ZeRO's bucket sizes are derived from (autofit.ds.buckets)."""

from __future__ import annotations

import torch
from torch import nn

from autofit.trace.structure import hidden_size_of, model_structure
from autofit.workload.types import Workload


def test_a_hugging_face_config_names_the_hidden_size():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, vocab_size=100))
    assert hidden_size_of(model) == 64


def test_a_plain_model_takes_the_width_most_linears_read():
    model = nn.Sequential(nn.Linear(10, 48), nn.Linear(48, 48), nn.Linear(48, 48), nn.Linear(48, 3))
    assert hidden_size_of(model) == 48
    assert hidden_size_of(nn.Sequential(nn.Conv2d(3, 4, 3))) == 0


def test_persistent_parameters_are_counted_under_the_derived_threshold():
    # hidden 48: ZeRO-3's persistence threshold is 10 x 48 = 480 elements: every bias and the last weight (3 x 48)
    # stay whole; the first weight (480 elements, not under it) and the 48 x 48 ones are partitioned
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(10, 48), nn.Linear(48, 48), nn.Linear(48, 48), nn.Linear(48, 3))

    structure = model_structure(Workload(model=build, batch=lambda n: {"x": torch.zeros(n, 10)}))
    assert structure.hidden_size == 48
    assert structure.n_persistent_params == (48 + 48 + 48 + 3) + 3 * 48
