"""Search spaces: a YAML file -> a validated :class:`SearchSpace` -> runnable candidates.

A space lists, for every config key, the values worth trying. Enumeration takes the Cartesian product, replaces a
dimension by the value fixed with ``--set``, derives the gradient accumulation from the global batch and prunes what
cannot run with a few small, pure rules (:data:`autofit.core.rules.RULES`). Pruned combinations are reported once per
rule and partial assignment (``{"precision": "fp8"}: "cpu has no fp8"``), not once per config. No torch here.

A space file looks like::

    description: one line saying what the space is for
    global_batch_size: 64          # optional; --global-batch overrides it
    micro_batch_size: [1, 2, 4]
    precision: [bf16]              # a scalar is read as a one-value list
    ...

A config key the file leaves out takes the :class:`~autofit.core.config.Config` default
as its only value. ``grad_accum_steps`` is derived from the global batch; a list of
it is used only where no global batch is known at all.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from autofit.core.config import CONFIG_KEYS, LONG_CONTEXT_KEYS, Config, coerce_value
from autofit.core.errors import AutofitError
from autofit.core.hardware import Hardware
from autofit.core.parallel_rules import HPZ_ON_ONE_NODE, NO_TP_PLAN
from autofit.core.rules import RULES, Context
from autofit.core.sequence import SequenceShape
from autofit.core.software import Software

#: the keys a space lists values for; grad_accum_steps is derived from the global batch
SPACE_KEYS: tuple[str, ...] = tuple(key for key in CONFIG_KEYS if key != "grad_accum_steps")
#: keys of a space file that are not config dimensions
_META_KEYS = ("description", "global_batch_size", "grad_accum_steps")
#: where attention collapses to when the workload's model does not take an ``attention`` keyword
DEFAULT_ATTENTION = "sdpa"
#: the most candidates that can run a space may enumerate (with ``--set`` applied): Llama-3.1-8B at 65,536 tokens on
#: 8 H100 in the default space, every long-context key searched, has 52,632; each is priced, so a space much larger
#: would not plan in minutes
MAX_CANDIDATES = 250_000
#: the most points a space's dimensions may multiply to before the rules prune them (walking more would hang)
MAX_PRODUCT = 10**8


def search_space_dirs() -> tuple[Path, ...]:
    """Where a bare space name is looked up, in order.

    ``autofit/search_spaces``: in a checkout a link to the repo's ``search_spaces/``, in a wheel the
    copy shipped as package data. Then ``search_spaces/`` next to the package, for a checkout whose
    git did not make the link (``core.symlinks`` off).
    """
    package = Path(__file__).resolve().parents[1]  # autofit/, above autofit/core/
    return (package / "search_spaces", package.parent / "search_spaces")


@dataclass(frozen=True)
class SearchSpace:
    """The values worth trying for each config key."""

    name: str
    """Short name: the file's stem (``default``, ``single_gpu``)."""
    description: str
    """One line saying what the space is for."""
    values: dict[str, tuple[Any, ...]]
    """Config key -> the allowed values, in trial order, for every key of :data:`SPACE_KEYS`."""
    global_batch_size: int | None = None
    """Samples per optimizer step when ``--global-batch`` is not given; None: no default."""
    grad_accum_steps: tuple[int, ...] = (1,)
    """Accumulation values to try, only where no global batch is known at all."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise AutofitError(f"name must be a non-empty string, but got {self.name!r}")
        if not isinstance(self.description, str):
            raise AutofitError(f"description must be a string, but got {self.description!r}")
        if not isinstance(self.values, dict):
            raise AutofitError(f"values must be a mapping of config key to values, but got {self.values!r}")
        unknown = [key for key in self.values if key not in SPACE_KEYS]
        if unknown:
            raise AutofitError(f"unknown search-space key {unknown[0]!r}; known keys: {', '.join(SPACE_KEYS)}")
        missing = [key for key in SPACE_KEYS if key not in self.values]
        if missing:
            raise AutofitError(f"values has no list for {missing[0]!r}; every key of {', '.join(SPACE_KEYS)} needs one")
        # normalise in place: ordered like CONFIG_KEYS, coerced, deduplicated tuples
        values = {key: _validated_values(key, self.values[key]) for key in SPACE_KEYS}
        object.__setattr__(self, "values", values)
        gbs = self.global_batch_size
        if gbs is not None and (isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1):
            raise AutofitError(f"global_batch_size must be an integer >= 1 or null, but got {gbs!r}")
        accum = _validated_values("grad_accum_steps", self.grad_accum_steps)
        object.__setattr__(self, "grad_accum_steps", accum)
        if gbs is not None and accum != (1,):
            raise AutofitError(
                f"grad_accum_steps is derived from global_batch_size={gbs}, but got grad_accum_steps={list(accum)!r}; "
                "give one or the other"
            )

    def size(self) -> int:
        """How many configs the space holds before any rule: the product of its list lengths."""
        n_accum = len(self.grad_accum_steps) if self.global_batch_size is None else 1
        return math.prod(len(v) for v in self.values.values()) * n_accum

    def to_dict(self) -> dict[str, Any]:
        """The space as its YAML would write it."""
        out: dict[str, Any] = {"description": self.description, "global_batch_size": self.global_batch_size}
        if self.global_batch_size is None:
            out["grad_accum_steps"] = list(self.grad_accum_steps)
        return out | {key: list(v) for key, v in self.values.items()}


def _validated_values(key: str, raw: Any) -> tuple[Any, ...]:
    """A YAML list (or a scalar) -> a tuple of coerced values, each valid for ``key``."""
    if isinstance(raw, (list, tuple)):
        items = list(raw)
    elif isinstance(raw, (str, int, float)):
        items = [raw]
    else:
        raise AutofitError(f"{key} must be a list of values, but got {raw!r}")
    if not items:
        raise AutofitError(f"{key} must list at least one value, but got {raw!r}")
    out = []
    for item in items:
        if isinstance(item, (list, tuple, dict)) or item is None:
            raise AutofitError(f"{key} values must be scalars, but got {item!r}")
        value = coerce_value(key, item)
        Config.from_dict({key: value})  # the field's own check, with its message
        out.append(value)
    return tuple(dict.fromkeys(out))


def resolve_space_path(spec: str | Path | None) -> Path:
    """``None`` -> the default space; a bare name -> ``search_spaces/<name>.yaml``; else a path."""
    if spec is None:
        spec = "default"
    text = str(spec)
    looks_like_path = isinstance(spec, Path) or "/" in text or "\\" in text or text.endswith((".yaml", ".yml"))
    if looks_like_path:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise AutofitError(f"search space file {str(path)!r} does not exist")
        return path
    for folder in search_space_dirs():
        for suffix in (".yaml", ".yml"):
            path = folder / f"{text}{suffix}"
            if path.is_file():
                return path
    raise AutofitError(f"unknown search space {text!r}; shipped spaces: {', '.join(shipped_spaces()) or 'none found'}")


def shipped_spaces() -> tuple[str, ...]:
    """Names of the spaces found in :func:`search_space_dirs`, sorted."""
    names = {p.stem for folder in search_space_dirs() if folder.is_dir() for p in folder.glob("*.y*ml")}
    return tuple(sorted(names))


def load_space(spec: str | Path | None) -> SearchSpace:
    """Read and validate a search-space YAML; any error is one line naming the file, the field and the value."""
    path = resolve_space_path(spec)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise AutofitError(f"{path}: cannot read search space: {error}") from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise AutofitError(f"{path}: not valid YAML{line}: {problem}") from None
    if not isinstance(data, dict):
        raise AutofitError(f"{path}: a search space is a mapping of key: [values], but got {data!r}")
    try:
        return space_from_dict(data, name=path.stem)
    except AutofitError as error:
        raise AutofitError(f"{path}: {error}") from None


def space_from_dict(data: dict[str, Any], *, name: str) -> SearchSpace:
    """A parsed space file -> :class:`SearchSpace`; keys it leaves out take the Config default."""
    unknown = [key for key in data if key not in SPACE_KEYS and key not in _META_KEYS]
    if unknown:
        known = ", ".join((*_META_KEYS, *SPACE_KEYS))
        raise AutofitError(f"unknown search-space key {unknown[0]!r}; known keys: {known}")
    defaults = {f.name: f.default for f in fields(Config)}
    values = {key: data.get(key, [defaults[key]]) for key in SPACE_KEYS}
    description = data.get("description", "")
    return SearchSpace(
        name=name,
        description=description.strip() if isinstance(description, str) else description,
        values=values,
        global_batch_size=data.get("global_batch_size"),
        grad_accum_steps=data.get("grad_accum_steps", (1,)),
    )


# ---------------------------------------------------------------------------------------------
# enumeration


@dataclass(frozen=True)
class Enumeration:
    """The runnable candidates of a space, and what the rules took out."""

    candidates: list[Config]
    """Runnable configs, deduplicated, in the space's order (keys as CONFIG_KEYS, values as listed)."""
    rejected: list[tuple[dict[str, Any], str]]
    """(partial config, reason): one entry per rule and partial assignment it pruned."""


