"""``autofit estimate --seq-len max``: the longest sequence an ``hf:`` causal LM trains at on the device, with which
config, by the cost model, and what each long-context technique buys.

**Each length needs a trace; two are made.** The model is traced at two lengths ``s1 < s2`` (``s2`` the config's
``max_position_embeddings`` or :data:`TRACE_LENGTH`, whichever is smaller; ``s1 = s2 / 2``) and every traced number
is carried to any length ``s`` by the shape the kernels give it. Memory (the peaks, the bytes live at the loss) is
linear in ``s``: with sdpa and flash attention nothing the step holds is ``s x s`` (flash saves its output and the
log-sum-exp; sdpa's CPU and CUDA kernels the same), so every tensor is ``tokens x width`` and the line through the
two traces is exact up to what the allocator rounds. FLOPs and the non-matmul bytes are ``a s + c s^2`` (the
matmuls per token, attention's ``QK^T`` and ``PV`` quadratic), through the two traces. ``eager`` attention holds the
``s x s`` scores (quadratic memory): it is never the longest and is left out, as are the keys whose every value
only trades memory for time the same way at every length: the most checkpointing the space lists, whole blocks,
micro-batch 1 (unless ``--set``), ``compile`` off, no ``overlap_comm``, buckets at 1x (the lean space).

**Bisection.** A length fits when some candidate of the lean space at that length (the rules judge it: ``sp``
divides it, TiledMLP has two tiles) is predicted to fit device and host (:func:`autofit.cost_model.predict`). The
longest is found by doubling then bisecting over multiples of the SP degrees' least common multiple; the answer's
config is the fastest fitting one there. The ladder repeats it with the techniques added one at a time: none, the
tiled loss, TiledMLP, activation offload, sequence parallelism; then, for a model that states a ``tp_plan`` on ranks
that share a node, AutoTP over a node's ranks in place of them (the split model traced at the same two lengths). The
answer is the longest rung's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from autofit.core.config import LONG_CONTEXT_KEYS, Config
from autofit.core.errors import AutofitError
from autofit.core.hardware import Hardware
from autofit.core.sequence import SequenceShape
from autofit.core.space import SearchSpace, enumerate_candidates
from autofit.core.units import format_bytes
from autofit.cost_model import ModelFacts, Prediction, predict
from autofit.cost_model.allocation_sequence import reserve_key
from autofit.cost_model.budget import usable_hardware
from autofit.cost_model.cuda_runtime import cublas_workspace_bytes
from autofit.cost_model.facts import PeakPoint
from autofit.planning.plan import Plan, completed_facts
from autofit.planning.target import Target, prepare
from autofit.workload.hf import HfEntry, load_config
from autofit.workload.hf_positions import past_positions_note, positions_are_a_table

#: the longer of the two traced lengths where the config allows it
TRACE_LENGTH = 4096
#: the longest length the bisection tries
LONGEST_TRIED = 2**28
#: memory-like attributes of a traced point (linear in the length) and time-like ones (a s + c s^2)
LINEAR_ATTRS = ("peak_with_grads_bytes", "peak_without_grads_bytes", "activation_bytes", "head_peak_with_grads_bytes",
                "head_peak_without_grads_bytes", "body_peak_with_grads_bytes", "body_peak_without_grads_bytes")
QUADRATIC_ATTRS = ("flops", "fp8_flops", "memory_bound_bytes", "fused_memory_bound_bytes")
#: elements past which a tensor's flat index no longer fits an int32: Triton kernels that index in int32 fail there
#: with "an illegal memory access" (Liger-Kernel issue #803, from ALST's authors: Liger's RMSNorm at a
#: ``[1, 555_000, 4096]`` hidden state; flash-attn 2 too, flash-attn 3 not)
INT32_ELEMENTS = 2**31
#: the ladder's rungs: a name and the long-context keys it lets vary (cumulative)
RUNGS = (("no long-context technique", ()), ("+ tiled loss", ("tiled_loss",)),
         ("+ tiled MLP", ("tiled_loss", "tiled_mlp")),
         ("+ activation offload", ("tiled_loss", "tiled_mlp", "offload_activations")),
         ("+ sequence parallelism", LONG_CONTEXT_KEYS))


@dataclass(frozen=True)
class LongestRung:
    """The longest length with one more technique allowed."""

    name: str
    """What this rung adds (``+ tiled loss``)."""
    seq_len: int
    """The longest length that fits with it (0: none)."""
    config: Config | None
    """The fastest config that fits at that length."""
    prediction: Prediction | None = None
    """Its prediction there."""
    traced_length: int | None = None
    """The length its line was traced at beside the longer short trace (None: the two short traces alone)."""


@dataclass(frozen=True)
class Longest:
    """The answer of ``--seq-len max``."""

    name: str
    """The model."""
    hardware: str
    """The device preset."""
    world_size: int
    """Ranks."""
    seq_len: int
    """The longest sequence that fits (0: none)."""
    config: Config | None
    """The fastest config that fits at it."""
    prediction: Prediction | None
    """Its prediction."""
    rungs: tuple[LongestRung, ...]
    """What each technique buys, cumulative."""
    traced_lengths: tuple[int, int]
    """The two lengths the model was traced at."""
    max_position_embeddings: int | None
    """The config's own limit: the answer passes it where positions are computed (rotary, ALiBi: the rope scaling's
    question, not memory's), never where they are a table (:mod:`autofit.workload.hf_positions`)."""
    int32_tokens: int | None = None
    """Tokens a rank past which its hidden states ``[1, s / sp, h]`` have more than 2^31 elements
    (:data:`INT32_ELEMENTS`), None where the hidden size is unknown."""
    answer_traced_length: int | None = None
    """The length the answer's rung was traced at again (:attr:`LongestRung.traced_length`; None: the answer is within
    :attr:`traced_lengths`). A peak over the length is the larger of moments that grow at different rates (a layer's
    recompute, the gradients kept), so the line through two short traces can miss the one that leads at length: 5.8%
    of the checkpointed body's peak for Llama-3.1-8B at 4.6 M tokens, 7x the activations' slope for the tiny Llama
    whose 128 positions allow traces at 64 and 128 tokens only."""

    @property
    def tokens_per_rank(self) -> int:
        """The answer's tokens on one rank (``seq_len / sp``)."""
        return self.seq_len // (self.config.sequence_parallel if self.config else 1)

    @property
    def position_note(self) -> str | None:
        """What is said of an answer past the config's ``max_position_embeddings``, in the words a ``--seq-len N``
        past it is planned with (:func:`autofit.workload.hf_positions.past_positions_note`); None within it."""
        limit = self.max_position_embeddings
        return past_positions_note(self.seq_len, "max_position_embeddings", limit) if limit and self.seq_len > limit \
            else None

    @property
    def past_int32(self) -> bool:
        """Whether a rank's hidden states at the answer pass 2^31 elements (memory allows it; int32 kernels do not)."""
        return self.int32_tokens is not None and self.tokens_per_rank > self.int32_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.name, "hardware": self.hardware, "world_size": self.world_size,
                "seq_len": self.seq_len, "config": self.config.to_dict() if self.config else None,
                "label": self.config.label() if self.config else None,
                "predicted": self.prediction.to_dict() if self.prediction else None,
                "ladder": [{"rung": r.name, "seq_len": r.seq_len,
                            "config": r.config.label() if r.config else None, "traced_length": r.traced_length}
                           for r in self.rungs],
                "traced_lengths": list(self.traced_lengths), "answer_traced_length": self.answer_traced_length,
                "max_position_embeddings": self.max_position_embeddings, "position_note": self.position_note,
                "int32_tokens_per_rank": self.int32_tokens, "past_int32": self.past_int32}

    def text(self) -> str:
        """What ``autofit estimate --seq-len max`` prints."""
        head = (f"{self.name} on {self.world_size} x {self.hardware}: the longest sequence that fits is "
                f"{self.seq_len:,} tokens")
        lines = [head]
        if self.config is not None and self.prediction is not None:
            lines.append(f"  with {self.config.label()}: {format_bytes(self.prediction.peak_bytes)} a device, "
                         f"{self.prediction.step_time_s:.3g} s a step")
        lines.append("  what each technique buys (cumulative; tensor parallelism in place of the others):")
        lines += [f"    {r.name:<28} {r.seq_len:>12,}  {r.config.label() if r.config else '-'}" for r in self.rungs]
        lines.append(f"  (traced at {self.traced_lengths[0]} and {self.traced_lengths[1]} tokens, extrapolated: "
                     "memory linear in the length, FLOPs a s + c s^2"
                     + (f"; each rung past them through {self.traced_lengths[1]} and a trace at its own length, "
                        f"the answer's {self.answer_traced_length:,})" if self.answer_traced_length else ")"))
        if self.position_note:
            lines.append(f"  note: {self.position_note}")
        if self.past_int32:
            lines.append(f"  note: {self.tokens_per_rank:,} tokens a rank make hidden states of more than 2^31 elements "
                         f"(past {self.int32_tokens:,}): kernels that index in int32 (Triton's, as Liger's RMSNorm and "
                         "loss; flash-attn 2) fail there with an illegal memory access; memory allows it, those "
                         "kernels do not")
        return "\n".join(lines)


