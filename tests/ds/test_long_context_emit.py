"""The long-context keys in the emitted files: DeepSpeed's JSON (checked by DeepSpeed's own ``DeepSpeedConfig``),
the ``"autofit"`` section, Accelerate's config file (read back by accelerate's own parser) and the Trainer's
``ParallelismConfig``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.recipe import recipe_for
from autofit.core.software import Software
from autofit.ds.emit import check_with_deepspeed, deepspeed_config
from autofit.ds.launchers import accelerate_config, trainer_arguments, write_accelerate_config

SP4 = Config(micro_batch_size=1, grad_accum_steps=2, precision="bf16", zero_stage=3, checkpoint_ratio=1.0,
             sequence_parallel=4, tiled_mlp=True, tiled_loss=True, offload_activations="cpu", attention="flash")


def _ds(config: Config = SP4, world: int = 8) -> dict:
    return deepspeed_config(config, world, "cuda", Software(), recipe=recipe_for({}, "cuda", True))


def test_sequence_parallel_size_and_the_batch_over_data_parallel_ranks_deepspeed_accepts() -> None:
    ds = _ds()
    assert ds["sequence_parallel_size"] == 4
    assert ds["seq_parallel_communication_data_type"] == "bf16"
    assert ds["train_batch_size"] == 1 * 2 * (8 // 4)
    section = ds["autofit"]
    assert (section["sequence_parallel"], section["tiled_mlp"], section["tiled_loss"],
            section["offload_activations"]) == (4, True, True, "cpu")
    check_with_deepspeed(ds)
    from deepspeed.runtime.config import DeepSpeedConfig

    one_rank = {k: v for k, v in ds.items() if k != "train_batch_size"}  # outside a run DeepSpeed sees one rank
    assert str(DeepSpeedConfig(one_rank).seq_parallel_communication_data_type) == "torch.bfloat16"


def test_no_sequence_parallel_key_when_off() -> None:
    ds = _ds(Config(precision="bf16"), 2)
    assert "sequence_parallel_size" not in ds
    assert ds["autofit"]["sequence_parallel"] == 1
    check_with_deepspeed(ds)


def test_accelerate_reads_the_parallelism_config(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file

    ds = _ds()
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    written = write_accelerate_config(tmp_path / "accelerate.yaml", accelerate_config(ds, tmp_path / "ds.json",
                                                                                      num_processes=8))
    loaded = load_config_from_file(str(written))
    assert loaded.parallelism_config == {
        "parallelism_config_sp_size": 4, "parallelism_config_sp_backend": "deepspeed",
        "parallelism_config_sp_seq_length_is_variable": True,
        "parallelism_config_sp_attn_implementation": "flash_attention_2"}
    with pytest.raises(AutofitError, match="data-parallel size 4 .*sequence_parallel_size 4"):
        accelerate_config(ds, tmp_path / "ds.json", num_processes=16)


def test_the_trainer_gets_a_parallelism_config() -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    arguments = trainer_arguments(_ds(), output_dir="out", use_cpu=True)
    parallelism = arguments["parallelism_config"]
    assert (parallelism.sp_size, parallelism.sp_backend) == (4, "deepspeed")
    assert parallelism.sp_handler.sp_attn_implementation == "flash_attention_2"
    assert "parallelism_config" not in trainer_arguments(_ds(Config(precision="bf16"), 2), output_dir="out",
                                                         use_cpu=True)
