"""The allocator reserves a plan priced, kept on disk beside its trace: a model planned again replays nothing.

A CUDA plan prices the caching allocator's reserve of each distinct :func:`~autofit.cost_model.allocation_sequence.
reserve_key` by replaying the requests its process makes (:mod:`autofit.cost_model.allocation_sequence`, a few
milliseconds each; LLaMA-2-70B on 64 H100s has a few hundred). What a replay gives is a function of the model's
facts, the key and the code that replays it, so it is kept in the trace cache (:mod:`autofit.trace.cache`: the same
directory, the same ``AUTOFIT_NO_CACHE`` and ``--no-cache``, the same whole-or-nothing writes) under a name made of
all three: the facts as the trace wrote them (less how long the trace took), the source files of the replay, and
:data:`FORMAT`. Only replays of the default allocator settings are kept (those every plan prices).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from typing import Any

from autofit.cost_model.allocation_sequence import reserve_memo
from autofit.cost_model.facts import ModelFacts
from autofit.trace.cache import cache_dir, read_entry, sources_digest, write_entry

#: version of the entry layout; bumped when what is stored changes meaning
FORMAT = 3
#: autofit's source files a replay runs (relative to the package): a change to any of them may change a reserve
REPLAY_SOURCES = ("cost_model/allocation_sequence.py", "cost_model/allocator.py", "cost_model/long_context.py",
                  "cost_model/facts.py", "core/config.py")
#: the number of values in a :func:`~autofit.cost_model.allocation_sequence.reserve_key`
_KEY_LENGTH = 11


def entry_name(facts: ModelFacts) -> str:
    """The cache entry of ``facts``' reserves: a digest of the facts (less ``trace_seconds``), the replay's sources
    and :data:`FORMAT`."""
    traced = facts.to_dict()
    traced.pop("trace_seconds", None)
    parts = {"facts": traced, "sources": sources_digest(REPLAY_SOURCES), "format": FORMAT}
    return "reserves-" + hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


@contextlib.contextmanager
def kept_reserves(facts: ModelFacts) -> Iterator[None]:
    """The reserves kept for ``facts`` read into their memo (once a process), and what the block priced anew
    written back; nothing read or written where the cache is off."""
    if cache_dir() is None:
        yield
        return
    memo = reserve_memo(facts)
    name = facts.__dict__.get("_reserve_entry")
    if name is None:
        name = entry_name(facts)
        object.__setattr__(facts, "_reserve_entry", name)  # not a field: as the memo itself
        memo.update(_read(name))
    before = len(memo)
    yield
    if len(memo) > before:
        write_entry(name, {"reserves": [[*key[:_KEY_LENGTH], value] for key, value in memo.items()
                                        if len(key) == _KEY_LENGTH + 1 and key[-1] is None]})


def _read(name: str) -> dict[tuple[object, ...], int]:
    """The reserves under ``name``; an entry of another layout, or a row that is not a key and a count of bytes,
    is ignored (a miss: the replay runs again)."""
    entry = read_entry(name)
    rows: Any = entry.get("reserves") if entry is not None else None
    if not isinstance(rows, list):
        return {}
    kept: dict[tuple[object, ...], int] = {}
    for row in rows:
        if (isinstance(row, list) and len(row) == _KEY_LENGTH + 1
                and all(isinstance(v, (int, bool)) for v in row) and row[-1] >= 0):
            kept[(*row[:_KEY_LENGTH], None)] = int(row[-1])
    return kept
