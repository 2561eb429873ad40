"""Loading an entry point: ``path/to/file.py:function``, ``package.module:function`` or ``hf:...``
(:mod:`autofit.workload.types.hf`). Loading never lets a user's mistake escape as a traceback: a missing file or
function, an entry that raises, or one that returns the wrong type becomes one :class:`AutofitError` line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from autofit.core.errors import AutofitError, user_code
from autofit.workload.hf import load_hf_entry
from autofit.workload.types import Workload

#: how an entry string names a :class:`Workload` handed over as an object (``autofit.estimate(workload)``)
IN_PROCESS_PREFIX = "<in-process"


def in_process_entry(workload: Workload) -> str:
    """The entry string of a :class:`Workload` object given to the Python API (:mod:`autofit.commands`) instead of an entry
    point: it names the workload in plans, tables and reports, and no process but this one can load it (a
    probe, or the CPU's kernel footprint, needs an entry point: :func:`check_loadable`)."""
    return f"{IN_PROCESS_PREFIX} workload {workload.name or 'unnamed'}>"


def is_loadable(entry: str) -> bool:
    """Whether another process can load ``entry`` (every entry point; not an :func:`in_process_entry`)."""
    return not entry.startswith(IN_PROCESS_PREFIX)


def check_loadable(entry: str, needs: str) -> None:
    """An :class:`AutofitError` where ``entry`` is a :class:`Workload` object's (:func:`in_process_entry`): ``needs``
    (``a search``, ``--measure``) runs the model in subprocesses, which load it from an entry point."""
    if not is_loadable(entry):
        raise AutofitError(
            f"{needs} runs the model in subprocesses, which cannot load a Workload object ({entry}): pass the "
            "entry point instead, 'path/to/file.py:function' or 'package.module:function' returning it "
            "(the function must be importable from a file, not defined in a notebook)"
        )


def load_workload(entry: str) -> Workload:
    """Import ``ENTRY`` and call it (an ``hf:`` entry: :func:`autofit.workload.hf.load_hf_entry`). Every failure,
    a ``sys.exit`` or a ``BaseException`` included, is one AutofitError line naming the entry."""
    if entry.startswith("hf:"):
        with user_code(f"entry point {entry!r}"):
            return load_hf_entry(entry)
    target, sep, attr = entry.rpartition(":")
    if not sep or not target or not attr:
        raise AutofitError(f"entry point must be path/to/file.py:function or package.module:function, but got {entry!r}")
    with _entry_scope(target, entry) as (path, before):
        function = _resolve_entry(entry, target, attr, path)
        try:
            with user_code(f"entry point {entry!r}"):
                workload = function()
        except AutofitError:
            raise
        except Exception as exc:  # the user's code: report it, do not crash
            raise AutofitError(f"entry point {entry!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload):
        raise AutofitError(f"entry point {entry!r} must return an autofit.Workload, but returned {type(workload).__name__}")
    if workload.name is None:
        object.__setattr__(workload, "name", getattr(function, "__name__", entry))
    return workload


def is_file_target(target: str) -> bool:
    """Whether an entry's module part names a file (``path/to/file.py``), not a dotted module."""
    return target.endswith(".py") or "/" in target or "\\" in target


def entry_module_name(path: Path) -> str:
    """The module name of the entry file ``path``: from its resolved path, so ``a/tiny.py`` and ``b/tiny.py``
    loaded in one process stay two modules."""
    return f"autofit_entry_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}_{path.stem}"


@contextmanager
def _entry_scope(target: str, entry: str) -> Iterator[tuple[Path | None, set[str]]]:
    """While the entry imports and its function runs: ``sys.argv`` is ``[the entry file]`` (an ``argparse`` at
    import reads the entry's argv, not autofit's) and the entry's folder is first on ``sys.path``. After: the
    folder is off ``sys.path`` and the modules it supplied (but the entry's own) are out of ``sys.modules``, so
    neither shadows autofit's later imports nor another entry's."""
    path = Path(target).resolve() if is_file_target(target) else None
    saved_argv, saved_path, before = sys.argv, list(sys.path), set(sys.modules)
    sys.argv = [str(path) if path else target]
    if path is not None:
        sys.path.insert(0, str(path.parent))
    try:
        yield path, before
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        if path is not None:
            _drop_modules_under(path.parent, before, keep=entry_module_name(path))


def _drop_modules_under(folder: Path, before: set[str], keep: str) -> None:
    for name in set(sys.modules) - before - {keep}:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file and Path(file).resolve().is_relative_to(folder):
            del sys.modules[name]


def _resolve_entry(entry: str, target: str, attr: str, path: Path | None) -> Callable[[], Any]:
    module = _import_target(target, entry, path)
    function = getattr(module, attr, None)
    if function is None:
        raise AutofitError(f"entry point {entry!r}: {target} has no function {attr!r}")
    if not callable(function):
        raise AutofitError(f"entry point {entry!r}: {attr!r} is not callable")
    return function  # type: ignore[no-any-return]


def _import_target(target: str, entry: str, path: Path | None) -> Any:
    try:
        with user_code(f"entry point {entry!r}: importing {target}"):
            return _import_module(target, entry, path)
    except AutofitError:
        raise
    except ModuleNotFoundError as exc:
        raise AutofitError(f"entry point {entry!r}: cannot import {target}: {exc}") from exc
    except Exception as exc:
        raise AutofitError(f"entry point {entry!r}: importing {target} raised {type(exc).__name__}: {exc}") from exc


def _import_module(target: str, entry: str, path: Path | None) -> Any:
    if path is None:
        return importlib.import_module(target)
    if not path.is_file():
        raise AutofitError(f"entry point {entry!r}: no such file {target}")
    module_name = entry_module_name(path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise AutofitError(f"entry point {entry!r}: cannot import {target}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module
