"""Rules that read the machine's software (issue 13) and prune offload on a CPU device (issue 11)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS, Hardware
from autofit.core.rules import RULES, Context
from autofit.core.software import Software
from autofit.core.space import describe_rejections, enumerate_candidates, load_space
from autofit.machine.software import check_nvme_path

CPU = Hardware(name="cpu", kind="cpu", memory_bytes=8 * 2**30, peak_flops={"fp32": 1e12, "bf16": 1e12, "fp16": 1e12})
H100 = PRESETS["h100-80gb"]
A100 = PRESETS["a100-40gb"]


def enum(space, *, hardware=H100, global_batch=64, fixed=None, software=None):
    return enumerate_candidates(
        space, hardware=hardware, world_size=1, global_batch=global_batch, fixed=fixed or {},
        searches_attention=True, software=software if software is not None else Software(),
    )


def rule(name):
    return next(r for r in RULES if r.name == name)


def check(name, hardware=H100, **values):
    return check_with(name, Software(), hardware, **values)


NOTHING = Software(torchao=False, flash_attn=False, cuda_toolkit=False)


def check_with(name, software, hardware=H100, **values):
    r = rule(name)
    return r.check(Context(hardware, 1, None, software), *(values[k] for k in r.keys))


@pytest.mark.slow  # enumerates the default space
def test_offload_to_the_cpu_when_the_device_is_the_cpu_is_pruned_with_its_reason():
    result = enum(load_space("default"), hardware=CPU, global_batch=64)
    assert all(c.offload_optimizer == "none" and c.offload_params == "none" for c in result.candidates)
    lines = describe_rejections(result.rejected)
    assert "offload_optimizer=cpu: the device is the CPU: offloading to the host moves nothing off it " \
           "and adds DeepSpeed's buffers" in lines
    assert check("offload_on_a_cpu_device_params", H100, offload_params="cpu") is None
    with pytest.raises(AutofitError, match="offload_optimizer=cpu cannot run: the device is the CPU"):
        enum(load_space("cpu"), hardware=CPU, global_batch=64, fixed={"offload_optimizer": "cpu"})


@pytest.mark.slow  # enumerates the default space
def test_fp8_needs_torchao_and_the_device():
    assert check_with("fp8_needs_torchao", Software(), precision="fp8") is None
    assert "pip install -e '.[fp8]'" in check_with("fp8_needs_torchao", NOTHING, precision="fp8")
    assert check_with("fp8_needs_torchao", NOTHING, precision="bf16") is None
    # below sm89 the device itself has no fp8 (an A100 preset, or a detected card without it)
    assert check("precision_supported", A100, precision="fp8") == "a100-40gb has no fp8 support"
    result = enum(load_space("default"), global_batch=64, software=NOTHING)
    assert "precision=fp8: fp8 training needs torchao, which is not installed (pip install -e '.[fp8]')" in (
        describe_rejections(result.rejected)
    )
    assert all(c.precision != "fp8" for c in result.candidates)


@pytest.mark.slow  # enumerates the default space
def test_flash_needs_flash_attn_and_16_bit():
    assert "flash-attn" in check_with("flash_needs_flash_attn", NOTHING, attention="flash")
    assert check_with("flash_needs_flash_attn", NOTHING, attention="sdpa") is None
    assert check("flash_needs_16_bit", attention="flash", precision="fp32") == "flash attention runs in fp16/bf16 only, not fp32"
    assert check("flash_needs_16_bit", attention="flash", precision="bf16") is None
    result = enum(load_space("default"), global_batch=64)
    assert not any(c.attention == "flash" and c.precision == "fp32" for c in result.candidates)
    assert any(c.attention == "flash" for c in result.candidates)


@pytest.mark.parametrize(
    ("optimizer", "offload", "software", "ok"),
    [
        ("lion", "none", NOTHING, False),  # FusedLion is JIT-built with nvcc
        # CPU Adam/Lion are the CPU accelerator's builders on CUDA too, built by the host compiler: a pip-only
        # machine without nvcc keeps ZeRO-Offload
        ("lion", "cpu", NOTHING, True),
        ("adamw", "cpu", NOTHING, True),
        ("adamw", "cpu", replace(NOTHING, host_compiler=False), False),
        ("adamw", "cpu", replace(NOTHING, host_compiler=False, prebuilt_ops=frozenset({"cpu_adam"})), True),
        ("adamw", "cpu", Software(failed_ops=frozenset({"cpu_adam"})), False),  # its build failed this run
        ("adamw", "none", NOTHING, True),  # torch_adam instead
        ("lion", "none", Software(cuda_toolkit=False, prebuilt_ops=frozenset({"fused_lion"})), True),
        ("lion", "none", Software(), True),
        ("sgd", "none", NOTHING, True),
    ],
)
def test_deepspeed_ops_that_cannot_be_built_are_pruned(optimizer, offload, software, ok):
    reason = check_with("deepspeed_op_loadable", software, optimizer=optimizer, offload_optimizer=offload)
    assert (reason is None) == ok, reason
    # a CPU device builds its ops with the host compiler and runs Lion as a client optimizer
    assert check_with("deepspeed_op_loadable", NOTHING, CPU, optimizer=optimizer, offload_optimizer="none") is None


def test_nvme_offload_needs_a_path_and_async_io():
    no_path = replace(Software(), nvme_path=None)
    assert "--nvme-path" in check_with("nvme_offload_ready", no_path, offload_optimizer="nvme", offload_params="none")
    no_build = replace(Software(), cuda_toolkit=False)
    assert "async_io" in check_with("nvme_offload_ready", no_build, offload_optimizer="nvme", offload_params="none")
    assert check_with("nvme_offload_ready", Software(), offload_optimizer="none", offload_params="nvme") is None
    no_libaio = replace(Software(), libaio=False)
    assert "libaio" in check_with("nvme_offload_ready", no_libaio, offload_optimizer="none", offload_params="nvme")
    prebuilt = replace(no_libaio, prebuilt_ops=frozenset({"async_io"}))
    assert check_with("nvme_offload_ready", prebuilt, offload_optimizer="none", offload_params="nvme") is None


def test_one_reason_an_op_cannot_load_for_both_rules():
    """Software.op_unavailable says why; the optimizer rule and the NVMe rule both quote it."""
    failed = Software(failed_ops=frozenset({"cpu_adam", "async_io"}))
    assert failed.op_unavailable("cpu_adam") == failed.op_unavailable("async_io") == "whose build failed"
    assert check_with("deepspeed_op_loadable", failed, optimizer="adamw", offload_optimizer="cpu") == (
        "adamw needs DeepSpeed's cpu_adam op, whose build failed")
    assert check_with("nvme_offload_ready", failed, offload_optimizer="nvme", offload_params="none") == (
        "NVMe offload needs DeepSpeed's async_io op, whose build failed")
    no_cxx = replace(NOTHING, host_compiler=False)
    assert "without a C++ compiler" in no_cxx.op_unavailable("cpu_lion")
    assert check_with("deepspeed_op_loadable", NOTHING, optimizer="lion", offload_optimizer="none") == (
        "lion needs DeepSpeed's fused_lion op, which is not pre-built and cannot be built without a CUDA toolkit (nvcc)")
    assert "(nvcc)" in check_with("nvme_offload_ready", replace(Software(), cuda_toolkit=False),
                                  offload_optimizer="nvme", offload_params="none")
    assert "libaio-dev" in replace(Software(), libaio=False).op_unavailable("async_io")
    for software in (failed, no_cxx, NOTHING, Software(), replace(Software(), libaio=False)):
        for op in ("cpu_adam", "fused_lion", "async_io", "fused_adam"):
            assert software.can_load_op(op) == (software.op_unavailable(op) is None), (software, op)


@pytest.mark.slow
def test_cpu_adam_and_lion_are_host_ops_on_the_cuda_accelerator():
    """Why autofit.core.software.HOST_OPS holds them: DeepSpeed's CUDA accelerator hands out the CPU builders."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder
    from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

    from autofit.core.software import HOST_OPS, OP_BUILDERS

    accelerator = CUDA_Accelerator()
    for op, builder in OP_BUILDERS.items():
        cls = accelerator.get_op_builder(builder)
        if cls is not None and op != "deepspeed_shm_comm":
            assert issubclass(cls, CPUOpBuilder) == (op in HOST_OPS), op
            assert issubclass(cls, CUDAOpBuilder) == (op not in HOST_OPS), op


