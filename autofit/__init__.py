"""autofit: the fastest training configuration that fits a device, measured.

``import autofit`` stays light (no torch): the training stack is imported only where a command needs it. The
Python API is here: ``autofit.estimate``, ``autofit.search`` and ``autofit.ladder`` (:mod:`autofit.commands`, one
module a command, which the CLI calls too), the :class:`Workload` an entry point returns, the :class:`Config` of a
candidate and the one error type, :class:`AutofitError`; ``autofit.apply`` (:mod:`autofit.ds.apply`) applies an
emitted JSON's ``"autofit"`` section to a user's own training script, importable by that name as well as by its own
(``from autofit.apply import apply_to_model``): ``sys.modules`` holds the one module under both names, as it holds
``os.path``.
"""

from __future__ import annotations

import sys

from autofit.commands.estimate import estimate
from autofit.commands.ladder import ladder
from autofit.commands.run import search
from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.ds import apply
from autofit.workload.types import Workload

#: ``import autofit.apply`` finds the module the attribute names (the import system looks in ``sys.modules`` first)
sys.modules[f"{__name__}.apply"] = apply

__version__ = "0.1.0"
__all__ = ["AutofitError", "Config", "Workload", "__version__", "apply", "estimate", "ladder", "search"]
