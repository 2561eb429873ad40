"""What to say when nothing fits: what the smallest candidate needs, and what would make it fit."""

from __future__ import annotations

from autofit.config import Config
from autofit.cost_model.calibrate import Calibration
from autofit.hardware import Hardware
from autofit.plan import Plan
from autofit.search.records import TrialRecord
from autofit.units import format_bytes

#: world sizes tried when saying how many GPUs would make the smallest candidate fit
GPU_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def nothing_fits(
    records: list[TrialRecord], usable: Plan, calibration: Calibration, device: Hardware, margin: float
) -> str:
    """One paragraph: the probes' outcomes, what the smallest candidate needs, and what would make it fit."""
    ranked = usable.price(calibration)
    smallest_config, smallest = min(ranked, key=lambda cp: cp[1].peak_bytes)
    head = (
        f"nothing fits {device.name} ({format_bytes(device.memory_bytes)}, "
        f"{format_bytes(usable.hardware.memory_bytes)} usable with the {margin:.0%} safety margin): "
    )
    searched = [r for r in records if r.phase == "search"]
    if searched:
        outcomes = ", ".join(sorted({r.status if r.status != "ok" else "past the margin" for r in searched}))
        head += f"{len(searched)} probe(s) ended {outcomes}; "
    head += f"the smallest candidate ({smallest_config.label()}) needs {format_bytes(smallest.peak_bytes)}."
    ideas = _ideas(smallest_config, usable, calibration, device)
    if ideas:
        return head + " It would fit with " + "; or ".join(ideas) + "."
    return head + " Even sharded over 1024 GPUs it would not fit: a larger device or a smaller model is needed."


def _ideas(smallest: Config, usable: Plan, calibration: Calibration, device: Hardware) -> list[str]:
    """More ranks with ZeRO-3, offload (on a GPU), or micro-batch 1 with full checkpointing."""
    world_size = usable.world_size
    facts, budget = usable.facts, usable.hardware
    ideas = []
    sharded = smallest.with_(zero_stage=3)
    on_gpus = device.kind == "cuda" or world_size > 1
    for n in GPU_COUNTS:
        if on_gpus and n <= world_size:
            continue
        p = calibration.predict(at_world(sharded, n, usable.global_batch), facts, budget, n)
        if p.fits:
            what = "GPUs" if on_gpus else "ranks"
            ideas.append(f"{n} {what} with ZeRO-3 sharding (about {format_bytes(p.peak_bytes)} each)")
            break
    if on_gpus:
        offloaded = sharded.with_(offload_optimizer="cpu", offload_params="cpu")
        p = calibration.predict(offloaded, facts, budget, world_size)
        if p.fits:
            ideas.append(f"ZeRO-3 with optimizer and parameters offloaded to the CPU (about {format_bytes(p.peak_bytes)})")
    lean = smallest.with_(micro_batch_size=1, checkpoint_ratio=1.0)
    p = calibration.predict(lean.with_(grad_accum_steps=1), facts, budget, world_size)
    if p.fits and (smallest.micro_batch_size > 1 or smallest.checkpoint_ratio < 1.0):
        ideas.append(
            f"micro-batch 1 with full checkpointing (about {format_bytes(p.peak_bytes)}): allow them in the space, "
            f"with a global batch divisible by {world_size * lean.grad_accum_steps}"
        )
    return ideas


def at_world(config: Config, n: int, global_batch: int | None) -> Config:
    """``config`` at ``n`` ranks: the accumulation shrinks to keep the global batch where it divides."""
    if global_batch is not None and global_batch % (config.micro_batch_size * n) == 0:
        return config.with_(grad_accum_steps=global_batch // (config.micro_batch_size * n))
    return config.with_(grad_accum_steps=1)