def enumerate_candidates(
    space: SearchSpace,
    *,
    hardware: Hardware,
    world_size: int,
    global_batch: int | None,
    fixed: dict[str, Any],
    searches_attention: bool,
    software: Software,
    checkpoints_attention: bool = True,
    sequence: SequenceShape | None = None,
    attention_kernels: tuple[str, ...] | None = None,
) -> Enumeration:
    """The candidates of ``space`` that can run on ``world_size`` ranks of ``hardware``.

    ``fixed`` (from :func:`autofit.core.config.parse_set`) replaces a key's list by its value.
    ``global_batch`` (``--global-batch``; else the space's ``global_batch_size``, unless
    ``grad_accum_steps`` is fixed) sets ``grad_accum_steps = global / (micro x world)``.
    ``software`` is what the machine that runs the candidates has (this one's: :func:`~autofit.machine.software.detect_software`).
    ``checkpoints_attention``: the workload's layers have attention sub-modules
    (:meth:`autofit.workload.types.Workload.checkpoints_attention`); without, ``checkpoint_granularity`` is ``block``.
    ``sequence``: the workload's sequence and heads (an ``hf:`` causal LM's); without, the long-context keys are off.
    ``attention_kernels``: those the model can be built with; the space's are narrowed to them (or their first).
    A fixed value that cannot run raises :class:`AutofitError`, as does a space whose every config is pruned.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise AutofitError(f"world_size must be an integer >= 1, but got {world_size!r}")
    if global_batch is not None and (
        isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1
    ):
        raise AutofitError(f"global batch must be an integer >= 1, but got {global_batch!r}")
    fixed = {key: coerce_value(key, value) for key, value in fixed.items()}
    Config.from_dict(fixed)  # each fixed value is a valid value of its key

    # --global-batch wins; the space's default gives way to an explicitly fixed accumulation
    if global_batch is None and "grad_accum_steps" not in fixed:
        global_batch = space.global_batch_size
    ctx = Context(hardware=hardware, world_size=world_size, global_batch=global_batch,
                  software=software, sequence=sequence)

    dims = dimensions(space, fixed, ctx, searches_attention=searches_attention, checkpoints_attention=checkpoints_attention,
                      attention_kernels=attention_kernels)
    check_fixed(fixed, dims, ctx)
    bad, rejected = pruned_assignments(dims, ctx)
    check_size(space, dims, bad)
    check_runnable(space, dims, bad)

    candidates: dict[Config, None] = {}
    for point in surviving_points(dims, bad):
        accum = accumulation(point, ctx, fixed)
        if "grad_accum_steps" in fixed and accum != fixed["grad_accum_steps"]:
            continue  # another sequence-parallel degree's micro-batch (micro_batches_for_accumulation)
        candidates.setdefault(Config(**point, grad_accum_steps=accum), None)
    candidates_list = _expand_accumulation(list(candidates), space, ctx, fixed)
    if not candidates_list:
        reasons = "; ".join(f"{_format_partial(p)}: {r}" for p, r in rejected[:4])
        raise AutofitError(f"no config of search space {space.name!r} can run here: {reasons}")
    return Enumeration(candidates=candidates_list, rejected=rejected)


def check_size(space: SearchSpace, dims: dict[str, tuple[Any, ...]], bad: dict[str, set[tuple[Any, ...]]]) -> None:
    """An :class:`AutofitError` before enumerating where the dimensions (``--set`` applied, less the values a rule of
    that key alone refuses: never walked) multiply to more than :data:`MAX_PRODUCT`: walking them would hang. (What is
    searched, :data:`MAX_CANDIDATES`, is bounded on the candidates that can run: :func:`count_surviving`.)"""
    refused = {(rule.keys[0], combo[0]) for rule in RULES if len(rule.keys) == 1 for combo in bad.get(rule.name, ())}
    size = math.prod(max(1, sum((key, v) not in refused for v in values)) for key, values in dims.items())
    if size > MAX_PRODUCT:
        raise AutofitError(f"search space {space.name!r} has {size:.3g} candidates (more than {MAX_PRODUCT:.0e}): "
                           "fix dimensions with --set or shorten its lists")


def check_runnable(space: SearchSpace, dims: dict[str, tuple[Any, ...]], bad: dict[str, set[tuple[Any, ...]]]) -> None:
    """An :class:`AutofitError` before enumerating where more than :data:`MAX_CANDIDATES` candidates can run: each
    is priced, so the refusal comes in seconds instead of after the work (:func:`count_surviving`)."""
    n_runnable = count_surviving(dims, bad)
    if n_runnable > MAX_CANDIDATES:
        raise AutofitError(f"search space {space.name!r} has {n_runnable:,} candidates that can run here (more than "
                           f"{MAX_CANDIDATES:,}): fix dimensions with --set or shorten its lists")


def surviving_points(dims: dict[str, tuple[Any, ...]], bad: dict[str, set[tuple[Any, ...]]]) -> list[dict[str, Any]]:
    """The points of ``dims``' product that no rule refuses, in the product's order: each rule is checked once its
    last key is assigned, so a refused partial prunes its subtree. A plain recursion fills one list (generators pass
    each point up through every key's frame). ``checks``: each level's (refused tuples, their keys' positions)."""
    keys, values = list(dims), [None] * len(dims)
    position = {key: i for i, key in enumerate(keys)}
    checks: list[list[tuple[set[tuple[Any, ...]], tuple[int, ...]]]] = [[] for _ in keys]
    for rule in RULES:
        if bad[rule.name]:
            checks[max(position[k] for k in rule.keys)].append((bad[rule.name], tuple(position[k] for k in rule.keys)))
    points: list[dict[str, Any]] = []

    def walk(i: int) -> None:
        if i == len(keys):
            points.append(dict(zip(keys, values, strict=True)))
            return
        for value in dims[keys[i]]:
            values[i] = value
            if not any(tuple(values[j] for j in where) in refused for refused, where in checks[i]):
                walk(i + 1)

    walk(0)
    return points


def count_surviving(dims: dict[str, tuple[Any, ...]], bad: dict[str, set[tuple[Any, ...]]]) -> int:
    """How many points :func:`surviving_points` yields, counted without walking them (10^4 micro-batches x 10^4
    checkpoint ratios are counted in a fraction of a second, walked in minutes). Each rule's refused tuples, keys in
    walk order, are narrowed as its keys are assigned; two prefixes that leave every rule the same remainder have
    the same number of completions, so the count is memoized on those remainders, not on the values themselves."""
    keys = list(dims)
    position = {key: i for i, key in enumerate(keys)}
    orders = [(rule, sorted(rule.keys, key=position.__getitem__)) for rule in RULES if bad[rule.name]]
    start = tuple(frozenset(tuple(combo[rule.keys.index(k)] for k in order) for combo in bad[rule.name])
                  for rule, order in orders)
    reading = [[j for j, (_, order) in enumerate(orders) if key in order] for key in keys]
    split: dict[frozenset[tuple[Any, ...]], dict[Any, frozenset[tuple[Any, ...]]]] = {}
    memo: dict[tuple[int, tuple[frozenset[tuple[Any, ...]], ...]], int] = {}

    def by_first(remainder: frozenset[tuple[Any, ...]]) -> dict[Any, frozenset[tuple[Any, ...]]]:
        if remainder not in split:
            groups: dict[Any, set[tuple[Any, ...]]] = {}
            for combo in remainder:
                groups.setdefault(combo[0], set()).add(combo[1:])
            split[remainder] = {value: frozenset(rest) for value, rest in groups.items()}
        return split[remainder]

    def count(i: int, state: tuple[frozenset[tuple[Any, ...]], ...]) -> int:
        if i == len(keys):
            return 1
        if (i, state) not in memo:
            total = 0
            for value in dims[keys[i]]:
                after = list(state)
                for j in reading[i]:
                    after[j] = by_first(state[j]).get(value, frozenset())
                if not any(() in after[j] for j in reading[i]):  # a rule refuses the tuple just completed
                    total += count(i + 1, tuple(after))
            memo[(i, state)] = total
        return memo[(i, state)]

    return count(0, start)


def dimensions(
    space: SearchSpace, fixed: dict[str, Any], ctx: Context, *, searches_attention: bool, checkpoints_attention: bool = True,
    attention_kernels: tuple[str, ...] | None = None,
) -> dict[str, tuple[Any, ...]]:
    """Each key's values after ``--set``, the attention and granularity collapses and a fixed accumulation."""
    dims = {key: (fixed[key],) if key in fixed else space.values[key] for key in SPACE_KEYS}
    if not checkpoints_attention:
        if fixed.get("checkpoint_granularity") == "attention":
            raise AutofitError("--set checkpoint_granularity=attention cannot run: the workload's repeated layers have "
                               "no attention sub-module (name it with Workload(attention_modules=...))")
        dims["checkpoint_granularity"] = ("block",)
    if not searches_attention:
        if "attention" in fixed and fixed["attention"] != DEFAULT_ATTENTION:
            raise AutofitError(
                f"--set attention={fixed['attention']} cannot run: the workload's model takes no attention keyword"
            )
        dims["attention"] = (DEFAULT_ATTENTION,)
    elif attention_kernels:  # the kernels the model can be built with (an hf: model's transformers class flags)
        if "attention" in fixed and fixed["attention"] not in attention_kernels:
            raise AutofitError(f"--set attention={fixed['attention']} cannot run: the model can be built with "
                               f"{', '.join(attention_kernels)} only")
        dims["attention"] = tuple(k for k in dims["attention"] if k in attention_kernels) or attention_kernels[:1]
    if ctx.sequence is None or not ctx.sequence.causal_lm:
        dims.update(_long_context_off(fixed))
    if ctx.sequence is None or not ctx.sequence.tp_styles:
        dims.update(_off(fixed, "tensor_parallel", NO_TP_PLAN))
    if ctx.hardware.n_nodes(ctx.world_size) == 1:
        dims.update(_off(fixed, "hpz_partition_size", HPZ_ON_ONE_NODE))
    if "grad_accum_steps" in fixed and ctx.global_batch is not None:
        dims["micro_batch_size"] = micro_batches_for_accumulation(fixed, ctx.global_batch, ctx.world_size, tuple(sorted(
            {tp * sp for tp in dims["tensor_parallel"] for sp in dims["sequence_parallel"]})))
    return dims


def _off(fixed: dict[str, Any], key: str, why: str) -> dict[str, tuple[Any, ...]]:
    """``key`` at 1 where nothing else runs (TP without a ``tp_plan``, hpZ on one node); a ``--set`` value: ``why``."""
    if fixed.get(key, 1) != 1:
        raise AutofitError(f"--set {key}={fixed[key]} cannot run: {why}")
    return {key: (1,)}


def _long_context_off(fixed: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    """The long-context keys at their defaults (off), for a workload that states no causal-LM sequence; a ``--set``
    of one of them on is one error line."""
    defaults = {f.name: f.default for f in fields(Config) if f.name in LONG_CONTEXT_KEYS}
    for key, off in defaults.items():
        if key in fixed and fixed[key] != off:
            raise AutofitError(f"--set {key}={fixed[key]} cannot run: it needs an hf: causal LM with a sequence "
                               "length (the workload states none)")
    return {key: (off,) for key, off in defaults.items()}


def micro_batches_for_accumulation(fixed: dict[str, Any], global_batch: int, world_size: int,
                                   model_parallel: tuple[int, ...]) -> tuple[int, ...]:
    """The micro-batch a fixed accumulation and global batch allow for each model-parallel degree (``tp x sp``) that
    divides the world (data-parallel size ``world / (tp x sp)``); one error line where none does."""
    degrees = [sp for sp in model_parallel if world_size % sp == 0] or [1]
    micros: list[int] = []
    errors: list[AutofitError] = []
    for sp in degrees:
        try:
            micros.append(micro_batch_for_accumulation(fixed, global_batch, world_size // sp))
        except AutofitError as error:
            errors.append(error)
    if not micros:
        raise errors[0]
    return tuple(dict.fromkeys(micros))


def micro_batch_for_accumulation(fixed: dict[str, Any], global_batch: int, world_size: int) -> int:
    """``global / (accum x world)``: the one micro-batch a fixed accumulation and global batch allow (``world_size``:
    the data-parallel ranks)."""
    accum = fixed["grad_accum_steps"]
    per_micro = accum * world_size
    if global_batch % per_micro:
        raise AutofitError(
            f"--set grad_accum_steps={accum} x world size {world_size} does not divide the global batch {global_batch}"
        )
    micro = global_batch // per_micro
    if "micro_batch_size" in fixed and fixed["micro_batch_size"] != micro:
        raise AutofitError(
            f"--set micro_batch_size={fixed['micro_batch_size']} x grad_accum_steps={accum} x world size "
            f"{world_size} is {fixed['micro_batch_size'] * per_micro}, not the global batch {global_batch}"
        )
    return micro


def accumulation(point: dict[str, Any], ctx: Context, fixed: dict[str, Any]) -> int:
    """``grad_accum_steps`` of one point: ``global / (micro x world / (tp x sp))``, else the fixed value, else 1."""
    if ctx.global_batch is not None:
        data_parallel = max(1, ctx.world_size // (point.get("tensor_parallel", 1) * point.get("sequence_parallel", 1)))
        return ctx.global_batch // (point["micro_batch_size"] * data_parallel)
    return int(fixed.get("grad_accum_steps", 1))


def _expand_accumulation(
    configs: list[Config], space: SearchSpace, ctx: Context, fixed: dict[str, Any]
) -> list[Config]:
    """With no global batch and no fixed accumulation, try each of the space's accumulation values."""
    if ctx.global_batch is not None or "grad_accum_steps" in fixed:
        return configs
    return [c.with_(grad_accum_steps=a) for c in configs for a in space.grad_accum_steps]


def pruned_assignments(
    dims: dict[str, tuple[Any, ...]], ctx: Context
) -> tuple[dict[str, set[tuple[Any, ...]]], list[tuple[dict[str, Any], str]]]:
    """For each rule, the value tuples of its keys it refuses, and one (partial, reason) per refusal."""
    bad: dict[str, set[tuple[Any, ...]]] = {}
    rejected: list[tuple[dict[str, Any], str]] = []
    for rule in RULES:
        bad[rule.name] = set()
        for combo in itertools.product(*(dims[k] for k in rule.keys)):
            reason = rule.check(ctx, *combo)
            if reason is not None:
                bad[rule.name].add(combo)
                rejected.append((dict(zip(rule.keys, combo, strict=True)), reason))
    return bad, rejected


def check_fixed(fixed: dict[str, Any], dims: dict[str, tuple[Any, ...]], ctx: Context) -> None:
    """Raise where a rule refuses values that ``--set`` alone decided (every key it reads has one value)."""
    for rule in RULES:
        if not any(k in fixed for k in rule.keys) or any(len(dims[k]) != 1 for k in rule.keys):
            continue
        reason = rule.check(ctx, *(dims[k][0] for k in rule.keys))
        if reason is not None:
            set_part = _format_partial({k: dims[k][0] for k in rule.keys if k in fixed})
            rest = {k: dims[k][0] for k in rule.keys if k not in fixed}
            with_part = f" with {_format_partial(rest)}" if rest else ""
            raise AutofitError(f"--set {set_part} cannot run{with_part}: {reason}")


def _format_partial(partial: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in partial.items())


def describe_rejections(rejected: Iterable[tuple[dict[str, Any], str]]) -> list[str]:
    """One human-readable line per rejection: ``precision=fp8: cpu has no fp8 support``."""
    return [f"{_format_partial(partial)}: {reason}" for partial, reason in rejected]
