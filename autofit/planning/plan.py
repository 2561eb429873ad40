"""The plan of a search or an estimate: what is searched, on what, for which model. Made once.

A :class:`Plan` holds everything that does not change while candidates are priced and probed:
the workload's traced facts, the device, the safety margin, the world size, the space's candidates after
its rules and the rules' rejections. ``autofit estimate`` prices it with the prior coefficients; ``autofit
run`` prices it again after every probe with the calibrated ones. Both go through
:meth:`Plan.predict`, which judges every prediction against the usable budget, ``(1 - margin) x`` the device
memory (:mod:`autofit.cost_model.budget`), so no two commands disagree on what a candidate needs or on whether
it fits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from autofit.core.config import WORKING_BYTES, Config
from autofit.core.errors import AutofitError
from autofit.core.hardware import Hardware
from autofit.core.recipe import QUANTIZED_COMMUNICATION, Recipe, narrow_space, recipe_for
from autofit.core.software import Software
from autofit.core.space import SearchSpace, enumerate_candidates
from autofit.core.units import format_bytes
from autofit.cost_model import Coefficients, ModelFacts, Prediction, predict
from autofit.cost_model.allocation_sequence import reserve_key
from autofit.cost_model.budget import DEFAULT_MARGIN, check_margin, exact_within_bytes, usable_bytes, usable_hardware
from autofit.cost_model.calibrate import Calibration
from autofit.cost_model.cuda_runtime import cublas_workspace_bytes
from autofit.cost_model.facts import footprint_key
from autofit.cost_model.states import optimizer_state_bytes
from autofit.ds.emit import deepspeed_config
from autofit.ds.swap_buffers import nvme_swap_bytes, optimizer_swap_pinned_bytes, param_swap_pinned_bytes
from autofit.machine.software import detect_software
from autofit.planning.dominated import traced_beside_sdpa
from autofit.planning.parallel_pricing import priced_in_parallel
from autofit.planning.reserve_cache import kept_reserves
from autofit.probe.footprint import PendingFootprints, footprints_for
from autofit.probe.spec import probe_spec
from autofit.trace import REAL_TRACE_LIMIT_BYTES, trace_micro_batches, trace_workload
from autofit.trace.source_cache import SourcePlannedWorkload
from autofit.workload.entry import is_loadable
from autofit.workload.types import Workload

if TYPE_CHECKING:
    from pathlib import Path

    from autofit.probe.records import ProbeSpec


@dataclass(frozen=True)
class Plan:
    """The candidates of one space for one workload on ``world_size`` ranks of one device."""

    entry: str
    """The workload's entry point (``path.py:function``), what a probe loads."""
    name: str
    """The workload's name (the entry when it has none)."""
    hardware: Hardware
    """The device, with its memory budget (``--memory``): what a probe runs on and is capped at."""
    space: SearchSpace
    """The search space the candidates come from."""
    world_size: int
    """Data-parallel ranks (GPUs per node x nodes)."""
    global_batch: int | None
    """Samples per optimizer step over all ranks (None: the space's own)."""
    fixed: dict[str, Any]
    """Keys fixed with ``--set``."""
    candidates: tuple[Config, ...]
    """Every config of the space that its rules allow."""
    rejected: tuple[tuple[dict[str, Any], str], ...]
    """Partial configs the rules removed, each with its reason."""
    facts: ModelFacts
    """The model as traced on fake tensors."""
    coefficients: Coefficients
    """The cost model's prior for this device, before any probe."""
    software: Software = field(default_factory=detect_software)
    """What the machine runs, ``--nvme-path`` included: the rules prune by it and every DeepSpeed JSON of
    this plan (estimate, probe, winner) is written with it (:func:`autofit.ds.emit.deepspeed_config`)."""
    recipe: Recipe | None = None
    """The user's training recipe (:mod:`autofit.core.recipe`): what the winner's JSON carries and is compared with.
    None (a plan made by hand): :func:`default_recipe` of the device and ``fixed``."""
    hosts: tuple[str, ...] = ()
    """``--hosts``: where the probes of several nodes run (:mod:`autofit.probe.nodes`); empty: the Slurm
    allocation, else simulated nodes here."""
    kernels: tuple[str, ...] | None = None
    """The attention kernels the model can be built with (:attr:`autofit.workload.types.Workload.kernels`); (): the
    model has no kernel dimension (no attention, or no ``attention`` keyword); None: a plan made by hand."""
    kernel_note: str | None = None
    """Why :attr:`kernels` is narrower than every kernel (:attr:`autofit.workload.types.Workload.kernel_note`)."""
    margin: float = DEFAULT_MARGIN
    """The share of the device memory every candidate must leave free (``--margin``): a candidate fits when it is
    predicted within :attr:`usable_bytes` (:mod:`autofit.cost_model.budget`)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, but got {self.world_size=}")
        object.__setattr__(self, "margin", check_margin(self.margin))

    @classmethod
    def make(
        cls,
        entry: str,
        workload: Workload | SourcePlannedWorkload,
        hardware: Hardware,
        space: SearchSpace,
        *,
        world_size: int = 1,
        global_batch: int | None = None,
        fixed: dict[str, Any] | None = None,
        coefficients: Coefficients | None = None,
        facts: ModelFacts | None = None,
        software: Software | None = None,
        recipe: Recipe | None = None,
        narrow: bool = True,
        hosts: tuple[str, ...] = (),
        margin: float = DEFAULT_MARGIN,
    ) -> Plan:
        """Enumerate the space under its rules and trace the workload once for every candidate's needs (``coefficients``:
        the prior, the device's own by default; ``facts``: a trace made earlier; ``software``: what the target runs,
        this machine's by default, :func:`autofit.machine.software.detect_software`).

        ``recipe``: the user's (default: :func:`default_recipe`, AdamW in the device's precision, or what ``fixed``
        names); with ``narrow`` the space's optimizers and precisions are narrowed to it and its allowed
        substitutes (:func:`autofit.core.recipe.narrow_space`). ``narrow=False`` keeps the space as written: the
        ladder, whose rungs step through them and are labelled instead (and tests of the policy over several
        optimizers); the emitted JSON still says what differs from the recipe. ``margin``: the share of the device
        memory every candidate must leave free (:attr:`margin`)."""
        fixed = dict(fixed or {})
        software = software if software is not None else detect_software()
        recipe = _checked_recipe(recipe if recipe is not None else default_recipe(hardware, fixed), fixed)
        space = narrow_space(space, recipe) if narrow else space
        enumeration = enumerate_candidates(
            space, hardware=hardware, world_size=world_size, global_batch=global_batch, fixed=fixed,
            searches_attention=workload.searches_attention, attention_kernels=workload.kernels,
            checkpoints_attention=_checkpoints_attention(workload, space, fixed), software=software,
            sequence=workload.sequence,
        )
        facts, configs, unplanned = traced_candidates(entry, workload, tuple(enumeration.candidates), hardware,
                                                      world_size, software, facts)
        return cls(
            entry=entry,
            name=workload.name or entry,
            hardware=hardware,
            space=space,
            world_size=world_size,
            global_batch=global_batch,
            fixed=fixed,
            candidates=configs,
            rejected=(*enumeration.rejected, *unplanned),
            facts=facts,
            coefficients=coefficients or Coefficients.for_hardware(hardware),
            software=software,
            recipe=recipe,
            hosts=tuple(hosts), kernels=workload.kernels, kernel_note=workload.kernel_note, margin=margin,
        )

    @property
    def stated_recipe(self) -> Recipe:
        """The recipe the plan was made for (:func:`default_recipe` where it was made by hand without one)."""
        return self.recipe if self.recipe is not None else default_recipe(self.hardware, self.fixed)

    def deepspeed(self, config: Config) -> dict[str, Any]:
        """The DeepSpeed JSON a user trains ``config`` (one of the candidates) with, as this plan has it: its world
        size, device, software and :attr:`stated_recipe` (hyperparameters, what ``config`` changes of it), the ZeRO
        buckets and NVMe swap buffers sized from its traced facts, no kernel named where the model has no attention
        (:func:`autofit.ds.emit.deepspeed_config`). Every candidate's JSON in ``autofit estimate`` and the search's
        winner are this one call."""
        return deepspeed_config(config, self.world_size, self.hardware.kind, self.software, recipe=self.stated_recipe,
                                largest_param_numel=self.facts.largest_param_numel, hidden_size=self.facts.hidden_size,
                                has_attention=self.kernels != ())

    def probe_spec(self, config: Config, *, mode: str = "real", steps: int = 3, warmup_steps: int = 1,
                   memory_snapshot: str | Path | None = None) -> ProbeSpec:
        """The probe of ``config``, one of the candidates, as this plan has it: its workload, device, world size,
        software and traced facts (:func:`autofit.probe.spec.probe_spec`). Where it runs (:attr:`hosts`) is the
        launcher's: :func:`autofit.probe.run.run_probe`'s ``hosts``."""
        return probe_spec(self.entry, config, self.hardware, self.world_size, mode=mode, steps=steps,
                          warmup_steps=warmup_steps, software=self.software, facts=self.facts,
                          memory_snapshot=memory_snapshot)

    @property
    def usable_bytes(self) -> int:
        """What a candidate may be predicted to hold and still fit: ``(1 - margin) x`` the device memory."""
        return usable_bytes(self.hardware.memory_bytes, self.margin)

    def with_memory(self, memory_bytes: int) -> Plan:
        """The same plan on a device with another memory budget (its margin kept)."""
        return replace(self, hardware=self.hardware.with_memory(memory_bytes))

    def with_margin(self, margin: float) -> Plan:
        """The same plan with another safety margin (the search's ``--margin``)."""
        return replace(self, margin=check_margin(margin))

    def usable(self) -> Plan:
        """The same plan with the device memory cut to its usable budget and no margin left to apply: what the
        search prices, calibrates and advises against (its ``usable.hardware.memory_bytes`` is the usable budget);
        every prediction the same as :meth:`predict` makes of this plan."""
        return replace(self, hardware=usable_hardware(self.hardware, self.margin), margin=0.0)

    def uncalibrated(self) -> Calibration:
        """The prior coefficients as a calibration of no probe."""
        return Calibration(coefficients=self.coefficients)

    def predict(self, config: Config, calibration: Calibration | None = None, facts: ModelFacts | None = None) -> Prediction:
        """``config`` priced with ``calibration`` (the prior when None), its ``fits`` judged against the usable budget
        (:attr:`usable_bytes`; :mod:`autofit.cost_model.budget`). ``facts``: other facts of the same model than the
        plan's (its trace carried to another length, :mod:`autofit.planning.longest`)."""
        budget = usable_hardware(self.hardware, self.margin)
        return (calibration or self.uncalibrated()).predict(config, facts or self.facts, budget, self.world_size)

    def _first_of_each_reserve_key(self) -> dict[tuple[object, ...], Config] | None:
        """On a GPU, each :func:`~autofit.cost_model.allocation_sequence.reserve_key`'s first candidate: the one whose
        replay stands for the key's, whichever candidate asks first (None on a CPU: no reserve)."""
        if self.hardware.kind != "cuda":
            return None
        workspace = cublas_workspace_bytes(self.hardware)
        first: dict[tuple[object, ...], Config] = {}
        for config in self.candidates:
            first.setdefault(reserve_key(config, self.facts, self.world_size, workspace), config)
        return first

    def price(self, calibration: Calibration | None = None) -> list[tuple[Config, Prediction]]:
        """Every candidate priced with ``calibration`` (the prior when None), fastest predicted first: each as
        :meth:`predict` prices it, but that a GPU peak past :func:`~autofit.cost_model.budget.exact_within_bytes` of
        the budget may be a lower bound (``Prediction.peak_is_lower_bound``; whether it fits is the same)."""
        calibration = calibration or self.uncalibrated()
        budget = usable_hardware(self.hardware, self.margin)  # what predict() judges against, made once
        # a GPU's candidates replay the allocator's requests, but none far past the budget (a peak there is a lower
        # bound: cost_model/memory.py bounded_memory); those of a model planned before are read back
        bounded = partial(predict, exact_within_bytes=exact_within_bytes(budget.memory_bytes),
                          reserve_representatives=self._first_of_each_reserve_key())
        # a kernel traced as SDPA's own is priced as its sdpa twin: once for both, where the calibration has no
        # memory correction by family (whose families tell kernels apart)
        as_sdpa = self.facts.kernels_priced_as_sdpa() if calibration.memory is None else frozenset()
        twins: dict[tuple[Any, ...], Prediction] = {}

        def priced_once(config: Config) -> Prediction:
            if not as_sdpa:  # no twins: nothing to share
                return calibration.predict(config, self.facts, budget, self.world_size, bounded)
            key = _priced_as(config, as_sdpa)
            if key not in twins:
                twins[key] = calibration.predict(config, self.facts, budget, self.world_size, bounded)
            return twins[key]

        # a large plan in forked processes, each pricing whole reserve keys (twins share one: it leaves out the kernel)
        workspace = cublas_workspace_bytes(self.hardware)
        with kept_reserves(self.facts) if self.hardware.kind == "cuda" else contextlib.nullcontext():
            predictions = priced_in_parallel(
                self.candidates, priced_once, lambda c: reserve_key(c, self.facts, self.world_size, workspace),
                self.facts) or [priced_once(c) for c in self.candidates]
        priced = list(zip(self.candidates, predictions, strict=True))
        priced.sort(key=lambda cp: -cp[1].samples_per_s)
        return priced


def _priced_as(config: Config, as_sdpa: frozenset[str]) -> tuple[Any, ...]:
    """``config``'s values with its kernel as the one it is priced as: ``sdpa`` for a kernel of ``as_sdpa``
    (:meth:`ModelFacts.kernels_priced_as_sdpa`), else its own."""
    values = config.to_dict()
    if values["attention"] in as_sdpa:
        values["attention"] = "sdpa"
    return tuple(values.values())


def traced_candidates(entry: str, workload: Workload | SourcePlannedWorkload, configs: tuple[Config, ...],
                      hardware: Hardware, world_size: int, software: Software, facts: ModelFacts | None
                      ) -> tuple[ModelFacts, tuple[Config, ...], list[tuple[dict[str, Any], str]]]:
    """The facts ``configs`` are priced from (``facts``, a trace made earlier, completed: :func:`completed_facts`; on
    a CPU with the model's kernel footprints, measured beside the trace), the configs left, and why the others were:
    eager attention beside SDPA on CUDA (:func:`autofit.planning.dominated.without_dominated_attention`; searched
    after all where SDPA cannot trace the model), past the NVMe room (:func:`within_nvme_room`) or of a kernel that
    could not be traced (:func:`traced_kernels_only`)."""
    with pending_footprints(entry, configs, hardware, facts) as pending:  # a CPU's: nothing is left out there
        facts, searched, dominated = traced_beside_sdpa(
            lambda some, earlier, before: completed_facts(workload, some, hardware.kind, earlier, before),
            configs, hardware, facts, pending.start if pending is not None else None)
        searched, no_room = within_nvme_room(searched, facts, hardware, world_size, software)
        searched, untraced = traced_kernels_only(searched, facts)
        if hardware.kind == "cpu":
            facts = with_kernel_footprints(facts, entry, searched, pending)
    return facts, searched, [*dominated, *no_room, *untraced]


def traced_kernels_only(configs: tuple[Config, ...], facts: ModelFacts
                        ) -> tuple[tuple[Config, ...], list[tuple[dict[str, Any], str]]]:
    """``configs`` less those of an attention kernel the trace could not build or run the model with
    (:attr:`autofit.cost_model.facts.ModelFacts.untraced_kernels`), and one rejection a kernel saying why."""
    untraced = facts.untraced_kernels
    rejected = [({"attention": kernel}, f"attention={kernel} could not be traced ({why}): planned with the other kernels")
                for kernel, why in untraced.items()]
    return tuple(c for c in configs if c.attention not in untraced), rejected


def within_nvme_room(configs: tuple[Config, ...], facts: ModelFacts, hardware: Hardware, world_size: int,
                     software: Software) -> tuple[tuple[Config, ...], list[tuple[dict[str, Any], str]]]:
    """``configs`` less the NVMe-offload ones the machine cannot hold, and why each kind was rejected: swap files
    past the ``--nvme-path`` filesystem's free space (:func:`autofit.ds.swap_buffers.nvme_swap_bytes`), or a rank's
    ``mlock``-ed swap buffers past ``RLIMIT_MEMLOCK`` (:attr:`autofit.core.software.Software.memlock_bytes`). What is
    not known (free space, a limit) rejects nothing."""

    kept: list[Config] = []
    rejected: dict[tuple[Any, ...], tuple[dict[str, Any], str]] = {}
    shard = facts.n_trainable_params / world_size
    partitioned = facts.n_trainable_params - facts.n_persistent_params
    for c in configs:
        w = WORKING_BYTES[c.precision]
        reason = None
        free = software.nvme_free_bytes
        need = nvme_swap_bytes(c.offload_params, c.offload_optimizer,
                               optimizer_state_bytes(c.optimizer, facts, shard, flat=True), partitioned,
                               facts.n_trainable_params, world_size, hardware.ranks_on_a_node(world_size), w)
        if free is not None and need > free:
            reason = (f"NVMe offload writes {format_bytes(need)} to --nvme-path {software.nvme_path}, "
                      f"which has {format_bytes(free)} free")
        locked = ((param_swap_pinned_bytes(facts.largest_param_numel, partitioned, world_size, w)
                   if c.offload_params == "nvme" else 0.0)
                  + (optimizer_swap_pinned_bytes(facts.n_trainable_params, world_size)
                     if c.offload_optimizer == "nvme" else 0.0))
        if reason is None and software.memlock_bytes is not None and locked > software.memlock_bytes:
            reason = (f"NVMe offload mlocks {format_bytes(locked)} of swap buffers per rank but RLIMIT_MEMLOCK is "
                      f"{format_bytes(software.memlock_bytes)} (raise it: ulimit -l unlimited)")
        if reason is None:
            kept.append(c)
            continue
        key = (c.offload_params, c.offload_optimizer, c.optimizer, c.precision)
        names = ("offload_params", "offload_optimizer", "optimizer", "precision")
        rejected.setdefault(key, (dict(zip(names, key, strict=True)), reason))
    if configs and not kept:
        raise AutofitError(f"no candidate is left: {next(iter(rejected.values()))[1]}")
    return tuple(kept), list(rejected.values())


def default_recipe(hardware: Hardware, fixed: dict[str, Any] | None = None) -> Recipe:
    """The recipe where the user states none: the optimizer and precision ``fixed`` names (``--set`` names the
    recipe), else AdamW in :func:`autofit.core.recipe.default_precision` of ``hardware``; no substitutes."""
    return recipe_for(fixed or {}, hardware.kind, hardware.supports_precision("bf16"))


def _checkpoints_attention(workload: Workload | SourcePlannedWorkload, space: SearchSpace, fixed: dict[str, Any]) -> bool:
    """Whether attention-only checkpointing can run: asked of the model only where the space or ``--set`` wants it."""
    wanted = fixed["checkpoint_granularity"] == "attention" if "checkpoint_granularity" in fixed \
        else "attention" in space.values["checkpoint_granularity"]
    return not wanted or workload.checkpoints_attention()


def traces_needed(configs: tuple[Config, ...] | list[Config]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The precisions and attention kernels the candidates use (each traced once)."""
    precisions = tuple(sorted({c.precision for c in configs}))
    attentions = tuple(sorted({c.attention for c in configs}))
    return precisions, attentions


def trace_request(configs: tuple[Config, ...] | list[Config], device_kind: str = "cpu") -> dict[str, Any]:
    """The arguments of :func:`autofit.trace.trace_workload` for ``configs``: every precision class, attention
    kernel, checkpoint ratio and granularity they use, their optimizers and micro-batches, and the SDPA dispatch of
    the device they run on (``device_kind``: ``cpu`` or ``cuda``, :mod:`autofit.trace.sdpa`)."""

    precisions, attentions = traces_needed(configs)
    ratios = tuple(sorted({c.checkpoint_ratio for c in configs}))
    optimizers = tuple(sorted({c.optimizer for c in configs}))
    granularities = tuple(sorted({c.checkpoint_granularity for c in configs if c.checkpoint_ratio > 0})) or ("block",)
    largest = max((c.micro_batch_size for c in configs), default=1)
    return {"precisions": precisions, "attentions": attentions, "checkpoint_ratios": ratios,
            "optimizers": optimizers, "checkpoint_granularities": granularities,
            "micro_batches": trace_micro_batches(largest), "sdpa_dispatch": "cpu" if device_kind == "cpu" else "cuda"}


def trace_for(workload: Workload | SourcePlannedWorkload, configs: tuple[Config, ...] | list[Config],
              device_kind: str = "cpu", before_tracing: Callable[[int], None] | None = None,
              tensor_parallel: int = 1) -> ModelFacts:
    """Trace ``workload`` at every precision class, attention kernel, checkpoint ratio and granularity the
    configs use (and count the states of the optimizers that need the model itself: Adam-mini); an entry's
    :class:`~autofit.trace.source_cache.SourcePlannedWorkload` answers from its record where it has one.
    ``before_tracing``: :func:`autofit.trace.trace_workload`'s; ``tensor_parallel``: above 1, one AutoTP rank's
    model is traced (:mod:`autofit.trace.tensor_parallel`)."""

    request = trace_request(configs, device_kind)
    if tensor_parallel > 1:
        request["tensor_parallel"] = tensor_parallel
    if isinstance(workload, SourcePlannedWorkload):
        return workload.facts(request)
    return trace_workload(workload, **request, before_tracing=before_tracing)


def completed_facts(workload: Workload | SourcePlannedWorkload, configs: tuple[Config, ...] | list[Config],
                    device_kind: str, facts: ModelFacts | None,
                    before_tracing: Callable[[int], None] | None = None) -> ModelFacts:
    """``facts``, a trace made earlier (None: none), with what ``configs`` need that it lacks traced and added: the
    precisions and attention kernels it holds no profile of (:func:`traced_for`) are traced alone and their profiles
    joined to its own (a search's trace covers its recipe's precision; the ladder after it adds the mixed one), and
    for the configs that split the model with AutoTP, one rank's model at each of their degrees
    (:attr:`~autofit.cost_model.facts.ModelFacts.tensor_parallel_ranks`; the whole model is traced for the others,
    or for the first alone where every config splits it: its parameters are what the plan reports).
    ``before_tracing``: called before a trace of none made earlier runs (:func:`autofit.trace.trace_workload`)."""
    whole = [c for c in configs if c.tensor_parallel == 1] or [c.with_(tensor_parallel=1) for c in configs[:1]]
    facts = _completed(workload, whole, device_kind, facts, before_tracing)
    ranks = dict(facts.tensor_parallel_ranks)
    for degree in sorted({c.tensor_parallel for c in configs} - {1}):
        split = [c.with_(tensor_parallel=1) for c in configs if c.tensor_parallel == degree]
        ranks[str(degree)] = _completed(workload, split, device_kind, ranks.get(str(degree)), tensor_parallel=degree)
    return replace(facts, tensor_parallel_ranks=ranks) if ranks != facts.tensor_parallel_ranks else facts


def _completed(workload: Workload | SourcePlannedWorkload, configs: list[Config], device_kind: str,
               facts: ModelFacts | None, before_tracing: Callable[[int], None] | None = None,
               tensor_parallel: int = 1) -> ModelFacts:
    """:func:`completed_facts` of one model: the whole one, or one AutoTP rank's at ``tensor_parallel``."""
    if facts is None:
        return trace_for(workload, configs, device_kind, before_tracing, tensor_parallel)
    missing = [c for c in configs if not traced_for(facts, c)]
    if not missing:
        return facts
    extra = trace_for(workload, missing, device_kind, tensor_parallel=tensor_parallel)
    profiles = {**facts.profiles, **extra.profiles}
    kernels = {profile.attention for profile in profiles.values()}
    untraced = {k: why for k, why in {**facts.untraced_kernels, **extra.untraced_kernels}.items() if k not in kernels}
    return replace(facts, profiles=profiles, attention_traces={**facts.attention_traces, **extra.attention_traces},
                   untraced_kernels=untraced, trace_seconds=facts.trace_seconds + extra.trace_seconds)


def traced_for(facts: ModelFacts, config: Config) -> bool:
    """Whether ``facts`` holds the profiles ``config`` is priced from: its precision class and kernel, and where it
    checkpoints, the same checkpointed at its granularity (or what stands in for them,
    :meth:`~autofit.cost_model.facts.ModelFacts.profile`); a kernel the trace could not run counts as traced."""
    try:
        facts = facts.rank(config.tensor_parallel)
    except KeyError:
        return False
    if config.attention in facts.untraced_kernels:
        return True
    try:
        facts.profile(config.trace_dtype, config.attention, False)
        if config.checkpoint_ratio > 0:
            facts.profile(config.trace_dtype, config.attention, True, config.checkpoint_granularity)
    except KeyError:
        return False
    return True


#: the most parameters a model whose kernel footprint is measured may have: its fp32 weights within the limit of a
#: real trace (:data:`autofit.trace.REAL_TRACE_LIMIT_BYTES`)
FOOTPRINT_MOST_PARAMS = REAL_TRACE_LIMIT_BYTES // 4


def with_kernel_footprints(facts: ModelFacts, entry: str, configs: tuple[Config, ...] | list[Config],
                           pending: PendingFootprints | None = None) -> ModelFacts:
    """``facts`` with the model's kernel footprint measured for every precision the configs compute in, plain and
    checkpointed (both in one process), on a CPU device (:mod:`autofit.probe.footprint`, a few seconds each; kept in
    the trace cache under what the model traced to, so a model planned again is not measured again; ``pending``:
    those started beside the trace, :func:`pending_footprints`). A model too large to run here, one whose
    measurement fails, or a :class:`Workload` object with no entry point (:func:`autofit.workload.entry.is_loadable`:
    the measuring process cannot load it) keeps the cost model's default."""

    needed = tuple(sorted({c.trace_dtype for c in configs
                           if footprint_key(c.trace_dtype, c.checkpointed_layers(facts.n_layers) > 0)
                           not in facts.kernel_footprint_bytes}))
    if not needed or not is_loadable(entry) or facts.n_params > FOOTPRINT_MOST_PARAMS:
        return facts
    traced = json.dumps(replace(facts, kernel_footprint_bytes={}, trace_seconds=0.0).to_dict(), sort_keys=True)
    measured = footprints_for(entry, needed, footprint_attention(configs),
                              model_digest=hashlib.sha256(traced.encode()).hexdigest(), pending=pending)
    return replace(facts, kernel_footprint_bytes={**facts.kernel_footprint_bytes, **measured}) if measured else facts


def footprint_attention(configs: tuple[Config, ...] | list[Config]) -> str:
    """The kernel a plan's footprints are measured with: its candidates' most common."""
    return Counter(c.attention for c in configs).most_common(1)[0][0]


def pending_footprints(entry: str, configs: tuple[Config, ...], hardware: Hardware, facts: ModelFacts | None
                       ) -> contextlib.AbstractContextManager[PendingFootprints | None]:
    """Where a CPU plan traces its model anew (no ``facts`` made earlier) and can measure its footprints, the
    :class:`~autofit.probe.footprint.PendingFootprints` its trace starts (every precision of ``configs``): measured
    beside the trace rather than after it, each a few seconds on a small model; else None."""
    if hardware.kind != "cpu" or facts is not None or not configs or not is_loadable(entry):
        return contextlib.nullcontext()
    precisions = tuple(sorted({c.trace_dtype for c in configs}))
    return PendingFootprints(entry, precisions, footprint_attention(configs), FOOTPRINT_MOST_PARAMS)


def _checked_recipe(recipe: Recipe, fixed: dict[str, Any]) -> Recipe:
    """``recipe``, where every ``--set optimizer=`` / ``precision=`` in ``fixed`` is its value or an allowed substitute
    (else one error line), and every ``--set`` of ZeRO++'s quantized communication on is allowed (``--allow qwz``)."""
    for key in ("optimizer", "precision"):
        if key in fixed and fixed[key] not in recipe.values(key):
            raise AutofitError(f"--set {key}={fixed[key]} is neither the recipe's {key} "
                               f"{getattr(recipe, key)} nor a substitute it allows")
    for name, (key, _) in QUANTIZED_COMMUNICATION.items():
        if fixed.get(key) and True not in recipe.values(key):
            raise AutofitError(f"--set {key}=true changes the recipe's numerics (ZeRO++'s {name}, docs/recipe.md): "
                               f"allow it with --allow {name}")
    return recipe
