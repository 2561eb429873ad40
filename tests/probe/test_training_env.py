"""The environment a probe rank runs in (:func:`autofit.probe.launch.training_env`), as training runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.probe.launch import MMAP_THRESHOLD_BYTES, rank_env, training_env


def test_the_mmap_threshold_is_set_on_the_cpu_accelerator_only() -> None:
    assert training_env({}, "cpu", 1, 8)["MALLOC_MMAP_THRESHOLD_"] == str(MMAP_THRESHOLD_BYTES)
    assert "MALLOC_MMAP_THRESHOLD_" not in training_env({}, "cuda", 8, 64)
    # one the user exported for their training stays theirs
    assert training_env({"MALLOC_MMAP_THRESHOLD_": "131072"}, "cuda", 8, 64)["MALLOC_MMAP_THRESHOLD_"] == "131072"


def test_omp_threads_are_the_cores_over_the_ranks_sharing_the_host_unless_set() -> None:
    assert training_env({}, "cuda", local_ranks=8, cores=96)["OMP_NUM_THREADS"] == "12"
    assert training_env({}, "cpu", local_ranks=2, cores=2)["OMP_NUM_THREADS"] == "1"
    assert training_env({}, "cuda", local_ranks=8, cores=4)["OMP_NUM_THREADS"] == "1"  # never 0
    assert training_env({"OMP_NUM_THREADS": "3"}, "cuda", 8, 96)["OMP_NUM_THREADS"] == "3"


def test_cuda_device_max_connections_only_for_tensor_parallel_overlap() -> None:
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in training_env({}, "cuda", 8, 96)
    assert training_env({}, "cuda", 8, 96, tensor_parallel=2)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert training_env({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "cuda", 8, 96)["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in training_env({}, "cpu", 1, 2, tensor_parallel=2)


def test_deepspeed_never_reads_cuda_device_max_connections() -> None:
    """The reason a ZeRO probe leaves it unset: the installed DeepSpeed's sources do not name it."""
    import deepspeed

    root = Path(deepspeed.__file__).parent
    naming = [p for p in root.rglob("*.py") if "CUDA_DEVICE_MAX_CONNECTIONS" in p.read_text(errors="replace")]
    assert naming == []


def test_a_rank_started_with_rank_env_runs_in_that_environment() -> None:
    """A real child process: what it sees is what the function built (cores from this process's affinity)."""
    env = rank_env({k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, 1, 2, 29500, "cuda")
    code = "import os; print(os.environ.get('OMP_NUM_THREADS'), os.environ.get('MALLOC_MMAP_THRESHOLD_'), os.environ['RANK'])"
    seen = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    cores = len(os.sched_getaffinity(0))
    assert seen == [str(max(1, cores // 2)), "None", "1"]


def test_an_arch_specific_cuda_arch_list_reaches_deepspeed_as_its_family(monkeypatch) -> None:
    """A CUDA image's ``TORCH_CUDA_ARCH_LIST=9.0a`` fails DeepSpeed's FusedAdam build (seen on an H100); a probe's
    rank gets ``9.0``, which DeepSpeed's own builder reads. Elsewhere the variable is left as it was."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    assert training_env({"TORCH_CUDA_ARCH_LIST": "8.0;9.0a+PTX"}, "cuda", 1, 8)["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
    assert training_env({"TORCH_CUDA_ARCH_LIST": "8.0 9.0"}, "cuda", 1, 8)["TORCH_CUDA_ARCH_LIST"] == "8.0 9.0"
    assert training_env({"TORCH_CUDA_ARCH_LIST": "9.0a"}, "cpu", 1, 8)["TORCH_CUDA_ARCH_LIST"] == "9.0a"
    assert "TORCH_CUDA_ARCH_LIST" not in training_env({}, "cuda", 1, 8)
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError, match="invalid literal"):  # when DeepSpeed reads it, the rewrite may go
        builder.compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", training_env({"TORCH_CUDA_ARCH_LIST": "9.0a"}, "cuda", 1, 8)["TORCH_CUDA_ARCH_LIST"])
    builder.compute_capability_args()  # reads it