@pytest.mark.slow
def test_libaio_is_checked_with_deepspeeds_own_builder():
    """This machine has no libaio headers: DeepSpeed's AsyncIOBuilder says so, and so does autofit."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

    from autofit.machine.software import async_io_compatible

    assert async_io_compatible() == bool(AsyncIOBuilder().is_compatible(verbose=False))


def test_nvme_path_must_be_a_writable_directory(tmp_path):
    assert check_nvme_path(str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(AutofitError, match="not an existing directory"):
        check_nvme_path(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(AutofitError, match="not an existing directory"):
        check_nvme_path(str(tmp_path / "file"))


def test_one_cxx_lookup_reads_cxx_as_torchs_cpp_extension_does(monkeypatch, tmp_path) -> None:
    """find_cxx resolves CXX as torch.utils.cpp_extension.get_cxx_compiler (DeepSpeed's JIT builds) reads it: set
    wins, unset is the tool's default, set but empty is no compiler (torch then runs '')."""
    import shutil

    from torch.utils.cpp_extension import get_cxx_compiler

    from autofit.machine.software import CPP_EXTENSION_CXX, INDUCTOR_CXX, find_cxx

    fake = tmp_path / "my-cxx"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    for cxx in (None, "", str(fake), str(tmp_path / "missing-cxx")):
        if cxx is None:
            monkeypatch.delenv("CXX", raising=False)
        else:
            monkeypatch.setenv("CXX", cxx)
        torchs = shutil.which(get_cxx_compiler())
        assert find_cxx(CPP_EXTENSION_CXX) == (Path(torchs) if torchs else None), cxx
        if cxx is not None:  # both tools read the same variable
            assert find_cxx(INDUCTOR_CXX) == find_cxx(CPP_EXTENSION_CXX)
    monkeypatch.setenv("CXX", "")
    assert find_cxx("g++") is None and find_cxx("c++") is None


@pytest.mark.slow  # a fresh process: inductor reads CXX once, at import
def test_an_empty_cxx_is_no_compiler_to_inductor_either() -> None:
    import os
    import subprocess
    import sys

    code = ("from autofit.machine.software import INDUCTOR_CXX, find_cxx\n"
            "from torch._inductor.cpp_builder import get_cpp_compiler\n"
            "print('autofit', find_cxx(INDUCTOR_CXX))\n"
            "try:\n    print('inductor', get_cpp_compiler())\nexcept Exception as exc:\n    print('inductor fails', exc)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CXX": ""}, capture_output=True,
                          text=True, check=True, timeout=120)
    assert "autofit None" in done.stdout and "inductor fails" in done.stdout, done.stdout


