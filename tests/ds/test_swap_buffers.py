"""NVMe swap buffers: sized for the largest parameter, accepted by DeepSpeed's parser and its swapper's check."""

from __future__ import annotations

import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autofit.core.config import Config
from autofit.core.hardware import PRESETS
from autofit.core.software import Software
from autofit.ds import swap_buffers
from autofit.ds.emit import check_with_deepspeed, deepspeed_config

ROOT = Path(__file__).resolve().parents[2]
PRESETS_H100 = PRESETS["h100-80gb"]
#: LLaMA-1 7B's embedding (examples/llama_7b.py: vocabulary 32000 x hidden 4096), its largest parameter
LLAMA_7B_EMBEDDING = 32000 * 4096


def test_the_constants_are_deepspeeds() -> None:
    from deepspeed.runtime.swap_tensor import constants, utils
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    param, optimizer = DeepSpeedZeroOffloadParamConfig(), DeepSpeedZeroOffloadOptimizerConfig()
    assert swap_buffers.AIO_ALIGNED_BYTES == utils.AIO_ALIGNED_BYTES
    assert swap_buffers.AIO_INTRA_OP_PARALLELISM == constants.AIO_INTRA_OP_PARALLELISM_DEFAULT
    assert swap_buffers.PARAM_SWAP_BUFFER_COUNT == param.buffer_count
    assert swap_buffers.DEFAULT_PARAM_SWAP_BUFFER_ELEMENTS == param.buffer_size
    assert swap_buffers.OPTIMIZER_SWAP_BUFFER_COUNT == optimizer.buffer_count
    assert swap_buffers.SUB_GROUP_ELEMENTS == DeepSpeedZeroConfig().sub_group_size


def swapper_get_buffer(ds: dict, dtype: torch.dtype, partition_numel: int) -> torch.Tensor:
    """DeepSpeed's own ``AsyncPartitionedParameterSwapper.get_buffer`` on the pool ``ds`` configures.

    ``_configure_aio`` is replayed without its aio handles (the async_io op needs libaio and pins GBs): the
    attributes it sets, from the parsed config, with the pool on the meta device."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.swap_tensor import partitioned_param_swapper
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper
    from deepspeed.runtime.swap_tensor.utils import AIO_ALIGNED_BYTES

    parsed = DeepSpeedConfig({k: v for k, v in ds.items() if k != "train_batch_size"})
    swapper = object.__new__(AsyncPartitionedParameterSwapper)
    swapper.swap_config = parsed.zero_config.offload_param
    swapper.swap_element_size = torch.tensor([], dtype=dtype).element_size()
    swapper.numel_alignment = AIO_ALIGNED_BYTES * parsed.aio_config["intra_op_parallelism"] // swapper.swap_element_size
    swapper.elements_per_buffer = swapper.swap_config.buffer_size
    swapper.aligned_elements_per_buffer = swapper._io_aligned_numel(swapper.elements_per_buffer)
    swapper.param_buffer_count = swapper.swap_config.buffer_count
    swapper.available_buffer_ids = list(range(swapper.param_buffer_count))
    swapper.param_id_to_numel, swapper.param_id_to_buffer_id, swapper.param_id_to_swap_buffer = {}, {}, {}
    swapper.buffers = torch.empty(int(swapper.aligned_elements_per_buffer * swapper.param_buffer_count), dtype=dtype,
                                  device="meta")
    with pytest.MonkeyPatch.context() as patch:  # its log line asks the rank of a process group a test has none of
        patch.setattr(partitioned_param_swapper.dist, "get_rank", lambda: 0)
        return swapper.get_buffer(types.SimpleNamespace(ds_id=0), partition_numel)


def zero3_partition_numel(numel: int, world_size: int) -> int:
    """``partition_size`` as ZeRO-3's ``Init._partition`` computes it (``_aligned_size // world_size``)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    init = types.SimpleNamespace(_partition_world_size=lambda param: world_size)
    init._padding_size = lambda param: Init._padding_size(init, param)
    param = types.SimpleNamespace(ds_numel=numel)
    return Init._aligned_size(init, param) // world_size


NVME = Config(zero_stage=3, offload_params="nvme", offload_optimizer="nvme", precision="bf16", micro_batch_size=1)


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_a_7b_embedding_fits_the_emitted_param_swap_buffer(tmp_path: Path, world_size: int) -> None:
    software = Software(nvme_path=str(tmp_path))
    ds = deepspeed_config(NVME, world_size, "cuda", software, largest_param_numel=LLAMA_7B_EMBEDDING)
    check_with_deepspeed(ds)
    partition = zero3_partition_numel(LLAMA_7B_EMBEDDING, world_size)
    buffer = swapper_get_buffer(ds, torch.bfloat16, partition)
    assert buffer.numel() >= partition
    assert ds["zero_optimization"]["offload_param"]["buffer_count"] == swap_buffers.PARAM_SWAP_BUFFER_COUNT


