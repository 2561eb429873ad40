"""The DeepSpeed JSON: every optimizer x ZeRO stage x precision is accepted by DeepSpeed itself."""

from __future__ import annotations

import itertools
import json
import os

# DeepSpeedConfig asks the accelerator for its dtypes; pin the CPU one before deepspeed is imported
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402

from autofit.core.config import OFFLOAD_DEVICES, OPTIMIZERS, PRECISIONS, ZERO_STAGES, Config  # noqa: E402
from autofit.core.errors import AutofitError  # noqa: E402
from autofit.core.software import Software  # noqa: E402
from autofit.ds.emit import (  # noqa: E402
    CLIENT_OPTIMIZERS,
    DEEPSPEED_OPTIMIZER_TYPE,
    check_with_deepspeed,
    deepspeed_config,
    uses_client_optimizer,
)

pytest.importorskip("deepspeed")

GRID = list(itertools.product(OPTIMIZERS, ZERO_STAGES, PRECISIONS))


@pytest.mark.parametrize(("optimizer", "stage", "precision"), GRID)
@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("device_kind", ["cuda", "cpu"])
def test_deepspeed_accepts_every_optimizer_stage_and_precision(optimizer, stage, precision, world_size, device_kind):
    config = Config(micro_batch_size=2, grad_accum_steps=3, optimizer=optimizer, zero_stage=stage, precision=precision)
    ds = deepspeed_config(config, world_size=world_size, device_kind=device_kind)
    check_with_deepspeed(ds)
    assert json.loads(json.dumps(ds)) == ds  # plain JSON, nothing only Python can hold
    assert ds["train_batch_size"] == config.micro_batch_size * config.grad_accum_steps * world_size
    assert ds["train_micro_batch_size_per_gpu"] == config.micro_batch_size
    assert ds["gradient_accumulation_steps"] == config.grad_accum_steps
    assert ds["zero_optimization"]["stage"] == stage
    assert ds.get("bf16", {}).get("enabled", False) == (precision in ("bf16", "fp8"))
    assert ds.get("fp16", {}).get("enabled", False) == (precision == "fp16")
    if uses_client_optimizer(config, device_kind):
        assert optimizer in CLIENT_OPTIMIZERS or optimizer == "lion"
        assert "optimizer" not in ds
        assert "client_optimizer" in ds["autofit"]
    else:
        assert ds["optimizer"]["type"] == DEEPSPEED_OPTIMIZER_TYPE[optimizer]
    assert Config.from_dict(ds["autofit"]["config"]) == config


@pytest.mark.parametrize(
    ("stage", "offload_optimizer", "offload_params"),
    [
        (s, o, p)
        for s, o, p in itertools.product(ZERO_STAGES, OFFLOAD_DEVICES, OFFLOAD_DEVICES)
        if (p == "none" or s == 3) and (o == "none" or s >= 1) and (o != "nvme" or s == 3)
    ],
)
@pytest.mark.parametrize("optimizer", ["adamw", "lion"])
def test_deepspeed_accepts_the_offloads_the_space_allows(stage, offload_optimizer, offload_params, optimizer, tmp_path):
    config = Config(
        zero_stage=stage,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        optimizer=optimizer,
        precision="bf16",
    )
    ds = deepspeed_config(config, software=Software(nvme_path=str(tmp_path)))
    check_with_deepspeed(ds)
    zero = ds["zero_optimization"]
    assert zero.get("offload_optimizer", {}).get("device", "none") == offload_optimizer
    assert zero.get("offload_param", {}).get("device", "none") == offload_params


def test_check_with_deepspeed_refuses_an_inconsistent_batch():
    ds = deepspeed_config(Config(micro_batch_size=2, grad_accum_steps=3))
    ds["train_batch_size"] = 7
    with pytest.raises(Exception, match="train_batch_size"):
        check_with_deepspeed(ds)


