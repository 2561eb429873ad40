"""Config: validation of each key, ``--set`` parsing and value coercion."""

from __future__ import annotations

import dataclasses

import pytest

from autofit.core.config import (
    ATTENTIONS,
    COMPILES,
    CONFIG_KEYS,
    GRANULARITIES,
    OFFLOAD_DEVICES,
    OPTIMIZERS,
    PRECISIONS,
    ZERO_STAGES,
    Config,
    coerce_value,
    parse_set,
)
from autofit.core.errors import AutofitError


def test_config_keys_are_the_design_table():
    assert CONFIG_KEYS == (
        "micro_batch_size",
        "grad_accum_steps",
        "checkpoint_ratio",
        "precision",
        "optimizer",
        "zero_stage",
        "offload_optimizer",
        "offload_params",
        "attention",
        "checkpoint_granularity",
        "compile",
        "overlap_comm",
        "contiguous_gradients",
        "bucket_scale",
        "hpz_partition_size",
        "tensor_parallel",
        "sequence_parallel",
        "tiled_mlp",
        "tiled_loss",
        "offload_activations",
        "quantized_weights",
        "quantized_gradients",
    )


@pytest.mark.parametrize(
    ("key", "choices"),
    [
        ("precision", PRECISIONS),
        ("optimizer", OPTIMIZERS),
        ("checkpoint_granularity", GRANULARITIES),
        ("zero_stage", ZERO_STAGES),
        ("offload_optimizer", OFFLOAD_DEVICES),
        ("offload_params", OFFLOAD_DEVICES),
        ("attention", ATTENTIONS),
    ],
)
def test_every_listed_choice_is_valid(key, choices):
    for value in choices:
        assert getattr(Config(**{key: value}), key) == value


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("micro_batch_size", 0),
        ("micro_batch_size", -2),
        ("micro_batch_size", 1.5),
        ("micro_batch_size", True),
        ("grad_accum_steps", 0),
        ("grad_accum_steps", "4"),
        ("checkpoint_ratio", -0.1),
        ("checkpoint_ratio", 1.01),
        ("checkpoint_ratio", "0.5"),
        ("checkpoint_ratio", True),
        ("checkpoint_ratio", None),
        ("precision", "fp64"),
        ("precision", "BF16"),
        ("optimizer", "adam"),
        ("zero_stage", 4),
        ("zero_stage", "2"),
        ("offload_optimizer", "disk"),
        ("offload_params", None),
        ("attention", "xformers"),
    ],
)
def test_an_invalid_field_names_the_field_and_the_value(key, value):
    with pytest.raises(AutofitError) as info:
        Config(**{key: value})
    assert key in str(info.value)
    assert repr(value) in str(info.value)


def test_config_is_frozen_hashable_and_round_trips():
    config = Config(micro_batch_size=4, grad_accum_steps=2, precision="bf16", zero_stage=3, offload_params="cpu")
    assert Config.from_dict(config.to_dict()) == config
    assert len({config, Config.from_dict(config.to_dict())}) == 1
    with pytest.raises(AttributeError):
        config.micro_batch_size = 8  # type: ignore[misc]
    assert config.with_(zero_stage=2).zero_stage == 2
    with pytest.raises(AutofitError, match="zero_stage"):
        config.with_(zero_stage=7)


def test_to_dict_is_asdict_in_key_order():
    """``to_dict`` skips ``asdict``'s deep copy for speed: the same dict, key for key and in the same order."""
    for config in (Config(), Config(micro_batch_size=4, checkpoint_ratio=0.5, precision="bf16", zero_stage=3,
                                    offload_optimizer="cpu", overlap_comm=True, bucket_scale=4, sequence_parallel=2,
                                    tiled_mlp=True, offload_activations="cpu")):
        assert list(config.to_dict().items()) == list(dataclasses.asdict(config).items())


@pytest.mark.parametrize(("ratio", "n_layers"), [(0.0, 12), (0.25, 12), (0.5, 7), (1.0, 12), (0.75, 1)])
def test_checkpointed_layers_is_round_r_times_l(ratio, n_layers):
    assert Config(checkpoint_ratio=ratio).checkpointed_layers(n_layers) == round(ratio * n_layers)


def test_label_names_what_differs():
    base = Config()
    assert base.label() != base.with_(offload_optimizer="cpu", zero_stage=1).label()
    assert "opt>cpu" in base.with_(offload_optimizer="cpu", zero_stage=1).label()