def test_deepspeeds_default_buffer_refuses_a_7b_embedding(tmp_path: Path) -> None:
    """Why the size is emitted: without it, the swapper's check fails on one rank."""
    ds = deepspeed_config(NVME, 1, "cuda", Software(nvme_path=str(tmp_path)))
    assert "buffer_size" not in ds["zero_optimization"]["offload_param"]
    with pytest.raises(AssertionError, match="More elements 131072000 than buffer size 100000000"):
        swapper_get_buffer(ds, torch.bfloat16, zero3_partition_numel(LLAMA_7B_EMBEDDING, 1))


def test_the_buffer_size_is_io_aligned() -> None:
    size = swap_buffers.param_swap_buffer_elements(1001, 1, 2)
    assert size == 1024 and swap_buffers.param_swap_buffer_elements(1001, 1, 4) == 1024  # 1 KiB / 2 B, / 4 B
    assert swap_buffers.param_swap_buffer_elements(4096, 8, 2) == 512


def test_cpu_offload_and_no_nvme_leave_the_json_alone(tmp_path: Path) -> None:
    cpu = replace(NVME, offload_params="cpu", offload_optimizer="cpu")
    ds = deepspeed_config(cpu, 1, "cuda", Software(nvme_path=str(tmp_path)), largest_param_numel=LLAMA_7B_EMBEDDING)
    assert "buffer_size" not in ds["zero_optimization"]["offload_param"]


def test_nvme_pins_the_swap_buffers_on_the_host_instead_of_the_partitions() -> None:
    """The host model prices NVMe offload's pinned pools, not the partitions it moves to the drive."""
    from autofit.cost_model.host import host_steady_bytes
    from tests.toy_facts import FACTS

    facts = replace(FACTS, largest_param_numel=LLAMA_7B_EMBEDDING)
    w = 2
    nvme = host_steady_bytes(replace(NVME, offload_optimizer="none"), facts, 1)
    buffer = swap_buffers.param_swap_buffer_elements(LLAMA_7B_EMBEDDING, 1, w)
    assert nvme >= swap_buffers.PARAM_SWAP_BUFFER_COUNT * buffer * w
    cpu = host_steady_bytes(replace(NVME, offload_optimizer="none", offload_params="cpu"), facts, 1)
    assert cpu == w * (facts.n_trainable_params - facts.n_persistent_params)
    optimizer = host_steady_bytes(replace(NVME, offload_params="none"), facts, 1)
    assert optimizer >= swap_buffers.OPTIMIZER_SWAP_BUFFER_COUNT * min(facts.n_trainable_params, 10**9) * 4


@pytest.mark.slow
def test_the_7b_nvme_candidates_json_passes_deepspeeds_parser_and_swapper(tmp_path: Path) -> None:
    """examples/llama_7b.py traced and priced on one H100 with --nvme-path: its NVMe candidate's JSON."""
    from autofit.core.space import load_space
    from autofit.planning.estimate import estimate
    from autofit.planning.plan import Plan
    from autofit.workload.entry import load_workload

    entry = f"{ROOT / 'examples' / 'llama_7b.py'}:workload"
    fixed = {"zero_stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "micro_batch_size": 1,
             "grad_accum_steps": 1}
    plan = Plan.make(entry, load_workload(entry), PRESETS["h100-80gb"], load_space("default"), world_size=1,
                     fixed=fixed, software=Software(nvme_path=str(tmp_path)))
    assert plan.facts.largest_param_numel == LLAMA_7B_EMBEDDING
    candidate = estimate(plan).candidates[0]
    check_with_deepspeed(candidate.deepspeed)
    swapper_get_buffer(candidate.deepspeed, torch.bfloat16, zero3_partition_numel(LLAMA_7B_EMBEDDING, 1))
    assert candidate.prediction.host_peak_bytes > swap_buffers.param_swap_pinned_bytes(
        LLAMA_7B_EMBEDDING, plan.facts.n_trainable_params - plan.facts.n_persistent_params, 1, 2)


