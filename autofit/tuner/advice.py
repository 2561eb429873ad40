"""What to say when nothing fits: what the smallest candidate needs, and what would make it fit."""

from __future__ import annotations

from autofit.core.config import OPTIMIZERS, Config
from autofit.core.hardware import Hardware
from autofit.core.recipe import substitutes_of
from autofit.core.rules import RULES, Context
from autofit.core.units import format_bytes
from autofit.cost_model import Prediction
from autofit.cost_model.budget import budget_text, memory_for
from autofit.cost_model.calibrate import Calibration
from autofit.cost_model.memory_correction import family
from autofit.planning.plan import Plan
from autofit.tuner.records import TrialRecord

#: world sizes tried when saying how many GPUs would make the smallest candidate fit
GPU_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: an idea: the samples/s its config is predicted to train at (0 where no speed is known) and what it says
Idea = tuple[float, str]


def nothing_fits(
    records: list[TrialRecord], usable: Plan, calibration: Calibration, device: Hardware, margin: float
) -> str:
    """One paragraph: what was measured, what the smallest candidate needs, and the nearest ways to make it fit,
    fastest predicted first: micro-batch 1 with checkpointing, offload, the recipe's substitutes not yet allowed
    (``--allow adamw8bit``: the numerics change, so only named), more GPUs on GPUs or a budget on a CPU (its own
    host)."""
    ranked = usable.price(calibration)
    smallest_config, smallest = min(ranked, key=lambda cp: cp[1].peak_bytes)
    text = (
        f"nothing fits {device.name} within {budget_text(device.memory_bytes, margin)}: "
        + _measured(records)
        + _smallest_need(smallest_config, smallest)
    )
    on_gpus = device.kind == "cuda" or usable.world_size > 1
    found = (_gpu_ideas if on_gpus else _cpu_ideas)(smallest_config, usable, calibration, records, margin)
    found += _lean_idea(smallest_config, usable, calibration) + _recipe_ideas(smallest_config, usable, calibration)
    ideas = [idea for _, idea in sorted(found, key=lambda speed_idea: -speed_idea[0])]
    if ideas:
        return text + " It would fit with (fastest predicted first) " + "; or ".join(ideas) + "."
    if smallest.peak_bytes <= usable.hardware.memory_bytes:  # the device holds it, the node's host RAM does not
        return text + " Nodes with more host RAM, or fewer ranks per node, are needed."
    if on_gpus:
        return text + " Even sharded over 1024 GPUs it would not fit: a larger device or a smaller model is needed."
    return text + " A larger --memory budget or a smaller model is needed."


def _smallest_need(config: Config, prediction: Prediction) -> str:
    """The smallest candidate's own reason (device or host memory, :attr:`Prediction.reason`)."""
    if prediction.reason:
        return f"the smallest candidate ({config.label()}): {prediction.reason}."
    return f"the smallest candidate ({config.label()}) needs {format_bytes(prediction.peak_bytes)}."


def _measured(records: list[TrialRecord]) -> str:
    """What the probes said: how many configs and families, and the smallest peak one of them reached."""
    tried = [r for r in records if r.phase == "search" and r.status in ("ok", "oom") and r.peak_bytes > 0]
    if not tried:
        failed = sorted({r.status for r in records if r.phase == "search"})
        return f"{len([r for r in records if r.phase == 'search'])} probe(s) ended {', '.join(failed)}; " if failed else ""
    low = min(tried, key=lambda r: r.peak_bytes)
    how = "peaked at" if low.status == "ok" else "ran out of memory holding"
    families = len({family(r.config) for r in tried})
    return (
        f"{len(tried)} config(s) of {families} famil{'y' if families == 1 else 'ies'} measured; the smallest config "
        f"tried, {low.config.label()}, {how} {format_bytes(low.peak_bytes)}; "
    )


