"""The ladder: seed 004's build-along table for any model, one memory technique added per rung.

Seed 004 ("8.1 Memory Optimization", section 5) starts from a configuration that runs out of memory
and adds one technique at a time, recording what each buys. :func:`rungs` are those steps (plus the
8-bit optimizer, which seed 001 teaches), each cumulative on the one before:

0. baseline: fp32, no checkpointing, AdamW, ZeRO-0;
1. + activation checkpointing of every repeated layer;
2. + mixed precision (bf16 where the device has it, fp16 otherwise);
3. + 8-bit optimizer (bitsandbytes' AdamW8bit);
4. + ZeRO-2 at the job's world size;
5. + ZeRO-3 with optimizer and parameters offloaded to the CPU. DeepSpeed offloads only its own CPU
   optimizers (``autofit.core.rules.OFFLOADABLE_OPTIMIZERS``), so this rung goes back to AdamW, run by
   DeepSpeed's CPU Adam on the host.

A causal LM with a sequence goes on with the long-context rungs (:func:`long_context_rungs`); then, where they apply,
the rungs past ZeRO (:func:`parallel_rungs`): hpZ on more than one node, AutoTP over a node's ranks for a model that
states a ``tp_plan``, each in place of what it cannot run beside.

The rungs step through the optimizer and the precision, which are the user's recipe elsewhere
(:mod:`autofit.core.recipe`): the ladder keeps its rungs and labels each row with what it changes of the
recipe (``differs``), a substitute (8-bit states, mixed precision for an fp32 recipe) marked as such.

The rungs are priced through :class:`autofit.planning.plan.Plan` (the same ``Plan.predict`` as ``autofit
estimate`` and the search), against the usable budget, ``(1 - margin) x`` the device memory
(:mod:`autofit.cost_model.budget`); a rung a rule of the device refuses
(offload when the device is the CPU) carries that rule's reason and is never probed.

:func:`run_ladder` is ``autofit ladder`` as a function of a :class:`autofit.planning.target.Setup`;
:func:`measure_ladder` probes a priced ladder's fitting rungs (``--measure``), from a notebook as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.core.hardware import Hardware
from autofit.core.recipe import Difference, Recipe, differences
from autofit.core.space import DEFAULT_ATTENTION, SPACE_KEYS, SearchSpace
from autofit.cost_model import ModelFacts, Prediction
from autofit.cost_model.budget import DEFAULT_MARGIN, budget_dict, usable_bytes
from autofit.cost_model.calibrate import Calibration
from autofit.machine.device import cuda_devices_here
from autofit.machine.software import detect_software
from autofit.planning.plan import Plan
from autofit.probe.ops import prepare_ops
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec
from autofit.probe.warm import WarmParent
from autofit.workload.types import Workload

if TYPE_CHECKING:
    from autofit.core.software import Software
    from autofit.planning.target import Setup, Target
    from autofit.trace.source_cache import SourcePlannedWorkload

#: the baseline's value of every key the ladder steps through
BASELINE: dict[str, Any] = {
    "checkpoint_ratio": 0.0,
    "precision": "fp32",
    "optimizer": "adamw",
    "zero_stage": 0,
    "offload_optimizer": "none",
    "offload_params": "none",
    "sequence_parallel": 1,
    "tiled_mlp": False,
    "tiled_loss": False,
    "offload_activations": "none",
    "hpz_partition_size": 1,
    "tensor_parallel": 1,
}
LADDER_KEYS = tuple(BASELINE)


@dataclass(frozen=True)
class Rung:
    """One step of the ladder: what it adds to the rung before it."""

    name: str
    """Short name, as seed 004's table words it (``+ activation checkpointing``)."""
    changed: str
    """What changed from the rung before, in words."""
    changes: dict[str, Any]
    """The config keys this rung sets (on top of the rung before)."""


def mixed_precision(hardware: Hardware) -> str:
    """bf16 where the device has it (seed 004: "BF16 is almost always preferable"), fp16 otherwise."""
    return "bf16" if hardware.supports_precision("bf16") else "fp16"


def rungs(mixed: str, world_size: int, long_context: bool = False, per_node: int | None = None,
          tensor_parallel_plan: bool = False) -> tuple[Rung, ...]:
    """The six rungs in order, with ``mixed`` as the mixed precision and ZeRO over ``world_size`` ranks; for a causal
    LM with a sequence (``long_context``) the long-context rungs after them (:func:`long_context_rungs`); then the
    parallelism rungs where they can apply (:func:`parallel_rungs`: ``per_node`` ranks a node, None: one node)."""
    per_node = per_node or world_size
    return (_memory_rungs(mixed, world_size) + (long_context_rungs(world_size) if long_context else ())
            + parallel_rungs(world_size, per_node, tensor_parallel_plan))


