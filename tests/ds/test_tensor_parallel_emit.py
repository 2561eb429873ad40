"""AutoTP in the emitted JSON: its degree, and the batch left to DeepSpeed to derive."""

from __future__ import annotations

import pytest

from autofit.core.config import Config
from autofit.ds.emit import check_with_deepspeed, deepspeed_config
from autofit.ds.tensor_parallel import tp_degree

pytest.importorskip("deepspeed")


@pytest.mark.parametrize("stage", [0, 3])
def test_autotp_size_and_no_train_batch_size_which_deepspeed_checks_against_two_worlds(stage: int) -> None:
    ds = deepspeed_config(Config(tensor_parallel=4, zero_stage=stage, micro_batch_size=2, grad_accum_steps=3,
                                 precision="bf16"), world_size=8)
    assert ds["tensor_parallel"] == {"autotp_size": 4} and tp_degree(ds) == 4
    assert "train_batch_size" not in ds
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (2, 3)
    check_with_deepspeed(ds)


def test_no_autotp_section_without_tensor_parallelism() -> None:
    ds = deepspeed_config(Config(micro_batch_size=2), world_size=2)
    assert "tensor_parallel" not in ds and tp_degree(ds) == 1 and ds["train_batch_size"] == 4