def test_autofit_section_carries_what_deepspeed_cannot_say():
    config = Config(checkpoint_ratio=0.5, attention="flash", precision="fp8")
    ds = deepspeed_config(config)
    section = ds["autofit"]
    assert section["checkpoint_ratio"] == 0.5
    assert section["attention"] == "flash"
    # fp8 is torchao's float8 training applied to the model (autofit.ds.apply), DeepSpeed runs bf16 around it
    assert section["fp8"] == {"library": "torchao", "recipe": "tensorwise"}
    assert ds["bf16"] == {"enabled": True}


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_compile_goes_in_the_autofit_section_and_deepspeed_accepts_the_json(precision):
    """DeepSpeed's "compile" section configures DeepCompile and compiles nothing: compile is a call,
    engine.compile(), which autofit.ds.apply.compile_engine makes where the section says "on"."""
    ds = deepspeed_config(Config(precision=precision, zero_stage=2, compile="on"))
    assert ds["autofit"]["compile"] == "on"
    assert "compile" not in ds  # DeepCompile stays off
    check_with_deepspeed(ds)
    assert deepspeed_config(Config())["autofit"]["compile"] == "off"


def test_adamw_runs_as_torch_adam_where_fused_adam_cannot_be_built():
    config = Config(optimizer="adamw", precision="bf16")
    no_nvcc = Software(cuda_toolkit=False)
    ds = deepspeed_config(config, device_kind="cuda", software=no_nvcc)
    assert ds["optimizer"]["params"]["torch_adam"] is True
    check_with_deepspeed(ds)
    prebuilt = Software(cuda_toolkit=False, prebuilt_ops=frozenset({"fused_adam"}))
    assert "torch_adam" not in deepspeed_config(config, device_kind="cuda", software=prebuilt)["optimizer"]["params"]
    assert "torch_adam" not in deepspeed_config(config, device_kind="cuda", software=Software())["optimizer"]["params"]
    # the CPU builds its FusedAdam with the host compiler
    assert "torch_adam" not in deepspeed_config(config, device_kind="cpu", software=no_nvcc)["optimizer"]["params"]


def test_offload_writes_the_nvme_path_and_pins_where_the_host_allows(tmp_path):
    config = Config(zero_stage=3, offload_optimizer="nvme", offload_params="cpu", precision="bf16")
    ds = deepspeed_config(config, software=Software(nvme_path=str(tmp_path), pin_memory=True))
    zero = ds["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": str(tmp_path)}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    unpinned = deepspeed_config(config, software=Software(nvme_path=str(tmp_path), pin_memory=False))
    assert unpinned["zero_optimization"]["offload_param"]["pin_memory"] is False
    with pytest.raises(AutofitError, match="--nvme-path"):
        deepspeed_config(config, software=Software(nvme_path=None))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("overlap", "contiguous", "scale"), [(False, True, 1), (True, True, 4), (True, False, 2)])
def test_deepspeed_reads_each_communication_knob_as_written(stage, overlap, contiguous, scale):
    from deepspeed.runtime.config import DeepSpeedConfig

    config = Config(zero_stage=stage, precision="bf16", overlap_comm=overlap, contiguous_gradients=contiguous,
                    bucket_scale=scale)
    hidden = 96  # the model's hidden size: buckets of hidden^2 x scale
    ds = deepspeed_config(config, world_size=1, device_kind="cuda", hidden_size=hidden)
    zero = DeepSpeedConfig(ds).zero_config  # DeepSpeed's own parser and its pydantic zero config model
    assert zero.stage == stage
    assert zero.overlap_comm is overlap
    assert zero.contiguous_gradients is contiguous
    assert zero.reduce_bucket_size == scale * hidden * hidden
    assert zero.allgather_bucket_size == scale * hidden * hidden
    if stage == 3:
        assert zero.prefetch_bucket_size == int(0.9 * hidden * hidden) * scale
        assert zero.param_persistence_threshold == 10 * hidden
        assert zero.max_live_parameters == 1_000_000_000


def test_an_unknown_hidden_size_keeps_the_buckets_autofit_pinned_before():
    ds = deepspeed_config(Config(zero_stage=3, bucket_scale=2), hidden_size=0)
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == 2 * 50_000_000
    assert zero["stage3_param_persistence_threshold"] == 100_000
    assert zero["overlap_comm"] is False