def test_from_dict_refuses_unknown_keys():
    with pytest.raises(AutofitError, match="learning_rate"):
        Config.from_dict({"learning_rate": 1e-3})


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [
        ("micro_batch_size", "8", 8),
        ("micro_batch_size", 8.0, 8),
        ("zero_stage", "3", 3),
        ("grad_accum_steps", 4, 4),
        ("checkpoint_ratio", "0.5", 0.5),
        ("checkpoint_ratio", 1, 1.0),
        ("precision", "BF16", "bf16"),
        ("attention", "Flash", "flash"),
    ],
)
def test_coerce_value(key, raw, expected):
    value = coerce_value(key, raw)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("key", "raw"),
    [
        ("micro_batch_size", "eight"),
        ("micro_batch_size", "2.5"),
        ("micro_batch_size", 2.5),
        ("micro_batch_size", True),
        ("zero_stage", None),
        ("checkpoint_ratio", "half"),
        ("checkpoint_ratio", False),
        ("no_such_key", 1),
    ],
)
def test_coerce_value_names_the_key_and_the_value(key, raw):
    with pytest.raises(AutofitError) as info:
        coerce_value(key, raw)
    assert key in str(info.value)
    if key != "no_such_key":
        assert repr(raw) in str(info.value)


def test_parse_set_coerces_each_pair():
    assert parse_set(["zero_stage=2", "precision=BF16", " checkpoint_ratio = 0.25 ", "micro_batch_size=4"]) == {
        "zero_stage": 2,
        "precision": "bf16",
        "checkpoint_ratio": 0.25,
        "micro_batch_size": 4,
    }
    assert parse_set([]) == {}
    assert parse_set(["zero_stage=3", "zero_stage=3"]) == {"zero_stage": 3}
    with pytest.raises(AutofitError, match="zero_stage is given twice with different values"):
        parse_set(["zero_stage=1", "zero_stage=3"])  # issue 40: the last one no longer wins silently


@pytest.mark.parametrize(
    ("pair", "words"),
    [
        ("zero_stage", ["zero_stage"]),
        ("=2", ["=2"]),
        ("zero_stage=9", ["zero_stage", "9"]),
        ("precision=fp64", ["precision", "fp64"]),
        ("micro_batch_size=0", ["micro_batch_size", "0"]),
        ("micro_batch_size=big", ["micro_batch_size", "big"]),
        ("checkpoint_ratio=2", ["checkpoint_ratio", "2"]),
        ("learning_rate=1e-3", ["learning_rate"]),
        ("attention=", ["attention"]),
    ],
)
def test_parse_set_errors_name_the_key_and_the_value(pair, words):
    with pytest.raises(AutofitError) as info:
        parse_set([pair])
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_compile_is_off_or_on_from_yaml_booleans_and_set() -> None:
    assert COMPILES == ("off", "on")
    assert Config().compile == "off"
    # YAML 1.1 reads a bare on/off as a boolean: the key takes it back as the word
    assert coerce_value("compile", True) == "on" and coerce_value("compile", False) == "off"
    assert parse_set(["compile=on"]) == {"compile": "on"}
    assert "compiled" in Config(compile="on").label() and "compiled" not in Config().label()
    with pytest.raises(AutofitError, match="compile must be one of off, on"):
        Config(compile="yes")


@pytest.mark.parametrize(("text", "value"), [("true", True), ("on", True), ("1", True), ("false", False), ("off", False)])
def test_overlap_comm_and_contiguous_gradients_take_true_or_false(text, value):
    assert parse_set([f"overlap_comm={text}"]) == {"overlap_comm": value}
    assert parse_set([f"contiguous_gradients={text}"]) == {"contiguous_gradients": value}


def test_bad_communication_knobs_are_one_clear_error():
    with pytest.raises(AutofitError, match="overlap_comm must be true or false"):
        parse_set(["overlap_comm=maybe"])
    with pytest.raises(AutofitError, match="bucket_scale must be one of 1, 2, 4, 8"):
        parse_set(["bucket_scale=3"])
    with pytest.raises(AutofitError, match="overlap_comm must be true or false"):
        Config(overlap_comm="yes")  # type: ignore[arg-type]


def test_the_knobs_show_in_the_label():
    label = Config(zero_stage=2, overlap_comm=True, bucket_scale=4).label()
    assert "overlap" in label and "bucket4x" in label
    assert "overlap" not in Config().label()


def test_long_context_keys_validate_coerce_and_label():
    config = Config.from_dict({"sequence_parallel": "4", "tiled_mlp": "on", "tiled_loss": "true",
                               "offload_activations": "cpu", "checkpoint_ratio": 1.0})
    assert (config.sequence_parallel, config.tiled_mlp, config.tiled_loss) == (4, True, True)
    assert config.label().endswith("sp4 tmlp tloss aoff")
    assert Config().long_context_labels() == []
    assert parse_set(["sequence_parallel=2"]) == {"sequence_parallel": 2}
    with pytest.raises(AutofitError, match="sequence_parallel must be an integer >= 1"):
        Config(sequence_parallel=0)
    with pytest.raises(AutofitError, match="offload_activations must be one of none, cpu"):
        parse_set(["offload_activations=nvme"])
    with pytest.raises(AutofitError, match="tiled_mlp must be true or false"):
        parse_set(["tiled_mlp=maybe"])


def test_data_parallel_size_is_world_over_sequence_parallel():
    config = Config(micro_batch_size=2, grad_accum_steps=3, sequence_parallel=4)
    assert config.data_parallel(8) == 2
    assert config.samples_per_step(8) == 2 * 3 * 2