def longest_sequence(target: Target) -> Longest:
    """The answer of ``--seq-len max`` for ``target`` (module docstring)."""
    if target.entry is None or not target.entry.startswith("hf:"):
        raise AutofitError("--seq-len max needs an hf: causal LM entry (the length is what it is asked about)")
    cap, table = _max_positions(target)
    s2 = min(TRACE_LENGTH, cap) if cap else TRACE_LENGTH
    s1 = s2 // 2
    fixed_micro = () if any(v.startswith("micro_batch_size=") for v in target.set_values) else ("micro_batch_size=1",)
    setups = [prepare(replace(target, seq_len=s, set_values=(*target.set_values, *fixed_micro))) for s in (s1, s2)]
    plans = [setup.plan() for setup in setups]
    plan = plans[1]
    if plan.facts.seq_len == 0:
        raise AutofitError(f"--seq-len max needs a causal LM; {plan.name} states no sequence")
    shape = getattr(setups[1].workload, "sequence", None)
    ceiling = cap if table else None
    values = (*target.set_values, *fixed_micro)
    traces: dict[tuple[int, tuple[str, ...]], ModelFacts] = {}
    rungs: list[LongestRung] = []
    for name, keys in RUNGS:  # a technique the rules refuse here keeps the rung before (no shorter multiple of sp)
        rung = _traced_at_its_length(target, values, plan, _rung(plan, plans[0].facts, name, keys, ceiling, shape),
                                     keys, ceiling, shape, traces)
        rungs.append(rung if not rungs or rung.seq_len >= rungs[-1].seq_len else replace(rungs[-1], name=name))
    rungs += _tensor_parallel_rung(target, (s1, s2), values, plan, shape, ceiling, traces)
    best = max(rungs, key=lambda r: r.seq_len)  # the first longest: SP's before TP's at a tie
    return Longest(name=plan.name, hardware=plan.hardware.name, world_size=plan.world_size, seq_len=best.seq_len,
                   config=best.config, prediction=best.prediction, rungs=tuple(rungs), traced_lengths=(s1, s2),
                   answer_traced_length=best.traced_length, max_position_embeddings=cap,
                   int32_tokens=INT32_ELEMENTS // plan.facts.hidden_size if plan.facts.hidden_size else None)


def _traced_at_its_length(target: Target, set_values: tuple[str, ...], plan: Plan, rung: LongestRung,
                          keys: tuple[str, ...], ceiling: int | None, shape: SequenceShape | None,
                          traces: dict[tuple[int, tuple[str, ...]], ModelFacts]) -> LongestRung:
    """``rung``, where it is past ``plan``'s trace, bisected again on the line through that trace and one of
    ``set_values`` at the rung's own length (:attr:`LongestRung.traced_length`), and again at its new length where
    that is longer, at most three times: the line through two short traces can be far off (a peak is the larger of
    moments that grow at different rates). ``traces``: the traces made so far, one a length and ``set_values``."""
    for _ in range(3):
        if rung.seq_len <= max(plan.facts.seq_len, rung.traced_length or 0):
            break
        length = rung.seq_len
        if (length, set_values) not in traces:
            workload = prepare(replace(target, seq_len=length, set_values=set_values)).planning_workload
            # the profiles any rung's configs are priced from (every lean config's), no others
            values = lean_space(plan, LONG_CONTEXT_KEYS).values
            lean = [c for c in plan.candidates if all(getattr(c, k) in v for k, v in values.items())]
            # the trace alone: what a CPU's kernels hold does not grow with the length, and measuring it runs steps
            traces[length, set_values] = replace(
                completed_facts(workload, lean or plan.candidates, plan.hardware.kind, None),
                kernel_footprint_bytes=plan.facts.kernel_footprint_bytes)
        rung = replace(_rung(replace(plan, facts=traces[length, set_values]), plan.facts, rung.name, keys, ceiling,
                             shape), traced_length=length)
    return rung


def _max_positions(target: Target) -> tuple[int | None, bool]:
    """The config's ``max_position_embeddings`` (None: none), and whether its positions are a table no longer
    sequence can run past (:func:`autofit.workload.hf_positions.positions_are_a_table`): the answer stops there,
    as ``--seq-len N`` past it is refused."""
    parsed = HfEntry.parse(target.entry or "")
    config = load_config(parsed.source, trust_remote_code=target.trust_remote_code)
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    return (limit, positions_are_a_table(config)) if isinstance(limit, int) and limit > 0 else (None, False)


def _tensor_parallel_rung(target: Target, lengths: tuple[int, int], set_values: tuple[str, ...], plan: Plan,
                          shape: SequenceShape | None, ceiling: int | None,
                          traces: dict[tuple[int, tuple[str, ...]], ModelFacts]) -> list[LongestRung]:
    """AutoTP over a node's ranks, in place of the long-context keys (AutoTP runs beside none of them:
    :mod:`autofit.core.parallel_rules`), where the model states a ``tp_plan``: the split model traced at both lengths
    (``--set tensor_parallel``) and at its longest (:func:`_traced_at_its_length`), its longest. None where it cannot
    apply; 0 where the rules refuse the degree."""
    degree = plan.hardware.ranks_on_a_node(plan.world_size)
    if shape is None or not shape.tp_styles or degree == 1 or "tensor_parallel" in plan.fixed:
        return []
    name = f"+ tensor parallelism (tp {degree})"
    values = (*set_values, f"tensor_parallel={degree}")
    try:
        short, long = (prepare(replace(target, seq_len=s, set_values=values)).plan() for s in lengths)
    except AutofitError:  # a rule refuses this model at that degree (a tied head, widths it does not divide)
        return [LongestRung(name=name, seq_len=0, config=None)]
    return [_traced_at_its_length(target, values, long, _rung(long, short.facts, name, (), ceiling, shape), (), ceiling,
                                  shape, traces)]


def _rung(plan: Plan, short: ModelFacts, name: str, keys: tuple[str, ...], ceiling: int | None,
          shape: SequenceShape | None = None) -> LongestRung:
    space = lean_space(plan, keys)
    unit = math.lcm(*space.values["sequence_parallel"])
    fits = _fitting(plan, short, space, ceiling, shape)
    n, found = _bisect(fits, unit)
    config, prediction = found if found is not None else (None, None)
    return LongestRung(name=name, seq_len=n * unit, config=config, prediction=prediction)


def _bisect(fits: Any, unit: int) -> tuple[int, Any]:
    """The most multiples ``n`` of ``unit`` for which ``fits(n * unit)`` gives something (not None), and what it
    gave there: doubling, then bisection."""
    lo, lo_config = 0, None
    hi = 1
    while hi * unit <= LONGEST_TRIED:
        config = fits(hi * unit)
        if config is None:
            break
        lo, lo_config, hi = hi, config, hi * 2
    else:
        return lo, lo_config
    while hi - lo > 1:
        mid = (lo + hi) // 2
        config = fits(mid * unit)
        if config is None:
            hi = mid
        else:
            lo, lo_config = mid, config
    return lo, lo_config


def _fitting(plan: Plan, short: ModelFacts, space: SearchSpace, ceiling: int | None,
             shape: SequenceShape | None = None) -> Any:
    """``fits(s)``: the fastest config of ``space`` and its prediction, where it is predicted to fit the usable budget
    (the margin's, as every command judges: :mod:`autofit.cost_model.budget`) at length ``s``; None where none does
    (also past ``ceiling``, a table of positions' last row). ``shape``: the workload's, for what AutoTP's rules read."""
    budget = usable_hardware(plan.hardware, plan.margin)

    def fits(seq_len: int) -> tuple[Config, Prediction] | None:
        if ceiling is not None and seq_len > ceiling:
            return None
        facts = facts_at_length(short, plan.facts, seq_len)
        sequence = _sequence_of(plan, seq_len)
        if shape is not None:
            sequence = replace(sequence, tp_styles=shape.tp_styles, intermediate_size=shape.intermediate_size,
                               vocab_size=shape.vocab_size, tied_head=shape.tied_head)
        try:
            configs = enumerate_candidates(space, hardware=plan.hardware, world_size=plan.world_size,
                                           global_batch=plan.global_batch, fixed={}, searches_attention=True,
                                           software=plan.software, sequence=sequence).candidates
        except AutofitError:
            return None
        return fastest_fitting(configs, facts, budget, plan)

    return fits


def fastest_fitting(configs: Sequence[Config], facts: ModelFacts, budget: Hardware, plan: Plan
                    ) -> tuple[Config, Prediction] | None:
    """The fastest of ``configs`` predicted to fit ``budget`` and its prediction, as if every one were priced exactly,
    with the caching allocator replayed for as few as can decide it. The time does not depend on the reserve, and a
    peak before the reserve is a lower bound (:func:`autofit.cost_model.predict`'s ``lower_bound_only``): the configs
    that fit by it are priced exactly fastest first, and the first that still fits is the answer. Each reserve key's
    replay is of its first config in ``configs`` (:func:`~autofit.cost_model.allocation_sequence.reserve_bytes`'
    representatives), whichever asks first, so the answer is the one pricing them all would give (on a CPU nothing is
    replayed)."""
    workspace = cublas_workspace_bytes(plan.hardware)
    representatives: dict[tuple[object, ...], Config] = {}
    for config in configs:
        representatives.setdefault(reserve_key(config, facts, plan.world_size, workspace), config)
    screened = [(c, predict(c, facts, budget, plan.world_size, plan.coefficients, lower_bound_only=True))
                for c in configs]
    for config, _ in sorted((cp for cp in screened if cp[1].fits), key=lambda cp: -cp[1].samples_per_s):
        exact = predict(config, facts, budget, plan.world_size, plan.coefficients,
                        reserve_representatives=representatives)
        if exact.fits:
            return config, exact
    return None


def _sequence_of(plan: Plan, seq_len: int) -> SequenceShape:
    facts = plan.facts
    heads = _heads(plan)
    return SequenceShape(seq_len=seq_len, n_heads=heads, n_kv_heads=facts.n_kv_heads or heads,
                         hidden_size=facts.hidden_size)


def _heads(plan: Plan) -> int:
    """Query heads: ``hidden / head_dim`` with the kv width's head dim."""
    facts = plan.facts
    head_dim = facts.kv_width // facts.n_kv_heads if facts.n_kv_heads else 0
    return facts.hidden_size // head_dim if head_dim else 1


def lean_space(plan: Plan, keys: tuple[str, ...]) -> SearchSpace:
    """The plan's space with what only trades memory for time at its leanest (module docstring), the long-context
    keys outside ``keys`` off; ``--set`` values kept."""
    values = dict(plan.space.values)
    lean = {"checkpoint_ratio": (max(values["checkpoint_ratio"]),), "checkpoint_granularity": ("block",),
            "compile": ("off",), "overlap_comm": (False,), "bucket_scale": (1,),
            "attention": tuple(a for a in values["attention"] if a != "eager") or values["attention"]}
    off = {f.name: (f.default,) for f in dataclasses.fields(Config) if f.name in LONG_CONTEXT_KEYS and f.name not in keys}
    values.update(lean | off)
    values.update({k: (v,) for k, v in plan.fixed.items() if k in values})
    return replace(plan.space, values=values)


def facts_at_length(short: ModelFacts, long: ModelFacts, seq_len: int) -> ModelFacts:
    """``long``'s facts carried to ``seq_len`` through the two traces (module docstring): each traced point's memory
    on the line through them, its FLOPs and bytes on ``a s + c s^2``."""
    s1, s2 = short.seq_len, long.seq_len
    profiles = {}
    for key, profile in long.profiles.items():
        other = short.profiles.get(key)
        if other is None or len(other.points) != len(profile.points):
            continue
        points = tuple(_point_at(p1, p2, s1, s2, seq_len) for p1, p2 in zip(other.points, profile.points, strict=True))
        profiles[key] = replace(profile, points=points)
    tokens = seq_len if long.tokens_per_sample else None
    ranks = {degree: facts_at_length(short.tensor_parallel_ranks[degree], rank, seq_len)
             for degree, rank in long.tensor_parallel_ranks.items() if degree in short.tensor_parallel_ranks}
    return replace(long, profiles=profiles, seq_len=seq_len, tokens_per_sample=tokens, tensor_parallel_ranks=ranks)


def _point_at(p1: PeakPoint, p2: PeakPoint, s1: int, s2: int, s: int) -> PeakPoint:
    changes: dict[str, int] = {}
    for attr in LINEAR_ATTRS:
        y1, y2 = getattr(p1, attr), getattr(p2, attr)
        changes[attr] = max(0, int(y1 + (y2 - y1) * (s - s1) / (s2 - s1)))
    # the peak with every gradient kept is the larger of two moments (the activations' and, once backward is done, all
    # the gradients'); at short traces the gradients' may set both points, whose line then misses the activations'
    for part in ("", "head_", "body_"):
        with_grads, without = f"{part}peak_with_grads_bytes", f"{part}peak_without_grads_bytes"
        changes[with_grads] = max(changes[with_grads], changes[without])
    for attr in QUADRATIC_ATTRS:
        y1, y2 = getattr(p1, attr), getattr(p2, attr)
        c = (y2 / s2 - y1 / s1) / (s2 - s1)
        a = y1 / s1 - c * s1
        changes[attr] = max(0, int(a * s + c * s * s))
    return replace(p2, **changes)