@pytest.mark.slow
def test_a_zero3_candidate_on_eight_gpus_passes_deepspeeds_parser() -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from autofit.core.space import load_space
    from autofit.planning.estimate import estimate
    from autofit.planning.plan import Plan
    from autofit.workload.entry import load_workload

    entry = f"{ROOT / 'examples' / 'llama_7b.py'}:workload"
    hardware = replace(PRESETS["h100-80gb"], devices_per_node=8)
    plan = Plan.make(entry, load_workload(entry), hardware, load_space("default"), world_size=8, global_batch=64,
                     fixed={"zero_stage": 3, "micro_batch_size": 2})
    ds = estimate(plan).candidates[0].deepspeed
    assert ds["train_batch_size"] == 64 and ds["zero_optimization"]["stage"] == 3
    check_with_deepspeed(ds)
    assert DeepSpeedZeroConfig(**ds["zero_optimization"]).stage == 3


def test_a_probes_json_sizes_the_buffers_from_the_traced_largest_parameter(tmp_path: Path) -> None:
    """The probe's spec carries the planner's largest parameter: its JSON sizes the swap buffers as the emitted
    one does, and DeepSpeed's own buffer check takes it."""
    from autofit.probe.spec import probe_spec
    from tests.toy_facts import FACTS

    hardware = replace(PRESETS["h100-80gb"], devices_per_node=2)
    spec = probe_spec("m.py:w", NVME, hardware, 2, software=Software(nvme_path=str(tmp_path)),
                      facts=replace(FACTS, largest_param_numel=3000 * 700))
    ds = spec.deepspeed
    assert ds["zero_optimization"]["offload_param"]["buffer_size"] == swap_buffers.io_aligned(3000 * 700 // 2, 2)
    swapper_get_buffer(ds, torch.bfloat16, zero3_partition_numel(3000 * 700, 2))


def _nvme_room(software: Software, **config: object):
    from autofit.planning.plan import within_nvme_room
    from tests.toy_facts import FACTS

    return within_nvme_room((replace(NVME, **config),), FACTS, PRESETS_H100, 1, software)


def test_nvme_candidates_whose_swap_files_outgrow_the_drive_are_rejected(tmp_path: Path) -> None:
    from autofit.core.errors import AutofitError
    from tests.toy_facts import FACTS

    roomy = Software(nvme_path=str(tmp_path), nvme_free_bytes=10**12)
    kept, rejected = _nvme_room(roomy)
    assert len(kept) == 1 and rejected == []
    # ZeRO-Infinity writes the bf16 parameters and the fp32 master, gradient and AdamW states (8 B) per element
    need = 2 * FACTS.n_trainable_params + (4 + 4 + 8) * FACTS.n_trainable_params
    assert _nvme_room(replace(roomy, nvme_free_bytes=int(need)))[0]
    with pytest.raises(AutofitError, match="NVMe offload writes .* which has .* free"):
        _nvme_room(replace(roomy, nvme_free_bytes=int(need) - 1))
    unknown = replace(roomy, nvme_free_bytes=None)  # free space not checked (a plan without --nvme-path's check)
    assert _nvme_room(unknown)[0]


def test_nvme_swap_buffers_past_rlimit_memlock_are_rejected(tmp_path: Path) -> None:
    """DeepSpeed mlocks the swap buffers (csrc/pin_memory/page_alloc.cpp); cudaHostAlloc's pinning is not bound."""
    from autofit.core.errors import AutofitError

    limited = Software(nvme_path=str(tmp_path), memlock_bytes=8 * 2**20)  # a common container default: 8 MiB
    with pytest.raises(AutofitError, match="RLIMIT_MEMLOCK"):
        _nvme_room(limited)
    cpu_offload = replace(NVME, offload_params="cpu", offload_optimizer="cpu")
    from autofit.planning.plan import within_nvme_room
    from tests.toy_facts import FACTS

    assert within_nvme_room((cpu_offload,), FACTS, PRESETS_H100, 1, limited)[0] == (cpu_offload,)
    assert _nvme_room(replace(limited, memlock_bytes=None))[0]


def test_this_machines_memlock_limit_and_pinning(tmp_path: Path) -> None:
    import os
    import resource

    from autofit.machine.software import detect_software, memlock_limit_bytes

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    expected = None if os.geteuid() == 0 or soft == resource.RLIM_INFINITY else soft
    assert memlock_limit_bytes() == expected
    assert detect_software().pin_memory  # cudaHostAlloc pins whatever RLIMIT_MEMLOCK says


def test_nvme_path_gets_checked_for_o_direct_and_free_space(tmp_path: Path) -> None:
    from autofit.machine.software import o_direct_refused
    from autofit.planning.target import machine_software

    assert o_direct_refused(tmp_path) is None and not list(tmp_path.iterdir())  # the test file is gone
    assert "No such file" in (o_direct_refused(tmp_path / "missing") or "")
    software = machine_software(str(tmp_path))
    assert software.nvme_path == str(tmp_path.resolve())
    assert software.nvme_free_bytes is not None and software.nvme_free_bytes > 0
