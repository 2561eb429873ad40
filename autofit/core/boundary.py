"""What crosses a process boundary: the shared status literals, and the strict reading of a record's JSON.

A probe rank writes its result in one process and the probe reads it in another; a probe's result is
stored in an Optuna study and read back by another run, a worker or ``autofit results``. Read as a
dict with ``.get(key, 0)``, a renamed key reads as a 0-byte peak. Each such record is a frozen
dataclass written with one ``to_json()`` and read with one ``from_json(mapping)``, which goes through
:func:`read_record`: every field present, no key it does not know, each value of its field's type.

No torch import: the cost model and the search read these.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from autofit.core.errors import AutofitError

Status = Literal["ok", "oom", "timeout", "error"]
"""How a probe (a rank, a probe, a script run) ended: it ran; out of memory (on the device, or past the
budget on the CPU, or the host's RAM); past its deadline; any other failure."""
STATUSES: tuple[Status, ...] = get_args(Status)

OomOn = Literal["device", "host"]
"""Where an ``oom`` ran out: the device (the GPU, or the budget of a CPU device) or the host's RAM."""
OOM_ON: tuple[OomOn, ...] = get_args(OomOn)

R = TypeVar("R")


def as_status(value: object, what: str = "status") -> Status:
    """``value`` as a :data:`Status`, or an :class:`AutofitError` naming ``what`` and the value."""
    for status in STATUSES:
        if value == status:
            return status
    raise AutofitError(f"{what} must be one of {', '.join(STATUSES)}, but got {value!r}")


def read_record(cls: type[R], data: object, what: str, convert: Mapping[str, Callable[[Any], Any]] | None = None,
                optional: frozenset[str] = frozenset()) -> R:
    """``cls(**data)`` after checking ``data`` against ``cls``'s fields: an :class:`AutofitError` naming ``what``
    and the key when one is missing or unknown, or when a value is not of its field's type.

    ``convert`` maps a field to the function that reads its JSON (a nested record: a :class:`Config` from its
    dict); a converted field's type is the converter's to check. ``optional``: fields a writer autofit does not
    own may leave out (DeepSpeed omits a timer it never started); they take their default.
    """
    if not isinstance(data, Mapping):
        raise AutofitError(f"{what} must be a JSON object, but got {type(data).__name__}")
    convert = convert or {}
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in data if k not in names)
    if unknown:
        raise AutofitError(f"{what} has unknown key {unknown[0]!r} (known: {', '.join(names)})")
    missing = [n for n in names if n not in data and n not in optional]
    if missing:
        raise AutofitError(f"{what} is missing key {missing[0]!r}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name in names:
        if name not in data:
            continue
        value = data[name]
        if name in convert:
            value = convert[name](value)
        elif not conforms(value, hints[name]):
            raise AutofitError(f"{what}: {name} must be {_describe(hints[name])}, but got {value!r}")
        values[name] = value
    return cls(**values)


def conforms(value: object, hint: Any) -> bool:
    """Whether a JSON value is of the type ``hint`` names (int for float allowed, bool for int not:
    JSON writes ``1.0`` as ``1.0`` but a hand-made record may say ``0``)."""
    if hint is Any:
        return True
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return value in args
    if origin in (Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, Mapping) and all(isinstance(k, str) and conforms(v, args[1]) for k, v in value.items())
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a type this reader does not check (cheap checks only)


def _describe(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
