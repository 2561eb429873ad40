"""autofit.ds.long_context in one process: the tiles compute what the untiled model does; the batch and collator
shapes; the Trainer's JSON under SP. Two-rank runs (Ulysses SP itself) are in tests/examples/test_long_context_example.py and
tests/probe/test_long_context_probe.py."""

from __future__ import annotations

import pytest

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.sequence import loss_tiles
from autofit.ds.apply import LongContext, activation_offload_context, apply_to_model, shard_batch
from autofit.ds.collate import SequenceCollator
from autofit.ds.emit import deepspeed_config
from autofit.ds.launchers import with_sp_batch_left_to_accelerate
from autofit.ds.long_context import agreed_tiles

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _model(seed: int = 0) -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def _ds(**keys: object) -> dict:
    values: dict = dict(precision="fp32", optimizer="adamw", zero_stage=3, attention="sdpa")
    return deepspeed_config(Config(**(values | keys)), 2, "cpu")  # type: ignore[arg-type]


def _loss_and_grads(model: object, batch: dict) -> tuple[float, dict]:
    loss = model(**batch).loss
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_tiled_mlp_and_tiled_loss_compute_the_untiled_loss_and_gradients() -> None:
    batch = {"input_ids": torch.randint(0, 96, (2, 70)), "labels": torch.randint(0, 96, (2, 70))}
    batch["labels"][0, :5] = -100
    plain_loss, plain_grads = _loss_and_grads(_model(), batch)
    tiled = _model()
    apply_to_model(tiled, _ds(tiled_mlp=True, tiled_loss=True), tiled.model.layers)
    tiled_loss, tiled_grads = _loss_and_grads(tiled, batch)
    assert tiled_loss == pytest.approx(plain_loss, rel=1e-6)
    for name, grad in plain_grads.items():  # lm_head too: Finding 2 (its gradient sees the 1/n_tokens scale)
        assert torch.allclose(tiled_grads[name], grad, rtol=1e-4, atol=1e-6), name
    assert loss_tiles(96, 16) == 6 and agreed_tiles(70, 16) == 5  # ceil(V/h) and ceil(tokens/h), one process


def test_tiled_loss_leaves_a_forward_without_labels_alone() -> None:
    model = _model()
    apply_to_model(model, _ds(tiled_loss=True), model.model.layers)
    out = model(input_ids=torch.randint(0, 96, (1, 8)))
    assert out.logits.shape == (1, 8, 96) and out.loss is None


def test_the_keys_are_read_from_the_json_and_off_by_default() -> None:
    keys = LongContext.of(_ds(sequence_parallel=2, tiled_mlp=True))
    assert (keys.sequence_parallel, keys.tiled_mlp, keys.tiled_loss, keys.zero_stage, keys.own_loss) == (2, True, False,
                                                                                                         3, True)
    assert LongContext.of({}) == LongContext()
    with activation_offload_context(_ds()):  # none: a null context
        pass


def test_without_sp_the_batch_is_unchanged() -> None:
    batch = {"input_ids": torch.ones(1, 6, dtype=torch.long), "labels": torch.ones(1, 6, dtype=torch.long)}
    assert shard_batch(batch, None).keys() == batch.keys()


def test_the_collator_pads_to_a_multiple_of_the_degree_and_adds_positions() -> None:
    collate = SequenceCollator.for_json(_ds(sequence_parallel=2))
    batch = collate([{"input_ids": torch.arange(5)}, {"input_ids": torch.arange(3)}])
    assert batch["input_ids"].shape == (2, 6) and batch["position_ids"][1].tolist() == list(range(6))
    assert batch["labels"][1].tolist() == [0, 1, 2, -100, -100, -100]
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 1, 1, 0]
    assert SequenceCollator.for_json(_ds()).padded_length(5) == 5
    with pytest.raises(AutofitError, match="pad_to_multiple_of"):
        SequenceCollator(pad_to_multiple_of=0)


def test_the_trainer_gets_the_json_with_its_batch_left_to_accelerate_under_sp() -> None:
    ds = _ds(sequence_parallel=2)
    keywords = with_sp_batch_left_to_accelerate({"deepspeed": "ds.json"}, ds)
    assert keywords["deepspeed"]["train_batch_size"] == "auto" and ds["train_batch_size"] == 1
    assert with_sp_batch_left_to_accelerate({"deepspeed": "ds.json"}, _ds()) == {"deepspeed": "ds.json"}
