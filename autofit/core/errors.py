"""The one exception root of autofit.

Every error a user can cause (a bad entry point, a malformed space, an unknown
hardware name, ...) is raised as an :class:`AutofitError` whose message names the
field and the value. The CLI prints that message as one line and exits 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar


class AutofitError(Exception):
    """A user-facing error: its message is one line that says what is wrong."""


class NothingFits(AutofitError):
    """A search's end without a winner: no candidate measured within the device's usable budget. Its message says
    what the smallest candidate needs and what would make it fit (:func:`autofit.tuner.advice.nothing_fits`); a
    scheduled search ends ``nothing-fits`` on it, not ``failed``."""


F = TypeVar("F", bound=Callable[..., Any])


def is_control(exc: BaseException) -> bool:
    """Whether ``exc`` must pass through a guard on user code untouched: Ctrl-C, an AutofitError, and autofit's
    own control-flow exceptions (a worker's ``Interrupted``, raised from its signal handler)."""
    return isinstance(exc, (KeyboardInterrupt, GeneratorExit, AutofitError)) or (
        type(exc).__module__.startswith("autofit.")
    )


def user_code_error(what: str, exc: BaseException) -> AutofitError:
    """The one line for ``exc`` escaping user code: ``what raised SystemExit(0)``; a ``sys.exit`` or a bare
    ``BaseException`` is a failure of the workload, never autofit's silent success."""
    name = type(exc).__name__
    text = f"{name}({exc.code!r})" if isinstance(exc, SystemExit) else f"{name}: {exc}" if str(exc) else name
    hint = " (the model's code called sys.exit; it must return, not exit)" if isinstance(exc, SystemExit) else ""
    return AutofitError(f"{what} raised {text}{hint}")


@contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run user code (an entry's import, its function, the model, batch and loss while tracing): any
    BaseException that is no Exception (``SystemExit``, a ``BaseException`` subclass) but :func:`is_control`'s
    becomes one :class:`AutofitError` line naming ``what``; an Exception is the caller's to report."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, Exception) or is_control(exc):
            raise
        raise user_code_error(what, exc) from exc


def guards_user_code(what: str) -> Callable[[F], F]:
    """:func:`user_code` around a whole function (one that calls into the workload)."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with user_code(what):
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