def parallel_rungs(world_size: int, per_node: int, tensor_parallel_plan: bool) -> tuple[Rung, ...]:
    """Past ZeRO, each in place of what it cannot run beside (:mod:`autofit.core.parallel_rules`): hpZ where the job
    spans nodes (ZeRO-3's gathers but the first kept inside the node, the parameters back on the device, SP off), and
    AutoTP over a node's ranks where the model states a ``tp_plan`` (hpZ and the long-context keys off)."""
    ladder: tuple[Rung, ...] = ()
    if world_size > per_node:
        ladder += (Rung("+ hpZ", f"ZeRO++'s secondary partition over each node's {per_node} ranks: every gather of a "
                        "step but the first on the node's links (parameters back on the device, SP off)",
                        {"zero_stage": 3, "offload_params": "none", "sequence_parallel": 1,
                         "hpz_partition_size": per_node}),)
    if tensor_parallel_plan and per_node > 1:
        ladder += (Rung("+ tensor parallelism", f"AutoTP over each node's {per_node} ranks: the tp_plan's Linear "
                        "layers split between them (hpZ and the long-context keys off)",
                        {"tensor_parallel": per_node, "hpz_partition_size": 1, "sequence_parallel": 1,
                         "tiled_mlp": False, "tiled_loss": False, "offload_activations": "none"}),)
    return ladder


def long_context_rungs(world_size: int) -> tuple[Rung, ...]:
    """The long-context techniques (docs/design.md, "Config keys"), each on top of the last: the tiled loss, TiledMLP,
    the checkpointed inputs on the host, Ulysses SP over every rank (rules say where a rung cannot run: one rank, one
    MLP tile, heads SP does not divide)."""
    return (
        Rung("+ tiled loss", "logits and loss in ceil(vocab/hidden) sequence tiles", {"tiled_loss": True}),
        Rung("+ tiled MLP", "DeepSpeed's TiledMLP: ceil((seq/sp)/hidden) tiles, recomputed in backward",
             {"tiled_mlp": True}),
        Rung("+ activation offload", "the checkpointed layers' inputs in host memory", {"offload_activations": "cpu"}),
        Rung("+ sequence parallelism", f"Ulysses SP over {world_size} ranks: seq/{world_size} tokens a rank",
             {"sequence_parallel": world_size}),
    )


