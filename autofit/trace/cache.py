"""A cache of traces on disk: a model traced once is not traced again while nothing it depends on changed.

Tracing is most of what ``autofit estimate`` costs (LLaMA-2-70B on 64 GPUs: the model cut to 2-5 layers, 36
forward+backward steps on fake tensors); what it yields, :class:`autofit.cost_model.facts.ModelFacts`, is a
function of the model, its batch and the software that traced it, so it is kept, as JSON, under a key of all
three:

- the model as built on the meta device (no memory): its module tree (names and classes), every parameter's and
  buffer's name, shape, dtype and ``requires_grad`` (and which are tied), the plain settings of every module (as
  :func:`autofit.trace.layers.layers_alike` reads them) and a Hugging Face model's config;
- the source files of the workload's functions (model, batch, loss, layers, attention modules) and of every
  module class in the model: an edited ``forward`` changes the trace without changing a shape;
- the batch at each traced micro-batch (each tensor's shape and dtype, built on the meta device);
- what was asked: precisions, attention kernels, checkpoint ratios and granularities, optimizers, micro-batches;
- the software: Python, torch, transformers, deepspeed, flash-attn, adam-mini, autofit's version, and a hash of the
  source files of autofit that a trace runs (:data:`TRACED_SOURCES`).

Where: ``$AUTOFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/autofit``, else ``~/.cache/autofit`` (the XDG base
directory default), in ``traces/``. ``AUTOFIT_NO_CACHE=1`` (``true``, ``yes``, ``on``) neither reads nor writes it,
nor does what runs inside :func:`turned_off` (the commands' ``--no-cache``, a value of the command rather than the
variable written into the environment); unset, empty, ``0``, ``false``, ``no`` or ``off`` keeps it on, and
any other value is an error (:func:`cache_turned_off`). Each entry is written whole to a temporary file and
renamed over the old one (``os.replace``, atomic on POSIX), so a reader never sees half an entry; an entry that
cannot be read or parsed is ignored (the model is traced again and the entry rewritten), and a cache directory
that cannot be written only goes unused. :mod:`autofit.trace.source_cache` keeps its records here the same way
(:func:`read_entry`, :func:`write_entry`, :func:`sources_digest`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from autofit.core.errors import AutofitError
from autofit.cost_model.facts import InvalidFacts, ModelFacts
from autofit.ds.emit import write_text_atomic
from autofit.trace.cache_trust import ignored_entry, make_private, trusted
from autofit.workload.types import Workload

#: environment variable naming the cache directory
CACHE_DIR_ENV = "AUTOFIT_CACHE_DIR"
#: environment variable that turns the cache off: one of :data:`NO_CACHE_ON` (case-insensitive); one of
#: :data:`NO_CACHE_OFF`, or unset, keeps it on
NO_CACHE_ENV = "AUTOFIT_NO_CACHE"
#: the values of :data:`NO_CACHE_ENV` that turn the cache off
NO_CACHE_ON = ("1", "true", "yes", "on")
#: the values of :data:`NO_CACHE_ENV` that leave the cache on
NO_CACHE_OFF = ("", "0", "false", "no", "off")
#: version of the entry layout; bumped when what is stored changes meaning
FORMAT = 1
#: distributions whose versions invalidate every entry (absent ones count as ``None``)
VERSIONED_PACKAGES = ("torch", "transformers", "deepspeed", "flash-attn", "adam-mini")
#: autofit's source files that a trace runs, relative to the package (the whole of :mod:`autofit.trace`, and what
#: it calls elsewhere): a change to any of them may change a trace
TRACED_SOURCES = ("trace", "ds/apply.py", "workload", "core/config.py", "ds/fp8.py", "ds/optim.py", "ds/constants.py",
                  "cost_model/facts.py", "__init__.py")

_PLAIN = (bool, int, float, str, type(None))

#: the cache turned off for what runs inside :func:`turned_off`, in this process
_TURNED_OFF: ContextVar[bool] = ContextVar("autofit_trace_cache_turned_off", default=False)


@contextlib.contextmanager
def turned_off(off: bool = True) -> Iterator[None]:
    """The cache turned off (where ``off``) for what runs inside, in this process: the commands' ``--no-cache``.
    Every reader of the cache (the plan's trace, :mod:`autofit.trace.source_cache`) runs in the command's process,
    so the setting is handed on as a value, not written into ``os.environ`` for good."""
    token = _TURNED_OFF.set(off or _TURNED_OFF.get())
    try:
        yield
    finally:
        _TURNED_OFF.reset(token)


def cache_dir() -> Path | None:
    """The directory of trace entries, or None when the cache is turned off (:func:`turned_off`,
    :func:`cache_turned_off`) or cannot be trusted (another user's, or writable by others:
    :func:`autofit.trace.cache_trust.trusted`)."""
    if _TURNED_OFF.get() or cache_turned_off(os.environ.get(NO_CACHE_ENV, "")):
        return None
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "autofit")
    traces = Path(root) / "traces"
    return traces if trusted(traces) else None


def cache_turned_off(value: str) -> bool:
    """Whether :data:`NO_CACHE_ENV` set to ``value`` turns the cache off: one of :data:`NO_CACHE_ON`, or leaves it on:
    one of :data:`NO_CACHE_OFF` (both case-insensitive, surrounding blanks ignored); anything else is an error, not a
    guess (a ``false`` once turned the cache off)."""
    word = value.strip().lower()
    if word in NO_CACHE_ON:
        return True
    if word in NO_CACHE_OFF:
        return False
    raise AutofitError(f"{NO_CACHE_ENV}={value!r} is not a yes/no value: {', '.join(NO_CACHE_ON)} turns the trace "
                       f"cache off; {', '.join(NO_CACHE_OFF[1:])} or empty keeps it on")


def plain_request(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` (the arguments of :func:`autofit.trace.trace_workload`) as JSON writes it: tuples as lists."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in request.items()}


def trace_key(workload: Workload, model: Any, request: dict[str, Any]) -> str:
    """The key of the trace of ``workload`` (``model``: built from it on the meta device) for ``request`` (the
    arguments of :func:`autofit.trace.trace_workload`); a hex SHA-256."""
    parts = {
        "format": FORMAT,
        "software": software_versions(),
        "name": workload.name,
        "tokens_per_sample": workload.tokens_per_sample,
        "searches_attention": workload.searches_attention,
        "request": plain_request(request),
        "model": model_fingerprint(model),
        "code": code_fingerprint(workload, model),
        "batch": batch_fingerprint(workload, tuple(request.get("micro_batches", ()))),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def load(key: str) -> ModelFacts | None:
    """The facts stored under ``key``, or None: no entry, the cache off, or an entry that cannot be read."""
    entry = read_entry(key)
    return facts_of(entry) if entry is not None else None


def store(key: str, facts: ModelFacts) -> None:
    """Keep ``facts`` under ``key`` (:func:`write_entry`). A directory that cannot be written leaves the cache
    unused, never the command failed."""
    write_entry(key, {"facts": facts.to_dict()})


def read_entry(name: str) -> dict[str, Any] | None:
    """The document written under ``name`` (:func:`write_entry`), or None: the cache off, no entry, or one that
    cannot be read, is not a JSON object or names another key (truncated, edited, another layout): a miss."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        entry = json.loads((directory / f"{name}.json").read_text())
    except (OSError, ValueError):  # missing, unreadable, truncated, not JSON, not UTF-8
        return None
    return entry if isinstance(entry, dict) and entry.get("key") == name else None


def facts_of(entry: dict[str, Any]) -> ModelFacts | None:
    """The :class:`ModelFacts` under an entry's ``facts``, or None where they are missing, of another layout, or do
    not validate (:meth:`ModelFacts.from_dict`: said in one line naming the entry's file)."""
    try:
        return ModelFacts.from_dict(entry["facts"])
    except InvalidFacts as exc:  # a value no trace writes: garbled or forged
        directory = cache_dir()
        ignored_entry((directory or Path(".")) / f"{entry.get('key')}.json", str(exc))
        return None
    except (KeyError, TypeError, ValueError, AttributeError):  # missing, or another layout
        return None


def write_entry(name: str, document: dict[str, Any]) -> None:
    """``document`` with its ``key`` (``name``) as JSON in the cache directory, whole or not at all: written to a
    temporary file beside the entry and renamed over it (:func:`autofit.ds.emit.write_text_atomic`). The cache off
    keeps nothing; a directory that cannot be written leaves it unkept."""

    directory = cache_dir()
    if directory is None:
        return
    with contextlib.suppress(OSError):
        make_private(directory)
        write_text_atomic(directory / f"{name}.json", json.dumps({**document, "key": name}), private=True)


def software_versions() -> dict[str, Any]:
    """Python's, each of :data:`VERSIONED_PACKAGES`' and autofit's versions, and :func:`traced_sources_digest`."""
    return {
        "python": sys.version,
        **{name: _version(name) for name in VERSIONED_PACKAGES},
        "autofit": _version("autofit"),
        "autofit_sources": traced_sources_digest(),
    }


@functools.cache
def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def traced_sources_digest() -> str:
    """:func:`sources_digest` of :data:`TRACED_SOURCES`."""
    return sources_digest(TRACED_SOURCES)


def sources_digest(names: tuple[str, ...]) -> str:
    """SHA-256 of autofit's own source files ``names`` (relative to the package; every ``.py`` file under a folder),
    in a fixed order: each file's path and its contents, or ``<absent>`` for a file not there."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in names:
        path = package / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(str(file.relative_to(package)).encode())
            digest.update(file.read_bytes() if file.exists() else b"<absent>")
    return digest.hexdigest()


def model_fingerprint(model: Any) -> str:
    """SHA-256 of the module tree, the parameters and buffers (name, shape, dtype, requires_grad, tied to which),
    every module's plain settings and the Hugging Face configs the modules hold."""
    digest = hashlib.sha256()
    first_name: dict[int, str] = {}
    configs: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        settings = []
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_"):
                continue
            if isinstance(value, _PLAIN):
                settings.append((attr, repr(value)))
            elif hasattr(value, "to_json_string") and id(value) not in configs:  # a transformers PretrainedConfig
                configs[id(value)] = value.to_json_string(use_diff=False)
        digest.update(repr((module_name, cls.__module__, cls.__qualname__, settings)).encode())
        for kind, tensors in (("p", module._parameters), ("b", module._buffers)):
            for name, tensor in tensors.items():
                if tensor is None:
                    digest.update(repr((kind, name, None)).encode())
                    continue
                full = f"{module_name}.{name}"
                tied = first_name.setdefault(id(tensor), full)
                digest.update(repr((kind, name, tuple(tensor.shape), str(tensor.dtype),
                                    bool(tensor.requires_grad), tied)).encode())
    for text in sorted(configs.values()):
        digest.update(text.encode())
    return digest.hexdigest()


def code_fingerprint(workload: Workload, model: Any) -> str:
    """SHA-256 of the source files that define the workload's functions and the model's module classes."""
    functions = [workload.model, workload.batch, workload.loss, workload.layers, workload.attention_modules]
    classes = {type(module) for module in model.modules()}
    files = {_source_file(f) for f in functions if f is not None} | {_source_file(c) for c in classes}
    digest = hashlib.sha256()
    for file in sorted(f for f in files if f):
        digest.update(file.encode())
        digest.update(_file_digest(file).encode())
    return digest.hexdigest()


def _source_file(obj: Any) -> str | None:
    while isinstance(obj, functools.partial):
        obj = obj.func
    obj = inspect.unwrap(obj) if callable(obj) else obj
    obj = getattr(obj, "__func__", obj)  # a bound method
    try:
        return inspect.getsourcefile(obj)
    except (TypeError, OSError):  # a builtin, or a class defined in C or in a notebook cell
        return None


@functools.cache
def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "<unreadable>"


def batch_fingerprint(workload: Workload, micro_batches: tuple[int, ...]) -> list[Any]:
    """Each traced micro-batch's leaves: a tensor's shape and dtype, anything else's type and value. Made on the meta
    device (shapes, no memory; a first ``FakeTensorMode`` would cost seconds of imports on a hit)."""
    import torch
    from torch.utils._pytree import tree_flatten

    out = []
    with torch.device("meta"):
        for n in micro_batches:
            leaves, spec = tree_flatten(workload.batch(n))
            out.append([str(spec), [_leaf(leaf) for leaf in leaves]])
    return out


def _leaf(leaf: Any) -> Any:
    import torch

    if isinstance(leaf, torch.Tensor):
        return ["tensor", list(leaf.shape), str(leaf.dtype)]
    return [type(leaf).__qualname__, repr(leaf)]


def cached_trace(workload: Workload, model: Any, request: dict[str, Any], trace: Callable[[], ModelFacts]) -> ModelFacts:
    """The facts stored for ``workload`` and ``request`` (``model``: built from it on the meta device), else
    ``trace()``'s, stored. A workload whose key cannot be made (its batch function fails on fake tensors, say)
    is traced and not stored."""
    if cache_dir() is None:
        return trace()
    try:
        key = trace_key(workload, model, request)
    except Exception:  # the user's batch function on fake tensors, a config that cannot be written as JSON
        return trace()
    cached = load(key)
    if cached is not None:
        return cached
    facts = trace()
    store(key, facts)
    return facts
