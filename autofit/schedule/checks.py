"""What a worker checks before it starts, before it claims and before it imports: pure functions of what it
was told and what it found, so each is tested with real-looking inputs.

- :func:`check_device`: ``autofit worker --hardware PRESET`` on a machine whose GPU is another refuses to
  start (an A100 node told ``h100-80gb`` would claim H100 searches and label its winners h100).
- :func:`check_nodes`: a CUDA worker launches one node (its agents run on this machine); a search spanning
  more is not its.
- :func:`entry_roots`: the folders queued entry points may be imported from (``AUTOFIT_ENTRY_ROOTS``,
  ``--entry-root``), each an existing folder; :func:`entry_refusal`: an entry outside them, or whose file or
  package is missing here, is given back for another worker, checked before anything is imported.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS, preset_for_device
from autofit.machine.nvml import nvml_records
from autofit.workload.hf import HfEntry

GIB = 2**30
ENTRY_ROOTS_ENV = "AUTOFIT_ENTRY_ROOTS"
#: Hub repositories a worker with entry roots may load (``ORG/NAME`` or ``ORG/*``, comma-separated), besides
#: ``--allow-hub``
ALLOW_HUB_ENV = "AUTOFIT_ALLOW_HUB"


def preset_matches(preset: str, device_name: str, memory_bytes: int) -> bool:
    """Whether a device NVML (or torch) names ``device_name`` with ``memory_bytes`` is the GPU preset ``preset``:
    the preset detection picks for it (:func:`autofit.core.hardware.preset_for_device`: the preset's family in the
    name, ``h100`` in ``NVIDIA H100 80GB HBM3``, its memory within 10 %, the PCIe card told from the SXM part)."""
    return preset_for_device(device_name, memory_bytes) == preset.lower()


def check_device(preset: str, devices: Sequence[tuple[str, int]]) -> None:
    """Refuse (one line) a worker told ``--hardware preset`` whose detected GPUs (``(name, memory bytes)`` each)
    are not that preset. ``auto`` and ``cpu`` pass: the first is what was detected, the second runs anywhere."""
    key = preset.lower()
    if key in ("auto", "cpu") or key not in PRESETS:
        return
    if not devices:
        raise AutofitError(f"worker --hardware {preset}, but this machine has no CUDA device: start it on a {key} "
                           "machine, or with --hardware cpu / auto")
    wrong = sorted({(name, memory) for name, memory in devices if not preset_matches(key, name, memory)})
    if wrong:
        seen = "; ".join(f"{name} ({memory / GIB:.0f} GiB)" for name, memory in wrong)
        fits = [k for k in PRESETS if all(preset_matches(k, n, m) for n, m in devices)]
        hint = f"--hardware {fits[0]} or auto" if fits else "--hardware auto"
        raise AutofitError(f"worker --hardware {preset}, but this machine's GPU is {seen}: start it with {hint}")


def check_nodes(kind: str, nodes: int) -> None:
    """Refuse ``worker --nodes N`` beyond what a worker launches: a probe starts every node's agent on this
    machine (:func:`autofit.probe.elastic.launch_agents`, rendezvous on 127.0.0.1). On a CPU that is the
    multi-node simulation ``autofit run --nodes N --hardware cpu`` uses too; on CUDA two agents here would put
    two nodes' ranks on the same GPUs, so a CUDA worker launches one node and claims one-node searches only
    (:func:`autofit.schedule.queue.claim` compares a search's nodes with the worker's)."""
    if kind == "cuda" and nodes > 1:
        raise AutofitError(f"worker --nodes {nodes}: a worker launches its probes on this machine only, so a CUDA "
                           "worker runs one-node searches; start one worker per node with --nodes 1")


def detected_devices() -> list[tuple[str, int]]:
    """``(name, total memory)`` of every GPU here: NVML's, else torch's (``torch.cuda.get_device_properties``);
    empty without CUDA."""

    records = nvml_records()
    if records:
        return [(r.name, r.memory_bytes) for r in records]
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [(p.name, int(p.total_memory)) for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))]


def entry_roots(flags: Sequence[str] = (), environ: dict[str, str] | None = None) -> tuple[Path, ...] | None:
    """The folders a worker imports entry points from: ``--entry-root`` flags and ``AUTOFIT_ENTRY_ROOTS``
    (``os.pathsep``-separated), resolved; None when neither names one (every entry may be imported). A root
    that is not an existing folder (a typo would give every search back) is an :class:`AutofitError`."""
    listed = [*flags, *(environ if environ is not None else os.environ).get(ENTRY_ROOTS_ENV, "").split(os.pathsep)]
    roots = tuple(dict.fromkeys(_entry_root(p.strip()) for p in listed if p.strip()))
    return roots or None


def _entry_root(written: str) -> Path:
    """One allowed entry root, resolved; one line when ``~user`` names no user or the path is no folder."""
    try:
        path = Path(written).expanduser()
    except RuntimeError:  # "Could not determine home directory": ~nosuchuser
        raise AutofitError(f"entry root {written!r} (--entry-root, {ENTRY_ROOTS_ENV}): no such user's home "
                           "folder") from None
    if not path.is_dir():
        raise AutofitError(f"entry root {written!r} (--entry-root, {ENTRY_ROOTS_ENV}): "
                           f"{'not a folder' if path.exists() else 'no such folder'}")
    return path.resolve()


def _entry_location(entry: str) -> tuple[Path | None, str | None]:
    """``(the file or folder that importing entry would run, why it is not here)``, found without importing
    anything: a path as written, a package through ``importlib.util.find_spec`` of its top-level name (which
    reads the file system, runs nothing); ``(None, None)`` for a Hub model (its code is not local)."""

    if entry.startswith("hf:"):

        source = HfEntry.parse(entry).source
        folder = Path(source).expanduser()
        local = folder.is_dir() or source.startswith((".", "/", "~"))
        return (folder.resolve(), None if folder.is_dir() else f"no folder {source}") if local else (None, None)
    target = entry.rpartition(":")[0]
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        return path, None if path.is_file() else f"no file {path}"
    top = target.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None, f"no module named {top!r}"
    places = list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else [])
    return (Path(places[0]).resolve() if places else None), None


def allowed_hub(flags: Sequence[str] = (), environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The Hub repositories a worker with entry roots may load: ``--allow-hub`` flags and :data:`ALLOW_HUB_ENV`
    (comma-separated), each ``ORG/NAME`` or ``ORG/*``, lower-cased."""
    listed = [*flags, *(environ if environ is not None else os.environ).get(ALLOW_HUB_ENV, "").split(",")]
    return tuple(dict.fromkeys(name.strip().lower() for name in listed if name.strip()))


