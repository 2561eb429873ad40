"""One module a command, called by the CLI (:mod:`autofit.cli`) and the Python API (``autofit.estimate`` ...)
alike, so the two cannot drift."""
