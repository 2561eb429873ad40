"""Planning from an entry point's sources: a warm plan that neither imports the entry (torch, transformers) nor
builds its model.

The trace cache (:mod:`autofit.trace.cache`) keys a trace by the model built on the meta device, so even a warm
plan imports the entry and builds the model (LLaMA-2-70B: ~4 s of imports before the cached trace is read). What a
plan needs from a workload (:meth:`autofit.planning.plan.Plan.make`, :func:`autofit.planning.plan.trace_for`) is small: its
``name``, ``tokens_per_sample``, ``searches_attention``, the ``checkpoints_attention()`` answer and the traced
:class:`~autofit.cost_model.facts.ModelFacts`. Those are kept here under a *source key* made without importing
anything of the user's:

- the entry string (an ``hf:`` entry's ``--seq-len``/``--task``/``--trust-remote-code`` travel inside it);
- the bytes of the entry's file and of every local module it imports, directly or not
  (:func:`autofit.workload.sources.local_sources`, the queue's key), or an ``hf:`` folder's ``config.json``
  and Python files;
- the software (:func:`autofit.trace.cache.software_versions`: Python, torch, transformers, deepspeed, flash-attn,
  adam-mini and autofit, read with ``importlib.metadata``, and the hash of autofit's traced sources) and a hash of
  the autofit files that turn an entry into a workload (:data:`PLANNING_SOURCES`);
- for the facts, the trace request (precisions, attention kernels, checkpoint ratios and granularities,
  optimizers, micro-batches).

What the key cannot see: environment variables and files the entry reads when it runs, a Hub model's config
(an ``hf:ORG/NAME`` has no local file: it is never planned from here), installed packages other than those named.
``--no-cache`` (``AUTOFIT_NO_CACHE``) turns it off with the trace cache. Records sit beside the trace entries
(``source-<key>.json``), read and written as the trace entries are (:func:`autofit.trace.cache.read_entry`,
:func:`autofit.trace.cache.write_entry`: written whole and renamed); one that cannot be read is ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeGuard

from autofit.core.sequence import SequenceShape
from autofit.trace import cache, trace_workload
from autofit.trace.parallel import trace_workers_setting
from autofit.workload.entry import is_loadable
from autofit.workload.hf import entry_lengths, is_hf_entry
from autofit.workload.hf_positions import TextLengths
from autofit.workload.preflight import load_workload_in_time
from autofit.workload.sources import entry_source, import_root, local_sources

if TYPE_CHECKING:
    from autofit.cost_model.facts import ModelFacts
    from autofit.workload.types import Workload

#: autofit files (besides :data:`autofit.trace.cache.TRACED_SOURCES`) whose code turns an entry into what is kept
PLANNING_SOURCES = ("workload/hf.py", "workload/hf_tasks.py", "workload/hf_positions.py", "workload/sources.py",
                    "trace/source_cache.py")
#: what is kept of the workload itself
WORKLOAD_FIELDS = ("name", "tokens_per_sample", "searches_attention", "sequence", "kernels", "kernel_note")


def source_key(entry: str) -> str | None:
    """The key of ``entry``'s sources and software, or None: the cache off, an in-process workload, or an entry
    with no local source file (a Hub name, a module not found)."""

    if cache.cache_dir() is None or not is_loadable(entry):
        return None
    try:
        source = entry_source(entry)
        if source is None:
            return None
        code = local_sources(source, *import_root(entry, source))
        if entry.startswith("hf:"):  # a folder's own model code (--trust-remote-code) beside its config.json
            code |= {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(source.parent.glob("*.py"))}
    except (OSError, ValueError, ImportError):
        return None
    parts = {"format": cache.FORMAT, "entry": entry, "code": code, "software": cache.software_versions(),
             "planning": _planning_sources_digest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _planning_sources_digest() -> str:
    return cache.sources_digest(PLANNING_SOURCES)


def _request_key(key: str, request: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps([key, cache.plain_request(request)], sort_keys=True).encode()).hexdigest()


def _well_formed(answers: Any) -> TypeGuard[dict[str, Any]]:
    """Whether a record's ``workload`` has every field, each of its type (another layout, or an edited file, is
    not)."""
    return (isinstance(answers, dict) and set(WORKLOAD_FIELDS) <= set(answers)
            and isinstance(answers["name"], (str, type(None)))
            and (answers["tokens_per_sample"] is None or type(answers["tokens_per_sample"]) is int)
            and isinstance(answers["searches_attention"], bool)
            and isinstance(answers["sequence"], (dict, type(None)))
            and (answers["kernels"] is None or isinstance(answers["kernels"], list)
                 and all(isinstance(k, str) for k in answers["kernels"]))
            and isinstance(answers["kernel_note"], (str, type(None)))
            and isinstance(answers.get("checkpoints_attention", False), bool))


class SourcePlannedWorkload:
    """An entry's workload as a plan sees it: answered from the record under its source key where there is one;
    the real workload (:attr:`workload`) is loaded on the first question the record cannot answer, and the
    answers are recorded when the plan's trace is (:meth:`facts`)."""

    def __init__(self, entry: str, key: str) -> None:
        self.entry = entry
        self.key = key
        record = cache.read_entry(f"source-{key}")
        answers = record.get("workload") if record is not None else None
        self._answers: dict[str, Any] = dict(answers) if _well_formed(answers) else {}
        self._loaded: Workload | None = None

    @property
    def recorded(self) -> bool:
        """Whether the record under the source key answers for the workload."""
        return all(k in self._answers for k in WORKLOAD_FIELDS)

    @property
    def workload(self) -> Workload:
        """The real workload, loaded once (:func:`autofit.workload.preflight.load_workload_in_time`)."""
        if self._loaded is None:

            self._loaded = load_workload_in_time(self.entry)
        return self._loaded

    def _answer(self, name: str) -> Any:
        if name not in self._answers:
            value = getattr(self.workload, name)
            if name == "sequence":
                value = value.to_dict() if value is not None else None
            self._answers[name] = value() if name == "checkpoints_attention" else value
        return self._answers[name]

    @property
    def name(self) -> str | None:
        return self._answer("name")

    @property
    def tokens_per_sample(self) -> int | None:
        return self._answer("tokens_per_sample")

    @property
    def searches_attention(self) -> bool:
        return self._answer("searches_attention")

    @property
    def sequence(self) -> SequenceShape | None:
        """:attr:`autofit.workload.types.Workload.sequence`, recorded."""
        answer = self._answer("sequence")
        return SequenceShape.from_dict(answer) if answer is not None else None

    @property
    def kernels(self) -> tuple[str, ...] | None:
        """:attr:`autofit.workload.types.Workload.kernels`, recorded."""
        kernels = self._answer("kernels")
        return None if kernels is None else tuple(kernels)

    @property
    def kernel_note(self) -> str | None:
        """:attr:`autofit.workload.types.Workload.kernel_note`, recorded."""
        return self._answer("kernel_note")

    def checkpoints_attention(self) -> bool:
        """:meth:`autofit.workload.types.Workload.checkpoints_attention`, recorded."""
        return bool(self._answer("checkpoints_attention"))

    def facts(self, request: dict[str, Any]) -> ModelFacts:
        """The trace for ``request`` (:func:`autofit.trace.trace_workload`'s arguments): the one recorded, else
        the real workload's (the trace cache's, or traced), then recorded with the workload's answers."""

        trace_workers_setting()  # a bad setting is an error on a recorded plan too, as on one that traces
        started = time.perf_counter()
        name = f"source-{_request_key(self.key, request)}"
        record = cache.read_entry(name)
        recorded = cache.facts_of(record) if record is not None and self.recorded else None
        if recorded is not None:
            return replace(recorded, trace_seconds=time.perf_counter() - started)
        facts = trace_workload(self.workload, **request)
        for field in WORKLOAD_FIELDS:
            self._answer(field)
        cache.write_entry(f"source-{self.key}", {"workload": self._answers})
        cache.write_entry(name, {"facts": facts.to_dict()})
        return facts


