"""autofit: the fastest training configuration that fits a device, measured.

``import autofit`` stays light (no torch): the training stack is imported only
where a command needs it.
"""

from __future__ import annotations

from autofit.config import Config
from autofit.errors import AutofitError
from autofit.workload import Workload

__version__ = "0.1.0"
__all__ = ["AutofitError", "Config", "Workload", "__version__"]