def test_compile_needs_inductors_compiler_on_its_device() -> None:
    assert check("compile_needs_a_compiler", compile="off") is None
    assert check("compile_needs_a_compiler", compile="on") is None
    no_triton, no_cxx = Software(triton=False), Software(cxx_compiler=False)
    assert "needs triton" in check_with("compile_needs_a_compiler", no_triton, H100, compile="on")
    assert check_with("compile_needs_a_compiler", no_triton, CPU, compile="on") is None
    assert "C++ compiler" in check_with("compile_needs_a_compiler", no_cxx, CPU, compile="on")
    # the space says why compile went: one reason for the pruned group
    space = load_space("single_gpu")
    result = enum(space, software=no_triton, fixed={"precision": "bf16", "zero_stage": 2})
    assert {c.compile for c in result.candidates} == {"off"}
    assert any("needs triton" in reason for _, reason in result.rejected)


def test_fp8_with_zero3_is_pruned_with_torchaos_reason() -> None:
    reason = check("fp8_not_with_zero3", precision="fp8", zero_stage=3)
    assert "Float8Linear" in reason and "memory_efficient_linear" in reason
    assert check("fp8_not_with_zero3", precision="fp8", zero_stage=2) is None
    assert check("fp8_not_with_zero3", precision="bf16", zero_stage=3) is None


@pytest.mark.slow  # enumerates the default space
def test_communication_knobs_are_pruned_at_zero0_and_on_one_rank():
    space = load_space("default")
    h100 = PRESETS["h100-80gb"]
    one = enumerate_candidates(space, software=Software(),
                               hardware=h100, world_size=1, global_batch=8, fixed={}, searches_attention=True)
    assert all(not c.overlap_comm and c.bucket_scale == 1 for c in one.candidates)
    reasons = describe_rejections(one.rejected)
    assert any("only add memory on one rank" in line for line in reasons)
    eight = enumerate_candidates(space, software=Software(), hardware=h100, world_size=8, global_batch=64, fixed={},
                                 searches_attention=True)
    assert any(c.overlap_comm and c.bucket_scale == 4 for c in eight.candidates)
    assert all(not c.overlap_comm and c.bucket_scale == 1 for c in eight.candidates if c.zero_stage == 0)
    assert any("ZeRO 1-3 settings" in line for line in describe_rejections(eight.rejected))
