"""What a workload's result depends on: its structure and its sources.

- :func:`workload_fingerprint`: the model's structure (its module tree and every parameter's name,
  shape and dtype, built on the ``meta`` device so nothing is allocated), the shapes and dtypes of a
  one-sample batch, ``tokens_per_sample``, and the bytes of the entry's source file and of every local
  module it imports (:func:`local_sources`: the import closure of the entry file among the files under its
  folder, read from the source, so the add and the worker compute the same one).
- :func:`request_hash`: the space, world size, global batch, ``--set`` values, memory budget and trials.

Nothing here imports torch at module level; :func:`workload_fingerprint` does, when called.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

from autofit.core.errors import guards_user_code
from autofit.core.hashing import digest
from autofit.workload.hf import HfEntry


def entry_source(entry: str) -> Path | None:
    """The source file ``entry`` (``path.py:fn`` or ``package.module:fn``) is defined in, if it has one; an ``hf:``
    entry's ``config.json`` where it is a local folder (a Hub model's config is its structure's)."""
    if entry.startswith("hf:"):

        config = Path(HfEntry.parse(entry).source).expanduser() / "config.json"
        return config.resolve() if config.is_file() else None
    target = entry.rpartition(":")[0]
    if target.endswith(".py") or "/" in target:
        path = Path(target).resolve()
        return path if path.is_file() else None
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and Path(spec.origin).is_file() else None


def structure(workload: Any) -> dict[str, Any]:
    """The workload's structure, built on the meta device: module tree, parameters, a sample's shapes."""
    import torch

    with torch.device("meta"):
        model = workload.build_model()
    params = [[name, list(p.shape), str(p.dtype)] for name, p in model.named_parameters()]
    batch = workload.batch(1)
    leaves = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]
    shapes = [[list(t.shape), str(t.dtype)] if isinstance(t, torch.Tensor) else repr(t) for t in leaves]
    return {"modules": repr(model), "params": params, "batch": shapes, "tokens_per_sample": workload.tokens_per_sample}


def import_root(entry: str, source: Path) -> tuple[Path, Path]:
    """``(root, scope)``: the folder the entry's own imports resolve against and the folder whose files count
    as local. A ``path.py`` entry: its folder, both (the loader puts it on ``sys.path``). A ``package.module``
    entry: the ``sys.path`` folder holding its top package, and that package's folder (not the site-packages
    beside it: installed libraries are in the machine's fingerprint by version)."""
    if entry.startswith("hf:"):  # a local folder's config.json: the file itself, it imports nothing
        return source.parent, source
    target = entry.rpartition(":")[0]
    if target.endswith(".py") or "/" in target:
        return source.parent, source.parent
    depth = target.count(".") + (1 if source.name == "__init__.py" else 0)
    root = source.parents[depth]
    return root, root / target.split(".")[0] if depth else source


def _module_files(root: Path, dotted: str) -> list[Path]:
    """The files under ``root`` that importing ``dotted`` runs: each package's ``__init__.py`` and the module."""
    parts = [p for p in dotted.split(".") if p]
    files = []
    for n in range(1, len(parts) + 1):
        folder = root.joinpath(*parts[:n])
        for candidate in (folder / "__init__.py", folder.with_suffix(".py")):
            if candidate.is_file():
                files.append(candidate)
                break
    return files


def _imported_names(path: Path, root: Path) -> list[tuple[Path, str]]:
    """``(base folder, dotted module)`` of each import in ``path`` (``from m import x`` names ``m`` and ``m.x``,
    ``x`` may be a submodule); relative imports resolve from the file's own package."""

    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return []
    names: list[tuple[Path, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(root, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = root if node.level == 0 else path.parents[node.level - 1]
            module = node.module or ""
            names.append((base, module))
            names += [(base, f"{module}.{alias.name}" if module else alias.name) for alias in node.names]
    return names


def local_sources(source: Path, root: Path, scope: Path | None = None) -> dict[str, str]:
    """sha256 of ``source`` and of every file under ``scope`` (default ``root``) it imports, directly or through
    another such file (imports resolved against ``root``), by path relative to ``root``. Read from the source
    (``ast``), not from ``sys.modules``: what else a process happens to have imported must not change the key."""
    root = root.resolve()
    scope = (scope or root).resolve()
    seen: dict[Path, str] = {}
    pending = [source.resolve()]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        if path.suffix != ".py":
            continue
        for base, dotted in _imported_names(path, root):
            pending += [f.resolve() for f in _module_files(base, dotted) if f.resolve().is_relative_to(scope)]
    return {str(p.relative_to(root)) if p.is_relative_to(root) else str(p): h for p, h in sorted(seen.items())}


@guards_user_code("fingerprinting the workload")
def workload_fingerprint(entry: str, workload: Any) -> str:
    """Hash of the workload's :func:`structure`, its entry file's bytes and the local modules it imports."""
    source = entry_source(entry)
    code = local_sources(source, *import_root(entry, source)) if source is not None else None
    return digest({"structure": structure(workload), "source": code})[:16]


def sources_digest(entry: str) -> str | None:
    """A digest of ``entry``'s source files (:func:`local_sources`; an ``hf:`` folder's ``*.py`` beside its config
    too), read without importing anything: what ``schedule add`` records and a worker compares before it imports
    the entry. None where the entry has no local source (a Hub name) or it cannot be read."""
    try:
        source = entry_source(entry)
        if source is None:
            return None
        code = local_sources(source, *import_root(entry, source))
        if entry.startswith("hf:"):
            code |= {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(source.parent.glob("*.py"))}
    except (OSError, ValueError, ImportError):
        return None
    return digest(code)[:16]


def request_hash(request: dict[str, Any]) -> str:
    """Hash of what is asked of the search besides the model and the machine (space, batch, --set, trials)."""
    return digest({k: request[k] for k in sorted(request) if k not in ("entry", "hardware")})[:16]