def _gpu_ideas(
    smallest: Config, usable: Plan, calibration: Calibration, records: list[TrialRecord], margin: float
) -> list[Idea]:
    """More GPUs with ZeRO-3 sharding; ZeRO-3 with everything offloaded to the CPU."""
    facts, budget, world_size = usable.facts, usable.hardware, usable.world_size
    ideas: list[Idea] = []
    sharded = smallest.with_(zero_stage=3)
    for n in GPU_COUNTS:
        if n <= world_size:
            continue
        p = calibration.predict(at_world(sharded, n, usable.global_batch), facts, budget, n)
        if p.fits:
            ideas.append((p.samples_per_s, f"{n} GPUs with ZeRO-3 sharding (about {format_bytes(p.peak_bytes)} each, "
                                           f"{p.samples_per_s:.3g} samples/s)"))
            break
    offloaded = sharded.with_(offload_optimizer="cpu", offload_params="cpu")
    p = calibration.predict(offloaded, facts, budget, world_size)
    if p.fits:
        ideas.append((p.samples_per_s, f"ZeRO-3 with optimizer and parameters offloaded to the CPU (about "
                                       f"{format_bytes(p.peak_bytes)}, {p.samples_per_s:.3g} samples/s)"))
    return ideas


def _cpu_ideas(
    smallest: Config, usable: Plan, calibration: Calibration, records: list[TrialRecord], margin: float
) -> list[Idea]:
    """The budget that would do: the smallest measured peak (or the smallest prediction) over the margin."""
    measured = [r.peak_bytes for r in records if r.phase == "search" and r.status == "ok" and r.peak_bytes > 0]
    p = calibration.predict(smallest, usable.facts, usable.hardware, 1)
    need = min(measured) if measured else p.peak_bytes
    return [(p.samples_per_s, f"--memory {format_bytes(memory_for(need, margin))} or more "
                              f"({p.samples_per_s:.3g} samples/s)")]


def _recipe_ideas(smallest: Config, usable: Plan, calibration: Calibration) -> list[Idea]:
    """Each substitute of the recipe the user has not allowed (:func:`autofit.core.recipe.substitutes_of`) that the
    rules let run here and that makes the smallest candidate fit: ``--allow adamw8bit`` where 8-bit states fit. One
    already allowed was in the space the search tried, so it is not offered again."""
    recipe = usable.stated_recipe
    ctx = Context(hardware=usable.hardware, world_size=usable.world_size, global_batch=usable.global_batch,
                  software=usable.software)
    found: list[Idea] = []
    for value in substitutes_of(recipe.optimizer, recipe.precision):
        if value in recipe.allow:
            continue
        if value == "adam_mini" and not usable.facts.adam_mini_state_numel:  # its states are counted by its own step
            continue  # in the trace (autofit.ds.optim.adam_mini_state_numel), which a space without it did not run
        key = "optimizer" if value in OPTIMIZERS else "precision"
        config = smallest.with_(**{key: value})
        if any(rule.check(ctx, *(getattr(config, k) for k in rule.keys)) for rule in RULES):
            continue
        try:
            p = calibration.predict(config, usable.facts, usable.hardware, usable.world_size)
        except KeyError:  # a precision the plan did not trace (fp32 recipe, bf16 substitute): not priced, not offered
            continue
        if p.fits:
            found.append((p.samples_per_s, f"--allow {value} (about {format_bytes(p.peak_bytes)}, "
                                           f"{p.samples_per_s:.3g} samples/s; it changes the recipe's {key}, "
                                           "docs/recipe.md)"))
    return found


def _lean_idea(smallest: Config, usable: Plan, calibration: Calibration) -> list[Idea]:
    """Micro-batch 1 with full checkpointing, where the space did not allow it."""
    if smallest.micro_batch_size == 1 and smallest.checkpoint_ratio >= 1.0:
        return []
    lean = smallest.with_(micro_batch_size=1, checkpoint_ratio=1.0, grad_accum_steps=1)
    p = calibration.predict(lean, usable.facts, usable.hardware, usable.world_size)
    if not p.fits:
        return []
    return [(p.samples_per_s,
             f"micro-batch 1 with full checkpointing (about {format_bytes(p.peak_bytes)}, {p.samples_per_s:.3g} "
             f"samples/s): allow them in the space, with a global batch divisible by {usable.world_size}")]


def at_world(config: Config, n: int, global_batch: int | None) -> Config:
    """``config`` at ``n`` ranks: the accumulation shrinks to keep the global batch where it divides."""
    if global_batch is not None and global_batch % (config.micro_batch_size * n) == 0:
        return config.with_(grad_accum_steps=global_batch // (config.micro_batch_size * n))
    return config.with_(grad_accum_steps=1)