def _hub_refusal(entry: str, allow_hub: Sequence[str]) -> str | None:
    """Why a worker with entry roots must not load the Hub model ``entry`` names (its code, its config's remote
    code, come from the Hub, not from under a root): deny unless listed in ``allow_hub``."""
    name = HfEntry.parse(entry).source.lower()
    if name in allow_hub or f"{name.partition('/')[0]}/*" in allow_hub:
        return None
    return (f"the Hub model {name} is not in this worker's Hub allow-list (--allow-hub ORG/NAME or {ALLOW_HUB_ENV}): "
            "with entry roots set, Hub models are refused unless listed")


def entry_refusal(entry: str, roots: Sequence[Path] | None, allow_hub: Sequence[str] | None = None) -> str | None:
    """Why this worker must not import ``entry`` (None: it may): outside every allowed root, a Hub model not in
    ``allow_hub`` (None: :func:`allowed_hub` from the environment) while roots are set, or not importable here
    (its file, folder or package missing). Checked before anything of it is imported; either way the search is
    given back for another worker, not failed."""
    location, missing = _entry_location(entry)
    if roots is not None and location is None and missing is None and entry.startswith("hf:"):
        return _hub_refusal(entry, allowed_hub() if allow_hub is None else allow_hub)
    if roots is not None and location is not None and not any(location.is_relative_to(r) for r in roots):
        return f"{location} is outside the allowed entry roots ({os.pathsep.join(map(str, roots))})"
    if roots is not None and location is None and missing is None and not entry.startswith("hf:"):
        return "its module has no file to check against the allowed entry roots"
    return f"not importable here: {missing}" if missing else None
