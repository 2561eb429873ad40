"""Search spaces: loading, validation, the pruning rules and enumeration."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hostile_helpers import autofit, one_line_error

from autofit.core.config import CONFIG_KEYS, LONG_CONTEXT_KEYS, Config, parse_set
from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS, Hardware
from autofit.core.rules import OFFLOADABLE_OPTIMIZERS, RULES, Context
from autofit.core.sequence import SequenceShape
from autofit.core.software import Software
from autofit.core.space import (
    SPACE_KEYS,
    SearchSpace,
    count_surviving,
    dimensions,
    enumerate_candidates,
    load_space,
    pruned_assignments,
    search_space_dirs,
    shipped_spaces,
    space_from_dict,
    surviving_points,
)
from autofit.machine.device import get_hardware

REPO_SPACES = Path(__file__).resolve().parents[2] / "search_spaces"
SHIPPED = sorted(p.stem for p in REPO_SPACES.glob("*.yaml"))

CPU = Hardware(name="cpu", kind="cpu", memory_bytes=8 * 2**30, peak_flops={"fp32": 1e12, "bf16": 1e12, "fp16": 1e12})
H100 = PRESETS["h100-80gb"]
A100 = PRESETS["a100-40gb"]


def small_space(**values) -> SearchSpace:
    """A space with one value per key unless a list is given (keeps rule tests readable)."""
    base = {key: (getattr(Config(), key),) for key in SPACE_KEYS}
    return SearchSpace(name="t", description="test", values=base | values)


def enum(space, *, hardware=H100, world_size=1, global_batch=None, fixed=None, searches_attention=True):
    """Enumerate with every optional library present (tests do not depend on what this machine installed)."""
    return enumerate_candidates(
        space,
        hardware=hardware,
        world_size=world_size,
        global_batch=global_batch,
        fixed=fixed or {},
        searches_attention=searches_attention,
        software=Software(),
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


# --- loading -------------------------------------------------------------------------------------


def test_the_four_spaces_ship():
    assert {"default", "single_gpu", "cluster", "cpu"} <= set(SHIPPED)
    assert set(SHIPPED) <= set(shipped_spaces())


# the default space (1.45 M configs before rules) takes seconds to enumerate: in the slow tier
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "default" else n for n in SHIPPED])
def test_every_shipped_space_loads_and_enumerates(name):
    space = load_space(name)
    assert space.name == name
    assert space.description, f"{name} needs a description"
    assert set(space.values) == set(SPACE_KEYS)
    assert space.size() == math.prod(len(v) for v in space.values.values()) * (
        1 if space.global_batch_size else len(space.grad_accum_steps)
    )
    # the default (every value of every key): 1,451,520 before rules (compile and the ZeRO knobs multiplied it),
    # times the long-context keys, which vary only for an hf: causal LM (and are mostly pruned there: SP is ZeRO-3 only),
    # and hpZ's sizes, of which rules keep one across nodes and none on one, and ZeRO++'s quantized communication, which
    # the recipe narrows to off unless allowed
    long_context = math.prod(len(space.values[k]) for k in LONG_CONTEXT_KEYS)
    zero_plus = math.prod(len(space.values[k]) for k in ("hpz_partition_size", "quantized_weights", "quantized_gradients"))
    assert space.size() // (long_context * zero_plus) < 1_600_000
    assert long_context <= 7 * 2 * 2 * 2
    for hardware, world_size in ((CPU, 1), (H100, 8)):
        result = enum(space, hardware=hardware, world_size=world_size, global_batch=64)
        assert result.candidates
        assert len(set(result.candidates)) == len(result.candidates)
        for config in result.candidates:
            assert config.micro_batch_size * config.grad_accum_steps * config.data_parallel(world_size) == 64


@pytest.mark.parametrize("name", SHIPPED)
def test_loading_by_path_equals_loading_by_name(name):
    assert load_space(REPO_SPACES / f"{name}.yaml") == load_space(name)
    assert load_space(str(REPO_SPACES / f"{name}.yaml")) == load_space(name)


def test_none_is_the_default_space_and_it_is_the_full_table():
    space = load_space(None)
    assert space.name == "default"
    from autofit.core.config import ATTENTIONS, GRANULARITIES, OFFLOAD_DEVICES, OPTIMIZERS, PRECISIONS, ZERO_STAGES

    assert set(space.values["precision"]) == set(PRECISIONS)
    assert set(space.values["optimizer"]) == set(OPTIMIZERS)
    assert set(space.values["zero_stage"]) == set(ZERO_STAGES)
    assert set(space.values["offload_optimizer"]) == set(OFFLOAD_DEVICES)
    assert set(space.values["offload_params"]) == set(OFFLOAD_DEVICES)
    assert set(space.values["attention"]) == set(ATTENTIONS)
    assert set(space.values["checkpoint_granularity"]) == set(GRANULARITIES)


def test_bare_names_are_looked_up_next_to_the_package():
    assert REPO_SPACES in search_space_dirs()


def test_omitted_keys_take_the_config_default(tmp_path):
    space = load_space(write(tmp_path, "description: tiny\nmicro_batch_size: [2, 4]\nprecision: bf16\n"))
    assert space.values["micro_batch_size"] == (2, 4)
    assert space.values["precision"] == ("bf16",)
    assert space.values["optimizer"] == (Config().optimizer,)
    assert space.size() == 2


def test_values_are_coerced_and_deduplicated(tmp_path):
    space = load_space(write(tmp_path, "checkpoint_ratio: [0, 0.5, 0.0]\nprecision: [BF16, bf16]\n"))
    assert space.values["checkpoint_ratio"] == (0.0, 0.5)
    assert space.values["precision"] == ("bf16",)


@pytest.mark.parametrize(
    ("text", "field", "value"),
    [
        ("precision: [fp64]\n", "precision", "fp64"),
        ("micro_batch_size: [0]\n", "micro_batch_size", "0"),
        ("micro_batch_size: [two]\n", "micro_batch_size", "two"),
        ("micro_batch_size: [1.5]\n", "micro_batch_size", "1.5"),
        ("checkpoint_ratio: [1.5]\n", "checkpoint_ratio", "1.5"),
        ("checkpoint_ratio: [true]\n", "checkpoint_ratio", "True"),
        ("zero_stage: [4]\n", "zero_stage", "4"),
        ("optimizer: []\n", "optimizer", "[]"),
        ("optimizer: {adamw: 1}\n", "optimizer", "adamw"),
        ("attention: [[sdpa]]\n", "attention", "sdpa"),
        ("offload_params: [disk]\n", "offload_params", "disk"),
        ("learning_rate: [1]\n", "learning_rate", "learning_rate"),
        ("global_batch_size: 0\n", "global_batch_size", "0"),
        ("global_batch_size: many\n", "global_batch_size", "many"),
        ("global_batch_size: 64\ngrad_accum_steps: [1, 2]\n", "grad_accum_steps", "[1, 2]"),
        ("grad_accum_steps: [0]\n", "grad_accum_steps", "0"),
    ],
)
def test_a_bad_space_names_the_file_the_field_and_the_value(tmp_path, text, field, value):
    path = write(tmp_path, text)
    with pytest.raises(AutofitError) as info:
        load_space(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    assert field in message
    assert value in message


@pytest.mark.parametrize("text", ["micro_batch_size: [1, 2\n", "a: b: c\n", "[1, 2]\n", ""])
def test_malformed_yaml_is_one_line_naming_the_file(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(AutofitError) as info:
        load_space(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec", ["no_such_space", "missing/dir/space.yaml"])
def test_a_missing_space_is_an_error(spec):
    with pytest.raises(AutofitError, match=spec.split("/")[0]):
        load_space(spec)


def test_search_space_validates_direct_construction():
    with pytest.raises(AutofitError, match="attention"):
        SearchSpace(
            name="x", description="", values={k: v for k, v in small_space().values.items() if k != "attention"}
        )
    with pytest.raises(AutofitError, match="grad_accum_steps"):
        small_space(grad_accum_steps=(1,))


# --- the rules, one table each -------------------------------------------------------------------


def rule(name):
    return next(r for r in RULES if r.name == name)


def check(name, hardware=H100, world_size=1, global_batch=None, **values):
    r = rule(name)
    return r.check(Context(hardware, world_size, global_batch), *(values[k] for k in r.keys))


@pytest.mark.parametrize(
    ("hardware", "precision", "ok"),
    [
        (H100, "fp8", True),
        (H100, "bf16", True),
        (A100, "fp8", False),
        (A100, "bf16", True),
        (CPU, "fp8", False),
        (CPU, "fp32", True),
        (replace(CPU, peak_flops={"fp32": 1e12}), "bf16", False),
    ],
)
def test_precision_must_be_supported(hardware, precision, ok):
    assert (check("precision_supported", hardware, precision=precision) is None) == ok
    assert ok == hardware.supports_precision(precision)


@pytest.mark.parametrize(
    ("hardware", "attention", "ok"),
    [(H100, "flash", True), (CPU, "flash", False), (CPU, "sdpa", True), (CPU, "eager", True)],
)
def test_flash_only_where_supported(hardware, attention, ok):
    assert (check("flash_supported", hardware, attention=attention) is None) == ok


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
def test_param_offload_needs_zero3(device, stage):
    ok = device == "none" or stage == 3
    assert (check("param_offload_needs_zero3", offload_params=device, zero_stage=stage) is None) == ok


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
def test_optimizer_offload_needs_zero(device, stage):
    ok = device == "none" or (device == "cpu" and stage >= 1) or (device == "nvme" and stage == 3)
    assert (check("optimizer_offload_needs_zero", offload_optimizer=device, zero_stage=stage) is None) == ok


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "lion", "adafactor", "sgd"])
@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
def test_only_deepspeed_cpu_optimizers_offload(device, optimizer):
    ok = device == "none" or optimizer in OFFLOADABLE_OPTIMIZERS
    assert (check("optimizer_offloadable", offload_optimizer=device, optimizer=optimizer) is None) == ok


@pytest.mark.parametrize(
    ("hardware", "device", "ok"),
    [(H100, "nvme", True), (CPU, "nvme", False), (CPU, "cpu", True), (CPU, "none", True)],
)
def test_nvme_only_on_cuda(hardware, device, ok):
    assert (check("nvme_needs_cuda_optimizer", hardware, offload_optimizer=device) is None) == ok
    assert (check("nvme_needs_cuda_params", hardware, offload_params=device) is None) == ok


@pytest.mark.parametrize(
    ("micro", "world_size", "global_batch"),
    [(1, 1, 64), (4, 8, 64), (8, 8, 64), (16, 8, 64), (3, 1, 64), (2, 3, 12), (2, 4, 12), (4, 1, None)],
)
def test_micro_batch_must_divide_the_global_batch(micro, world_size, global_batch):
    ok = global_batch is None or global_batch % (micro * world_size) == 0
    reason = check("micro_batch_divides", world_size=world_size, global_batch=global_batch, micro_batch_size=micro,
                   sequence_parallel=1, tensor_parallel=1)
    assert (reason is None) == ok
    if not ok:
        assert str(micro) in reason and str(global_batch) in reason


# --- enumeration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("world_size", "global_batch"), [(1, 64), (8, 64), (2, 48), (3, 36)])
def test_accumulation_is_derived_from_the_global_batch(world_size, global_batch):
    space = small_space(micro_batch_size=(1, 2, 3, 4, 5, 8, 16, 32))
    result = enum(space, world_size=world_size, global_batch=global_batch)
    kept = {c.micro_batch_size for c in result.candidates}
    assert kept == {m for m in (1, 2, 3, 4, 5, 8, 16, 32) if global_batch % (m * world_size) == 0}
    for config in result.candidates:
        assert config.grad_accum_steps >= 1
        assert config.micro_batch_size * config.grad_accum_steps * world_size == global_batch
    pruned = {p["micro_batch_size"] for p, _ in result.rejected if "micro_batch_size" in p}
    assert pruned == {1, 2, 3, 4, 5, 8, 16, 32} - kept


def test_global_batch_argument_overrides_the_space_default():
    space = replace(small_space(micro_batch_size=(1, 2)), global_batch_size=8)
    assert {c.grad_accum_steps for c in enum(space).candidates} == {8, 4}
    assert {c.grad_accum_steps for c in enum(space, global_batch=4).candidates} == {4, 2}


def test_without_any_global_batch_the_space_accumulation_list_is_used():
    space = replace(small_space(micro_batch_size=(1, 2)), grad_accum_steps=(1, 4))
    got = {(c.micro_batch_size, c.grad_accum_steps) for c in enum(space).candidates}
    assert got == {(1, 1), (1, 4), (2, 1), (2, 4)}


def test_fixed_accumulation_beats_the_space_default_global_batch():
    space = replace(small_space(micro_batch_size=(1, 2)), global_batch_size=8)
    got = {(c.micro_batch_size, c.grad_accum_steps) for c in enum(space, fixed={"grad_accum_steps": 3}).candidates}
    assert got == {(1, 3), (2, 3)}


def test_fixed_accumulation_and_global_batch_decide_the_micro_batch():
    space = small_space(micro_batch_size=(1, 2))
    result = enum(space, world_size=2, global_batch=32, fixed={"grad_accum_steps": 4})
    assert [(c.micro_batch_size, c.grad_accum_steps) for c in result.candidates] == [(4, 4)]


@pytest.mark.parametrize(
    ("fixed", "field"),
    [
        ({"grad_accum_steps": 3}, "grad_accum_steps=3"),
        ({"grad_accum_steps": 2, "micro_batch_size": 2}, "micro_batch_size=2"),
        ({"micro_batch_size": 3}, "micro_batch_size=3"),
    ],
)
def test_fixed_batch_values_that_disagree_with_the_global_batch_raise(fixed, field):
    with pytest.raises(AutofitError, match=field):
        enum(small_space(), world_size=8, global_batch=64, fixed=fixed)


@pytest.mark.parametrize(
    ("key", "value"),
    [("micro_batch_size", 128), ("precision", "fp16"), ("checkpoint_ratio", 0.3)],
)
def test_fixed_values_replace_the_list_even_outside_it(key, value):
    space = load_space("cpu")
    assert value not in space.values[key]
    result = enum(space, hardware=CPU, global_batch=256, fixed={key: value})
    assert result.candidates
    assert {getattr(c, key) for c in result.candidates} == {value}


@pytest.mark.parametrize(
    ("hardware", "pairs", "words"),
    [
        (CPU, ["attention=flash"], ["attention", "flash"]),
        (A100, ["precision=fp8"], ["precision", "fp8"]),
        (CPU, ["offload_optimizer=nvme"], ["offload_optimizer", "nvme"]),
        (H100, ["offload_params=cpu", "zero_stage=2"], ["offload_params", "zero_stage=2"]),
        (H100, ["offload_optimizer=cpu", "zero_stage=0"], ["offload_optimizer", "zero_stage=0"]),
        (H100, ["offload_optimizer=cpu", "optimizer=sgd"], ["offload_optimizer", "sgd"]),
    ],
)
def test_an_impossible_fixed_value_raises_one_line(hardware, pairs, words):
    with pytest.raises(AutofitError) as info:
        enum(load_space("default"), hardware=hardware, global_batch=64, fixed=parse_set(pairs))
    assert "\n" not in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_a_fixed_value_no_listed_partner_accepts_raises():
    space = small_space(zero_stage=(0, 1, 2))
    with pytest.raises(AutofitError, match="offload_params"):
        enum(space, fixed={"offload_params": "cpu"})


def test_fixed_value_narrows_its_partners():
    result = enum(load_space("default"), global_batch=64, fixed={"offload_params": "cpu"})
    assert {c.zero_stage for c in result.candidates} == {3}


@pytest.mark.parametrize(
    ("hardware", "world_size", "global_batch"), [(CPU, 1, None), (CPU, 1, 16), (H100, 8, 64), (A100, 2, 64)]
)
def test_fixing_everything_gives_exactly_one(hardware, world_size, global_batch):
    fixed = {
        "micro_batch_size": 2,
        "checkpoint_ratio": 0.5,
        "precision": "bf16",
        "optimizer": "adamw",
        "zero_stage": 1,
        "offload_optimizer": "none",
        "offload_params": "none",
        "attention": "sdpa",
        "checkpoint_granularity": "block",
        "compile": "off",
        "overlap_comm": True,
        "contiguous_gradients": True,
        "bucket_scale": 1,
    }
    if world_size == 1:
        fixed["overlap_comm"] = False  # a rule drops it on one rank
    if global_batch is None:
        fixed["grad_accum_steps"] = 3
    result = enum(
        load_space("default"), hardware=hardware, world_size=world_size, global_batch=global_batch, fixed=fixed
    )
    assert len(result.candidates) == 1
    config = result.candidates[0]
    for key, value in fixed.items():
        assert getattr(config, key) == value
    if global_batch is not None:
        assert config.micro_batch_size * config.grad_accum_steps * world_size == global_batch


def test_fixing_every_key_with_parse_set_gives_exactly_one():
    pairs = [f"{key}={value}" for key, value in Config(micro_batch_size=4, grad_accum_steps=2).to_dict().items()]
    assert len(pairs) == len(CONFIG_KEYS)
    result = enum(load_space("default"), world_size=8, fixed=parse_set(pairs))
    assert result.candidates == [Config(micro_batch_size=4, grad_accum_steps=2)]


@pytest.mark.slow  # enumerates the default space
def test_attention_collapses_when_the_workload_does_not_search_it():
    space = load_space("default")
    result = enum(space, global_batch=64, searches_attention=False)
    assert {c.attention for c in result.candidates} == {"sdpa"}
    searched = enum(space, global_batch=64, searches_attention=True)
    # eager and sdpa for each, flash for each that is not fp32 (flash-attn runs 16-bit only)
    n_flash = sum(c.precision != "fp32" for c in result.candidates)
    assert len(searched.candidates) == 2 * len(result.candidates) + n_flash
    assert len(enum(space, global_batch=64, searches_attention=False, fixed={"attention": "sdpa"}).candidates) == len(
        result.candidates
    )
    with pytest.raises(AutofitError, match="attention=eager"):
        enum(space, global_batch=64, searches_attention=False, fixed={"attention": "eager"})


@pytest.mark.slow  # enumerates the default space
def test_rules_hold_for_every_candidate_and_rejections_are_compact():
    space = load_space("default")
    for hardware, world_size in ((CPU, 1), (H100, 8), (A100, 4)):
        result = enum(space, hardware=hardware, world_size=world_size, global_batch=64)
        ctx = Context(hardware, world_size, 64)
        for config in result.candidates:
            for r in RULES:
                assert r.check(ctx, *(getattr(config, k) for k in r.keys)) is None, (r.name, config)
        # one entry per rule and partial assignment: bounded by the space's lists, not its product
        assert len(result.rejected) < 50
        assert len({tuple(sorted(p.items())) for p, _ in result.rejected}) == len(result.rejected)
        for partial, reason in result.rejected:
            assert set(partial) <= set(SPACE_KEYS) and reason


def test_enumeration_is_deterministic_and_follows_the_space_order():
    space = small_space(micro_batch_size=(4, 1, 2), precision=("bf16", "fp32"))
    first = enum(space, global_batch=8)
    assert first == enum(space, global_batch=8)
    assert [(c.micro_batch_size, c.precision) for c in first.candidates] == [
        (4, "bf16"),
        (4, "fp32"),
        (1, "bf16"),
        (1, "fp32"),
        (2, "bf16"),
        (2, "fp32"),
    ]


def test_a_space_nothing_survives_raises():
    with pytest.raises(AutofitError, match="no config"):
        enum(small_space(micro_batch_size=(16, 32)), world_size=8, global_batch=64)


@pytest.mark.parametrize(("world_size", "global_batch"), [(0, None), (-1, None), (True, None), (1, 0), (1, 2.5)])
def test_bad_world_size_or_global_batch_raises(world_size, global_batch):
    with pytest.raises(AutofitError):
        enum(small_space(), world_size=world_size, global_batch=global_batch)


def test_unknown_or_invalid_fixed_key_raises():
    with pytest.raises(AutofitError, match="learning_rate"):
        enum(small_space(), fixed={"learning_rate": 1})
    with pytest.raises(AutofitError, match="fp64"):
        enum(small_space(), fixed={"precision": "fp64"})


def test_detected_cpu_enumerates_the_cpu_space():
    result = enum(load_space("cpu"), hardware=get_hardware("cpu"), world_size=1, global_batch=None)
    assert result.candidates
    assert all(c.attention != "flash" and c.precision in ("fp32", "bf16") for c in result.candidates)


# --- the bound on candidates, counted before the walk ------------------------------------------

#: Llama-3.1-8B's sequence, so that the long-context keys' rules prune (tests/core/test_long_context_rules.py)
LONG = SequenceShape(seq_len=65536, n_heads=32, n_kv_heads=8, hidden_size=4096)


@pytest.mark.parametrize("name", ["cpu", "single_gpu", "cluster"])
@pytest.mark.parametrize(("hardware", "world_size", "global_batch", "sequence"),
                         [(CPU, 1, None, None), (H100, 8, 64, None), (A100, 1, 24, None), (H100, 8, 16, LONG)],
                         ids=["cpu", "h100x8", "a100-gb24", "h100x8-long"])
def test_the_count_of_runnable_candidates_is_the_walks_length(name, hardware, world_size, global_batch, sequence):
    ctx = Context(hardware, world_size, global_batch, Software(), sequence)
    dims = dimensions(load_space(name), {}, ctx, searches_attention=True)
    bad, _ = pruned_assignments(dims, ctx)
    assert count_surviving(dims, bad) == sum(1 for _ in surviving_points(dims, bad)) > 0


def huge_space(n: int = 10**4) -> dict:
    """10^4 micro-batches x 10^4 checkpoint ratios: 10^8 configs (issue 51)."""
    return {"micro_batch_size": list(range(1, n + 1)), "checkpoint_ratio": [i / n for i in range(n)]}


@pytest.mark.parametrize(("global_batch", "n_runnable"), [(None, "100,000,000"), (16, None), (10_000, None)])
def test_a_space_of_1e8_is_counted_before_the_walk(global_batch, n_runnable):
    """Counted exactly before anything is walked: with no global batch all 10^8 can run (refused, the count said);
    --global-batch 16 leaves the 5 dividing micro-batches, 50,000 candidates (under the bound: enumerated)."""
    space = space_from_dict(huge_space(), name="huge")
    ctx = Context(CPU, 1, global_batch, Software())
    dims = dimensions(space, {}, ctx, searches_attention=False)
    bad, _ = pruned_assignments(dims, ctx)
    divisors = None if global_batch is None else sum(global_batch % m == 0 for m in range(1, 10**4 + 1))
    assert count_surviving(dims, bad) == (10**8 if divisors is None else divisors * 10**4)
    if n_runnable is not None:
        with pytest.raises(AutofitError, match=f"has {n_runnable} candidates that can run here"):
            enum(space, hardware=CPU, global_batch=global_batch, searches_attention=False)


@pytest.mark.slow  # a CLI run
def test_estimate_refuses_a_1e8_space_file_in_one_line_within_seconds(tmp_path):
    import yaml

    space = tmp_path / "huge.yaml"
    space.write_text(yaml.safe_dump(huge_space()))
    example = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
    start = time.monotonic()
    res = autofit("estimate", f"{example}:workload", "--hardware", "cpu", "--memory", "2GiB", "--space", str(space),
                  timeout=120)
    elapsed_s = time.monotonic() - start
    assert one_line_error(res, "has 100,000,000 candidates that can run here (more than 250,000)"), res.stderr[-600:]
    assert len(res.stderr.strip().splitlines()) == 1 and not res.stdout
    assert elapsed_s < 10, elapsed_s  # imports included; walked to the bound before: minutes at a global batch