def recorded_entry_lengths(entry: str) -> TextLengths | None:
    """:func:`autofit.workload.hf.entry_lengths`, kept under the entry's source key (its ``config.json``, the software,
    the code that reads them): a plan the trace cache answers says what the first one said without importing
    transformers to read the config again. Another entry, a Hub name or the cache off: read as ever."""

    key = source_key(entry) if is_hf_entry(entry) else None
    if key is None:
        return entry_lengths(entry)
    name = f"lengths-{key}"
    record = cache.read_entry(name)
    kept = record.get("lengths", False) if record is not None else False
    if kept is None:
        return None
    if isinstance(kept, dict):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return _text_lengths(kept)
    lengths = entry_lengths(entry)
    cache.write_entry(name, {"lengths": None if lengths is None else dataclasses.asdict(lengths)})
    return lengths


def _text_lengths(kept: dict[str, Any]) -> TextLengths:
    """The :class:`TextLengths` a record kept; a ``KeyError``, ``TypeError`` or ``ValueError`` where it is not one
    (edited, another layout): read again."""
    lengths = tuple(kept["lengths"])
    notes, warnings = tuple(kept["notes"]), tuple(kept["warnings"])
    if set(kept) != {"lengths", "notes", "warnings"} or not all(type(n) is int for n in lengths) or not all(
            isinstance(line, str) for line in (*notes, *warnings)):
        raise ValueError(f"not a record of lengths: {kept!r}")
    return TextLengths(lengths=lengths, notes=notes, warnings=warnings)


def planned_workload(entry: str) -> Workload | SourcePlannedWorkload:
    """What a plan of ``entry`` reads its workload from: a :class:`SourcePlannedWorkload` where ``entry`` has a
    :func:`source_key` (on a miss its workload is loaded at once, as without the record, so a bad entry fails
    here), else the workload itself (:func:`autofit.workload.preflight.load_workload_in_time`)."""

    key = source_key(entry)
    if key is None:
        return load_workload_in_time(entry)
    planned = SourcePlannedWorkload(entry, key)
    if not planned.recorded:
        planned.workload  # noqa: B018 - loaded now: a miss does what a plan without the record does
    return planned
