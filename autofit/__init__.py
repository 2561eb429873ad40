"""autofit: the fastest training configuration that fits a device, measured.

``import autofit`` stays light (no torch): the training stack is imported only
where a command needs it. The Python API (:mod:`autofit.api`) is here:
``autofit.estimate``, ``autofit.search`` and ``autofit.ladder``.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from autofit.api import estimate, ladder, search
from autofit.config import Config
from autofit.errors import AutofitError
from autofit.workload import Workload

__version__ = "0.1.0"
__all__ = ["AutofitError", "Config", "Workload", "__version__", "estimate", "ladder", "search"]

#: the API's functions named like the package's modules autofit/estimate.py, autofit/ladder.py, autofit/search/
_FUNCTIONS = {"estimate": estimate, "ladder": ladder, "search": search}


class _Package(types.ModuleType):
    """The ``autofit`` package, keeping ``autofit.estimate``, ``autofit.ladder`` and ``autofit.search`` the API's
    functions: importing a submodule sets it as an attribute of its package (the import system's
    ``_find_and_load_unlocked``, Lib/importlib/_bootstrap.py), which would replace the function of the same name
    the first time ``autofit.estimate`` (the module) is imported. The modules stay importable by name
    (``from autofit.search import run_search``, ``import autofit.search.driver``): ``sys.modules`` holds them."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTIONS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
