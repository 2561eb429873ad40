"""Ulysses sequence parallelism where the Hugging Face Trainer and Accelerate take it outside the DeepSpeed JSON.

DeepSpeed's JSON says ``sequence_parallel_size`` (:mod:`autofit.ds.emit`), which DeepSpeed reads for the
data-parallel world size where no ``mpu`` is given; the attention wrapper itself is registered by Accelerate
(``Accelerator._prepare_deepspeed`` calls ``UlyssesSPAttentionHF.register_with_transformers``,
accelerate/accelerator.py:2395-2450) from its ``ParallelismConfig``. That comes from the launcher's config file
(``parallelism_config:`` with accelerate's prefixed names, accelerate/commands/launch.py:948-983, exported as
``PARALLELISM_CONFIG_SP_*`` by accelerate/utils/launch.py:403-423) or from ``TrainingArguments(parallelism_config=...)``
(transformers/training_args.py). docs/develop/long-context.md, "Hugging Face Trainer / Accelerate".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autofit.workload.hf import ATTN_IMPLEMENTATION

#: DeepSpeed's key of the SP degree in the JSON (deepspeed/runtime/config.py, ``sequence_parallel_size``)
SEQUENCE_PARALLEL_SIZE = "sequence_parallel_size"


def sp_degree(ds_config: Mapping[str, Any]) -> int:
    """The JSON's sequence-parallel degree (1: off)."""
    return int(ds_config.get(SEQUENCE_PARALLEL_SIZE, 1) or 1)


def attn_implementation(ds_config: Mapping[str, Any]) -> str:
    """transformers' ``attn_implementation`` of the JSON's ``"autofit"`` attention (sdpa where it names none)."""
    section = ds_config.get("autofit") or {}
    return ATTN_IMPLEMENTATION.get(str(section.get("attention", "sdpa")), "sdpa")


def accelerate_parallelism(ds_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``parallelism_config:`` mapping of an Accelerate config file for the JSON's SP degree; empty where off.
    Variable lengths (``sp_seq_length_is_variable``): a batch's length must only divide by ``sp``."""
    sp = sp_degree(ds_config)
    if sp == 1:
        return {}
    return {"parallelism_config_sp_size": sp, "parallelism_config_sp_backend": "deepspeed",
            "parallelism_config_sp_seq_length_is_variable": True,
            "parallelism_config_sp_attn_implementation": attn_implementation(ds_config)}


def trainer_parallelism_config(ds_config: Mapping[str, Any]) -> Any:
    """``TrainingArguments(parallelism_config=...)``: accelerate's ``ParallelismConfig`` for the JSON's SP degree;
    None where off."""
    sp = sp_degree(ds_config)
    if sp == 1:
        return None
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                              sp_attn_implementation=attn_implementation(ds_config))
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=handler)