def _memory_rungs(mixed: str, world_size: int) -> tuple[Rung, ...]:
    zero2 = (f"optimizer states and gradients partitioned over {world_size} ranks" if world_size > 1 else
             "ZeRO-2 on one rank: nothing to partition (with --gpus N it splits optimizer states and gradients N ways)")
    return (
        Rung("baseline", "fp32, no checkpointing, AdamW, ZeRO-0", dict(BASELINE)),
        Rung("+ activation checkpointing", "every repeated layer recomputed in backward", {"checkpoint_ratio": 1.0}),
        Rung("+ mixed precision", f"{mixed} weights, gradients and activations; fp32 master weights",
             {"precision": mixed}),
        Rung("+ 8-bit optimizer", "bitsandbytes AdamW8bit: 8-bit optimizer states", {"optimizer": "adamw8bit"}),
        Rung("+ ZeRO-2", zero2, {"zero_stage": 2}),
        Rung("+ ZeRO-3 + CPU offload",
             "parameters partitioned too; optimizer states and parameters offloaded to the CPU "
             "(AdamW again: DeepSpeed's CPU Adam, bitsandbytes' states cannot be offloaded)",
             {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu", "optimizer": "adamw"}),
    )


def rung_configs(base: Config, ladder: tuple[Rung, ...]) -> list[Config]:
    """Each rung's config: ``base`` with every rung's changes up to and including its own."""
    configs, config = [], base
    for rung in ladder:
        config = config.with_(**rung.changes)
        configs.append(config)
    return configs


def ladder_space(ladder: tuple[Rung, ...], micro_batch_size: int) -> SearchSpace:
    """A space holding every rung (the product of the values the rungs use), for :meth:`Plan.make`."""
    values: dict[str, list[Any]] = {key: [] for key in SPACE_KEYS}
    values["micro_batch_size"] = [micro_batch_size]
    values["attention"] = [DEFAULT_ATTENTION]
    values["checkpoint_granularity"] = ["block"]  # the seed's rung checkpoints whole blocks
    values["compile"] = ["off"]  # the ladder's rungs run eager
    # DeepSpeed's communication as every JSON had it before these were searched: the seed's ladder has no rung for them
    values["overlap_comm"], values["contiguous_gradients"], values["bucket_scale"] = [False], [True], [1]
    values["quantized_weights"], values["quantized_gradients"] = [False], [False]  # exact communication on every rung
    for config in rung_configs(Config(), ladder):
        for key in LADDER_KEYS:
            if getattr(config, key) not in values[key]:
                values[key].append(getattr(config, key))
    return SearchSpace(name="ladder", description="the rungs of autofit ladder",
                       values={key: tuple(v) for key, v in values.items()})


def check_fixed(fixed: dict[str, Any]) -> None:
    """``--set`` may fix the micro-batch, the accumulation or the attention, not what the ladder steps through."""
    stepped = sorted(set(fixed) & set(LADDER_KEYS))
    if stepped:
        raise AutofitError(f"--set {stepped[0]} cannot be fixed in autofit ladder: the ladder steps through "
                           f"{', '.join(LADDER_KEYS)}")


def check_target(target: Target) -> int:
    """The ladder's own demands on the request: no ``--space`` (its rungs are its space) and a global batch
    (the micro-batch of every rung is ``global_batch / world_size``), which it returns."""
    if target.space is not None:
        raise AutofitError("autofit ladder takes no --space: its rungs are fixed (autofit/planning/ladder.py)")
    if target.global_batch is None:
        raise AutofitError("autofit ladder needs --global-batch N (samples per optimizer step; the build-along "
                           "table of memory techniques uses 16)")
    return target.global_batch


def check_can_measure(hardware: Hardware) -> None:
    """Probing rungs on a CUDA device needs one visible here; the CPU is always here."""
    if hardware.kind == "cuda" and not cuda_devices_here():
        raise AutofitError(f"--measure on {hardware.name} needs a CUDA device and none is visible here; "
                           "without --measure the ladder is predicted only")


def ladder_plan(entry: str, workload: Workload | SourcePlannedWorkload, hardware: Hardware, *, world_size: int, global_batch: int,
                fixed: dict[str, Any] | None = None, facts: ModelFacts | None = None,
                software: Software | None = None, recipe: Recipe | None = None, margin: float = DEFAULT_MARGIN) -> Plan:
    """The plan of the ladder's space: enumerated under the rules, traced once (``facts``: a trace made earlier, the
    precisions and kernels it lacks traced and added, :func:`autofit.planning.plan.completed_facts`; ``software``:
    what the machine runs, this one's by default). ``recipe`` (default: the device's,
    :func:`autofit.planning.plan.default_recipe`) does not narrow the rungs: it is what each row is compared with;
    ``margin``: the share of the device memory a rung must leave free to fit."""
    fixed = dict(fixed or {})
    check_fixed(fixed)
    sequence = workload.sequence
    ladder = rungs(mixed_precision(hardware), world_size, sequence is not None, hardware.ranks_on_a_node(world_size),
                   bool(sequence is not None and sequence.tp_styles))
    space = ladder_space(ladder, max(1, global_batch // world_size))
    plan = Plan.make(entry, workload, hardware, space, world_size=world_size, global_batch=global_batch,
                     fixed=fixed, facts=facts,
                     software=software, recipe=recipe, narrow=False, margin=margin)
    return plan


def recipe_label(differs: tuple[Difference, ...]) -> str:
    """The ``vs recipe`` cell: ``recipe`` where nothing differs, else what does (``substitute: adamw8bit for adamw``;
    ``not the recipe: fp32 for bf16``)."""
    if not differs:
        return "recipe"
    return "; ".join(f"{'substitute' if d.substitute else 'not the recipe'}: {d.label()}" for d in differs)


@dataclass(frozen=True)
class LadderRow:
    """One rung priced (and, with ``--measure``, probed)."""

    index: int
    rung: Rung
    config: Config
    prediction: Prediction
    rule: str | None
    """Why a rule of the device refuses this rung (None: it can run here)."""
    measured: dict[str, Any] | None = None
    """The probe's JSON (``autofit probe``), where the rung was probed."""
    differs: tuple[Difference, ...] = ()
    """What this rung changes of the user's recipe (:func:`autofit.core.recipe.differences`); empty: the recipe's own."""

    @property
    def recipe_label(self) -> str:
        """``recipe``, or what differs (:func:`recipe_label`)."""
        return recipe_label(self.differs)

    @property
    def fits(self) -> bool:
        """Runnable here and predicted within the usable budget (:meth:`autofit.planning.plan.Plan.predict`)."""
        return self.rule is None and self.prediction.fits

    @property
    def why_not(self) -> str | None:
        """Why it does not fit: the rule, else the cost model's reason."""
        return None if self.fits else (f"cannot run here: {self.rule}" if self.rule else self.prediction.reason)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rung": self.index,
            "name": self.rung.name,
            "changed": self.rung.changed,
            "config": self.config.to_dict(),
            "predicted": self.prediction.to_dict(),
            "fits": self.fits,
            "reason": self.why_not,
            "measured": self.measured,
            "differs_from_recipe": [d.to_dict() for d in self.differs],
        }


@dataclass(frozen=True)
class Ladder:
    """The ladder of one model on ``world_size`` ranks of one device."""

    name: str
    n_params: int
    hardware: Hardware
    world_size: int
    global_batch: int
    rows: tuple[LadderRow, ...]
    facts: ModelFacts | None = None
    """The traced model the rungs were priced with: a probed rung's DeepSpeed JSON is derived from it as the cost
    model priced it (ZeRO buckets from its hidden size, NVMe swap buffers from its largest parameter;
    :func:`autofit.probe.spec.probe_spec`)."""
    margin: float = DEFAULT_MARGIN
    """The safety margin the rungs' ``fits`` was judged with: predicted within :attr:`usable_bytes`."""
    recipe: Recipe | None = None
    """The user's recipe each row's ``differs`` compares with (the plan's :attr:`~autofit.planning.plan.Plan.stated_recipe`);
    None: a ladder made by hand."""

    @property
    def usable_bytes(self) -> int:
        """``(1 - margin) x`` the device memory (:mod:`autofit.cost_model.budget`)."""
        return usable_bytes(self.hardware.memory_bytes, self.margin)

    def with_measured(self, measured: dict[int, dict[str, Any]]) -> Ladder:
        """The same ladder with the probes' JSON (by rung index) added."""
        rows = tuple(replace(row, measured=measured.get(row.index, row.measured)) for row in self.rows)
        return replace(self, rows=rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": {"name": self.name, "n_params": self.n_params},
            "hardware": self.hardware.to_dict() | {"world_size": self.world_size},
            "budget": budget_dict(self.hardware.memory_bytes, self.margin),  # what "fits" was judged against
            "global_batch": self.global_batch,
            "rungs": [row.to_dict() for row in self.rows],
        }


def price_ladder(plan: Plan, calibration: Calibration | None = None) -> Ladder:
    """Every rung of ``plan`` (from :func:`ladder_plan`) priced with ``calibration`` (the prior when None)."""
    # the rungs the plan was made of (ladder_plan): its space holds each rung's values
    ladder = rungs(mixed_precision(plan.hardware), plan.world_size, plan.facts.seq_len > 0,
                   plan.hardware.ranks_on_a_node(plan.world_size), max(plan.space.values["tensor_parallel"]) > 1)
    first = plan.candidates[0]  # every candidate shares the micro-batch, accumulation and attention
    base = first.with_(**BASELINE)
    recipe = plan.stated_recipe
    rows = tuple(
        LadderRow(index=i, rung=rung, config=config, prediction=plan.predict(config, calibration),
                  rule=rule_reason(config, plan.rejected), differs=differences(recipe, config))
        for i, (rung, config) in enumerate(zip(ladder, rung_configs(base, ladder), strict=True))
    )
    return Ladder(name=plan.name, n_params=plan.facts.n_params, hardware=plan.hardware, world_size=plan.world_size,
                  global_batch=first.samples_per_step(plan.world_size), rows=rows, facts=plan.facts, margin=plan.margin,
                  recipe=recipe)


def _quiet(line: str) -> None:
    """The default ``say``: progress goes nowhere."""


def measure_ladder(ladder: Ladder, entry: str, *, steps: int = 3, timeout_s: float = 600.0,
                   software: Software | None = None, say: Callable[[str], None] = _quiet) -> Ladder:
    """Probe each rung of ``ladder`` predicted to fit, one probe process each, forked by one warm parent
    (:func:`autofit.probe.run.run_probe`, :class:`autofit.probe.warm.WarmParent`,
    as ``autofit probe``: ``steps`` measured steps, ``timeout_s`` seconds a probe), on the ladder's device and
    world size; the ladder with each probe's JSON as its rung's ``measured``. A rung that does not fit is never
    probed. The DeepSpeed ops the rungs need are built or loaded first, as their own step
    (:func:`autofit.probe.ops.prepare_ops`), so a JIT build is in no probe's time. ``entry``: the workload's
    entry point, what each probe loads; ``software``: what the machine runs (``--nvme-path``), this one's by
    default; ``say``: one progress line at a time (the CLI prints them on stderr)."""

    check_can_measure(ladder.hardware)
    fitting = [row for row in ladder.rows if row.fits]
    if not fitting:
        say("autofit: no rung is predicted to fit: nothing to probe")
        return ladder
    report = prepare_ops([row.config for row in fitting], ladder.hardware, software)
    for line in report.lines():
        say(line)
    software = report.software(software if software is not None else detect_software())
    measured = {}
    ops = tuple(op for op, state in report.loaded.items() if state == "ok")
    with WarmParent(entry, fitting[0].config.attention, ladder.hardware.kind, ops) as warm:
        for row in fitting:
            say(f"autofit: probing rung {row.index} ({row.rung.name}): {row.config.label()}")
            spec = probe_spec(entry, row.config, ladder.hardware, ladder.world_size, steps=steps, software=software,
                              facts=ladder.facts)
            probed = run_probe(spec, timeout_s=timeout_s, warm=warm)
            measured[row.index] = probed.to_json()
    return ladder.with_measured(measured)


def run_ladder(setup: Setup, *, measure: bool = False, steps: int = 3, timeout_s: float = 600.0,
               say: Callable[[str], None] = _quiet) -> Ladder:
    """``autofit ladder`` as a function: the ladder of ``setup``'s workload on its device and world size at its
    global batch, priced, and with ``measure`` each rung that fits probed (:func:`measure_ladder`). Bad input
    (a ``--space``, no global batch, ``--set`` of a key the ladder steps through, ``measure`` of a CUDA device
    not here) is an :class:`AutofitError` before anything is traced."""
    global_batch = check_target(setup.target)
    check_fixed(setup.fixed)
    if measure:
        check_can_measure(setup.hardware)
    say(f"autofit: {setup.tracing_note()}")
    plan = ladder_plan(setup.entry_point, setup.planning_workload, setup.hardware, world_size=setup.world_size,
                       global_batch=global_batch, fixed=setup.fixed, software=setup.software,
                       recipe=setup.recipe, margin=setup.target.margin)
    ladder = price_ladder(plan)
    if measure:
        ladder = measure_ladder(ladder, setup.entry_point, steps=steps, timeout_s=timeout_s, software=setup.software,
                                say=say)
    return ladder


def rule_reason(config: Config, rejected: tuple[tuple[dict[str, Any], str], ...]) -> str | None:
    """The reason of the first rule rejection whose partial config ``config`` matches, else None."""
    values = config.to_dict()
    for partial, reason in rejected:
        if all(values.get(key) == value for key, value in partial.items()):
            return reason
    return None


def search_ladder(entry: str, workload: Workload, winner: Config, fixed: dict[str, Any], *, hardware: Hardware,
                  world_size: int, facts: ModelFacts | None, margin: float, calibration: Calibration | None,
                  recipe: Recipe, software: Software) -> Ladder:
    """The ladder that ends ``autofit run``'s report: the search's device, world size, global batch and the
    ``winner``'s micro-batch and accumulation (so the rungs differ from the winner only in the techniques), priced
    with the search's ``calibration``; the search's traced ``facts`` are reused where they cover the rungs.
    ``margin``, ``recipe`` and ``software`` are the search's own (its :class:`autofit.planning.target.Setup`'s):
    the budget the rows are judged by, what they are compared with and what the rules judge by."""
    kept = {key: value for key, value in fixed.items() if key not in LADDER_KEYS}
    kept |= {"micro_batch_size": winner.micro_batch_size, "grad_accum_steps": winner.grad_accum_steps}
    plan = ladder_plan(entry, workload, hardware, world_size=world_size,
                       global_batch=winner.samples_per_step(world_size), fixed=kept, facts=facts,
                       software=software, recipe=recipe, margin=margin)
    return price_ladder(plan, calibration)
