"""One module a command, called by the CLI (:mod:`autofit.cli`: parse, call, print) and the Python API
(``autofit.estimate`` ...) alike, so the two cannot drift.

- :mod:`autofit.commands.estimate`: ``autofit estimate`` and ``autofit.estimate``;
- :mod:`autofit.commands.run`: ``autofit run`` (the search) and ``autofit.search``;
- :mod:`autofit.commands.ladder`: ``autofit ladder`` and ``autofit.ladder``;
- :mod:`autofit.commands.probe`: ``autofit probe``;
- :mod:`autofit.commands.schedule`: ``autofit schedule add|list``, ``autofit worker``, ``autofit results``;
- :mod:`autofit.commands.options`: the shared options as the Python API takes them, in sections.
"""
