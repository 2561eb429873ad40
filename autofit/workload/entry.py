"""Loading an entry point: ``path/to/file.py:function``, ``package.module:function`` or ``hf:...``
(:mod:`autofit.workload.types.hf`). Loading never lets a user's mistake escape as a traceback: a missing file or
function, an entry that raises, or one that returns the wrong type becomes one :class:`AutofitError` line.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autofit.core.errors import AutofitError
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
    """Import ``ENTRY`` and call it (an ``hf:`` entry: :func:`autofit.workload.hf.load_hf_entry`). Every failure is one
    AutofitError line naming the entry."""
    if entry.startswith("hf:"):

        return load_hf_entry(entry)
    function = _resolve_entry(entry)
    try:
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


def _resolve_entry(entry: str) -> Callable[[], Any]:
    target, sep, attr = entry.rpartition(":")
    if not sep or not target or not attr:
        raise AutofitError(f"entry point must be path/to/file.py:function or package.module:function, but got {entry!r}")
    module = _import_target(target, entry)
    function = getattr(module, attr, None)
    if function is None:
        raise AutofitError(f"entry point {entry!r}: {target} has no function {attr!r}")
    if not callable(function):
        raise AutofitError(f"entry point {entry!r}: {attr!r} is not callable")
    return function  # type: ignore[no-any-return]


def _import_target(target: str, entry: str) -> Any:
    try:
        if target.endswith(".py") or "/" in target or "\\" in target:
            path = Path(target).resolve()
            if not path.is_file():
                raise AutofitError(f"entry point {entry!r}: no such file {target}")
            module_name = f"autofit_entry_{path.stem}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise AutofitError(f"entry point {entry!r}: cannot import {target}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            sys.path.insert(0, str(path.parent))
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except AutofitError:
        raise
    except ModuleNotFoundError as exc:
        raise AutofitError(f"entry point {entry!r}: cannot import {target}: {exc}") from exc
    except Exception as exc:
        raise AutofitError(f"entry point {entry!r}: importing {target} raised {type(exc).__name__}: {exc}") from exc
