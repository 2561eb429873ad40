"""Build a probe's :class:`~autofit.probe.records.ProbeSpec` in the parent from its parts: :func:`probe_spec` (a
plan's candidate is :meth:`autofit.planning.plan.Plan.probe_spec`, what the search, ``autofit probe`` and the ladder
do).

The values a rank needs from the model (its hidden size, which the ZeRO buckets are derived from; its largest
parameter, which sizes NVMe parameter offload's swap buffers) are read here, once, from the traced
:class:`~autofit.cost_model.facts.ModelFacts`, and end up in the spec's DeepSpeed JSON, as the cost model priced
them. No torch import: the ranks import it.
"""

from __future__ import annotations

from pathlib import Path

from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.core.software import Software
from autofit.cost_model.cuda_runtime import nccl_buffer_bytes
from autofit.cost_model.facts import ModelFacts
from autofit.ds.emit import deepspeed_config
from autofit.probe.records import ProbeSpec


def probe_spec(
    entry: str,
    config: Config,
    hardware: Hardware,
    world_size: int = 1,
    *,
    mode: str = "real",
    steps: int = 3,
    warmup_steps: int = 1,
    software: Software | None = None,
    facts: ModelFacts | None = None,
    memory_snapshot: str | Path | None = None,
) -> ProbeSpec:
    """The probe of ``config`` of the workload at ``entry`` on ``world_size`` ranks of ``hardware``.

    ``steps`` measured steps after ``warmup_steps`` untimed ones; ``mode``: ``real`` or ``fake``. ``software``:
    what the machine runs (``--nvme-path``, the DeepSpeed ops that failed to build), this one's when None.
    ``facts``: the traced model, whose ``hidden_size`` sizes the JSON's ZeRO buckets (:mod:`autofit.ds.buckets`)
    and whose ``largest_param_numel`` sizes NVMe parameter offload's swap buffers
    (:func:`autofit.ds.emit.with_param_swap_buffers`); None: autofit's defaults for an unknown model (buckets
    larger than the model, DeepSpeed's own swap buffers). ``memory_snapshot``: on CUDA, where rank 0 writes the
    allocator's history (:mod:`autofit.probe.snapshot`), resolved here; ignored on the CPU.
    A bad mode, world size or step count is an :class:`AutofitError` naming it.
    """
    ProbeSpec.check(mode, world_size, steps, warmup_steps)  # before the JSON, which a world size of 0 breaks
    hidden_size = facts.hidden_size if facts is not None else 0
    largest_param_numel = facts.largest_param_numel if facts is not None else 0
    ds = deepspeed_config(config, world_size, hardware.kind, software, hidden_size=hidden_size,
                          largest_param_numel=largest_param_numel or None)
    return ProbeSpec(
        entry=entry,
        config=config,
        hardware=hardware,
        deepspeed=ds,
        nccl_bytes=nccl_buffer_bytes(world_size) if hardware.kind == "cuda" else 0,
        world_size=world_size,
        mode=mode,
        steps=steps,
        warmup_steps=warmup_steps,
        memory_snapshot=str(Path(memory_snapshot).resolve()) if memory_snapshot is not None else None,
    )
