"""The one exception root of autofit.

Every error a user can cause (a bad entry point, a malformed space, an unknown
hardware name, ...) is raised as an :class:`AutofitError` whose message names the
field and the value. The CLI prints that message as one line and exits 1.
"""

from __future__ import annotations


class AutofitError(Exception):
    """A user-facing error: its message is one line that says what is wrong."""
