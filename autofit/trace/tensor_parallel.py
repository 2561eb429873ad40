"""One tensor-parallel rank's model, for the trace: the Linear layers DeepSpeed's AutoTP splits, split.

AutoTP (``deepspeed/runtime/engine.py``, ``_configure_tensor_parallel``) shards a Hugging Face model by its
``tp_plan``: DeepSpeed merges the config's ``base_model_tp_plan`` with the class's ``_tp_plan``
(``_get_hf_tp_plan``, ``deepspeed/runtime/tensor_parallel/config.py``) and converts it into layer specs
(``TPPlanConverter``, ``deepspeed/module_inject/tp_plan_converter.py``), which this module reads through DeepSpeed's
own functions. Each ``colwise`` Linear keeps ``out / tp`` of its outputs (``LinearLayer``), each ``rowwise`` one
``in / tp`` of its inputs (``LinearAllreduce``, its bias whole), a ``colwise_gather_output`` head gathers its
outputs whole again; embeddings, norms and ``replicated_with_grad_allreduce`` modules stay whole
(``deepspeed/module_inject/layers.py``). A Hugging Face attention reshapes its projections by ``head_dim`` with the
head count left to ``-1``, which is why AutoTP can split it at all; so the split model below runs the very shapes
one rank runs, and the trace measures what a rank holds and computes: whole layer-boundary tensors beside split
attention and MLP intermediates, the gathered logits, the rank's parameters and their gradients.

What it does not run: the collectives. The row layers' all-reduce of their output and the column layers' of their
input's gradient are in place (``RowParallel.forward``, ``ColumnParallel.backward``, ``layers.py``), so they change no
live bytes; their time is priced from the counts kept here (:class:`SplitLinears`,
:mod:`autofit.cost_model.tensor_parallel`). The head's gather is stood in by concatenating its shard ``tp`` times:
the same whole output, the same shard's matmul.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

from autofit.core.errors import AutofitError
from autofit.workload.types import Workload


@dataclass(frozen=True)
class SplitLinears:
    """What AutoTP's plan split in one model."""

    degree: int
    """The tensor-parallel degree ``tp``."""
    column: int
    """Column-split Linears (outputs split): each all-reduces its input's gradient in backward."""
    row: int
    """Row-split Linears (inputs split): each all-reduces its output in forward."""
    gathered_features: int
    """Output features of the column Linears whose outputs are gathered whole again (the head's vocabulary)."""


def split_linears(model: Any, degree: int) -> SplitLinears:
    """Replace, in place, each Linear of ``model`` that DeepSpeed's AutoTP splits by the model's ``tp_plan`` with the
    shard one rank of ``degree`` holds (module docstring); the counts of what was split. An :class:`AutofitError`
    where the model states no plan DeepSpeed converts or a width does not divide by ``degree``."""
    import torch
    from deepspeed.module_inject.autotp_config import AutoTPConfig, PartitionType
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    plan = _get_hf_tp_plan(model)
    try:
        specs = TPPlanConverter.convert(plan) if plan else None
    except ValueError as exc:  # a partition style DeepSpeed does not convert
        raise AutofitError(f"AutoTP cannot split the model: {str(exc).splitlines()[0]}") from exc
    if not specs:
        raise AutofitError("AutoTP cannot split the model: its class states no tp_plan")
    rules = AutoTPConfig(tp_size=degree, layer_specs=specs)
    column = row = gathered = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        spec = rules.find_matching_spec(f"{name}.weight")
        if spec is None or spec.partition_type == PartitionType.SKIP:
            continue
        split_rows = spec.partition_type == PartitionType.ROW
        shard = _shard(module, degree, split_rows, name)
        if split_rows:
            row += 1
        else:
            column += 1
            if spec.gather_output:
                shard = _gathered(shard, degree)
                gathered += module.out_features
        _set_submodule(model, name, shard)
    return SplitLinears(degree=degree, column=column, row=row, gathered_features=gathered)


def tensor_parallel_workload(workload: Workload, degree: int) -> Workload:
    """``workload`` whose model is one rank's of AutoTP at ``degree`` (:func:`split_linears`), built fresh each time."""
    build = workload.model

    @functools.wraps(build)  # keeps the signature: whether the model takes an attention keyword
    def split_model(*args: Any, **kwargs: Any) -> Any:
        model = build(*args, **kwargs)
        split_linears(model, degree)
        return model

    return replace(workload, model=split_model)


def _shard(module: Any, degree: int, split_rows: bool, name: str) -> Any:
    """One rank's Linear of ``module``: ``in / tp`` of its inputs (a row split), else ``out / tp`` of its outputs."""
    import torch

    features = module.in_features if split_rows else module.out_features
    if features % degree:
        raise AutofitError(f"AutoTP at tensor_parallel {degree} cannot split {name}'s {features} "
                           f"{'input' if split_rows else 'output'} features evenly")
    in_features = module.in_features // degree if split_rows else module.in_features
    out_features = module.out_features if split_rows else module.out_features // degree
    return torch.nn.Linear(in_features, out_features, bias=module.bias is not None, device=module.weight.device,
                           dtype=module.weight.dtype)


def _gathered(shard: Any, degree: int) -> Any:
    """A ``colwise_gather_output`` Linear's stand-in: the shard's output concatenated ``degree`` times, the whole
    output AutoTP's all-gather returns (``gather_from_tensor_model_parallel_region``, ``layers.py``)."""
    import torch

    class GatheredColumn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shard = shard

        def forward(self, hidden: Any) -> Any:
            return torch.cat([self.shard(hidden)] * degree, dim=-1)

    return GatheredColumn()


def _set_submodule(model: Any, name: str, module: Any) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
