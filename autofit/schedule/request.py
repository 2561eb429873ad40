"""The queued search's request: everything a worker needs to plan the search again, on another machine.

``autofit schedule add`` makes one (:func:`autofit.schedule.submit.make_request`), :func:`autofit.schedule.queue.add_search`
stores it as the study's ``request`` attribute (:meth:`SearchRequest.to_dict`: plain JSON), and the worker that claims
the search reads it back with :meth:`SearchRequest.from_dict` (:func:`autofit.core.boundary.read_record`: every key of
its field's type, none unknown), so a malformed request is one error naming the key, never a ``KeyError`` mid-plan.

The stored JSON is the one autofit has always written; the keys added since the first requests (``memory_bytes``,
``margin``, ``recipe``, ``sources``) may be missing from an older one and read as their defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autofit.core.boundary import read_record
from autofit.core.errors import AutofitError
from autofit.core.recipe import Recipe
from autofit.core.space import SearchSpace, space_from_dict
from autofit.cost_model.budget import DEFAULT_MARGIN

#: the keys a request queued by an older autofit may lack (each read as its field's default)
ADDED_LATER = frozenset({"memory_bytes", "margin", "recipe", "sources"})


@dataclass(frozen=True)
class SearchRequest:
    """One queued search, as ``schedule add`` asked for it; each field is a key of the stored JSON."""

    entry: str
    """The entry point, made absolute (:func:`autofit.schedule.submit.absolute_entry`): workers start elsewhere."""
    hardware: str
    """The device preset the search runs on (:func:`autofit.machine.fingerprint.device_name`): which workers claim it."""
    gpus: int
    """Devices a node."""
    nodes: int
    """Nodes (world size: ``gpus x nodes``)."""
    global_batch: int | None
    """``--global-batch``; None: the space's default."""
    space: dict[str, Any]
    """The search space as its YAML writes it (:meth:`autofit.core.space.SearchSpace.to_dict`); :meth:`search_space`
    reads it."""
    space_name: str
    """The space's name."""
    fixed: dict[str, Any]
    """``--set`` values, by config key (sorted)."""
    trials: int
    """At most this many probes."""
    memory_bytes: int | None = None
    """``--memory``'s budget in bytes; None: the device's own memory."""
    margin: float = DEFAULT_MARGIN
    """The share of the device every config must leave free (a request queued before ``--margin`` travelled: the
    default)."""
    recipe: Recipe | None = None
    """The user's recipe; None: the worker's device default (:func:`autofit.planning.plan.default_recipe`)."""
    sources: str | None = None
    """Digest of the entry's source files (:func:`autofit.workload.sources.sources_digest`), compared by a worker
    before it imports the entry; None: not known."""

    def search_space(self) -> SearchSpace:
        """:attr:`space` as a validated :class:`~autofit.core.space.SearchSpace`."""
        return space_from_dict(self.space, name=self.space_name)

    def to_dict(self) -> dict[str, Any]:
        """The stored JSON (the study's ``request`` attribute), every key written."""
        return {
            "entry": self.entry, "hardware": self.hardware, "gpus": self.gpus, "nodes": self.nodes,
            "global_batch": self.global_batch, "space": self.space, "space_name": self.space_name,
            "fixed": {k: self.fixed[k] for k in sorted(self.fixed)}, "trials": self.trials,
            "memory_bytes": self.memory_bytes, "margin": self.margin,
            "recipe": self.recipe.to_dict() if self.recipe is not None else None,
            "sources": self.sources,
        }

    @classmethod
    def from_dict(cls, data: object) -> SearchRequest:
        """The inverse of :meth:`to_dict`; a request an older autofit queued (keys of :data:`ADDED_LATER` missing)
        too. An :class:`AutofitError` naming the key when one is missing, unknown or of another type."""
        return read_record(cls, data, "the queued request", {"recipe": _recipe_of}, optional=ADDED_LATER)


def _recipe_of(value: object) -> Recipe | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise AutofitError(f"the queued request: recipe must be a JSON object or null, but got {value!r}")
    try:
        return Recipe.from_dict(value)
    except KeyError as exc:
        raise AutofitError(f"the queued request: recipe is missing key {exc.args[0]!r}") from None
