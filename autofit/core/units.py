"""Byte sizes: parse what users type (``2GiB``, ``1.5GiB``, ``800MiB``) and print them back; the range checks
every number a user gives goes through (:func:`finite`, :func:`whole`): finite, within sane bounds, one line
naming the value otherwise."""

from __future__ import annotations

import math
import os
import re

from autofit.core.errors import AutofitError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
#: no device has more memory than this (1 PiB): a larger ``--memory`` is a typo, not a budget
MAX_MEMORY_BYTES = 2**50
#: the largest global batch, devices per node and world size a target may name
MAX_GLOBAL_BATCH = 2**31
MAX_GPUS_PER_NODE = 1024
MAX_WORLD_SIZE = 2**20
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """``"1.5GiB"`` -> 1610612736. Decimal (GB) and binary (GiB) units; a bare number is bytes."""
    if isinstance(text, bool):
        raise AutofitError(f"memory size must be a number of bytes or a string such as 2GiB, but got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise AutofitError(f"memory size must be positive, but got {text!r}")
        return _at_most_any_device(text, text)
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise AutofitError(
            f"cannot parse memory size {text!r}: expected a number with a unit such as 2GiB, 1.5GiB, 800MiB"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(value) or value > MAX_MEMORY_BYTES:
        return _at_most_any_device(text, MAX_MEMORY_BYTES + 1)
    if int(value) <= 0:  # also "0.5" (bytes): less than one byte is no budget
        raise AutofitError(f"memory size must be positive, but got {text!r}")
    return _at_most_any_device(text, int(value))


def _at_most_any_device(text: str | int, n_bytes: int) -> int:
    if n_bytes > MAX_MEMORY_BYTES:
        shown = text if len(str(text)) <= 24 else f"{str(text)[:20]}..."
        raise AutofitError(f"memory size {shown!r} is larger than any device (more than 1 PiB): check --memory")
    return n_bytes


def finite(name: str, value: object, lo: float | None = None, hi: float | None = None, *,
           above: bool = False) -> float:
    """``value`` as a float, finite and within ``[lo, hi]`` (``(lo, hi]`` with ``above``); else one
    :class:`AutofitError` naming ``name``. NaN and infinities never pass (``nan < 0`` is False)."""
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if number is None:
        try:
            number = float(str(value))
        except ValueError:
            raise AutofitError(f"{name} must be a number, but got {value!r}") from None
    number = float(number)
    low_ok = lo is None or (number > lo if above else number >= lo)
    if not math.isfinite(number) or not low_ok or (hi is not None and number > hi):
        low = "" if lo is None else f" {'>' if above else '>='} {lo:g}"
        high = "" if hi is None else f"{' and' if low else ''} <= {hi:g}"
        raise AutofitError(f"{name} must be a finite number{low}{high}, but got {value!r}")
    return number


def seconds_from_env(name: str, default: float) -> float:
    """The environment variable ``name`` as a finite positive number of seconds, ``default`` where it is unset or
    empty; anything else is one :class:`AutofitError` naming it."""
    text = os.environ.get(name, "").strip()
    return default if not text else finite(name, text, 0, above=True)


def whole(name: str, value: object, lo: int = 1, hi: int | None = None, *, or_none: bool = False) -> int:
    """``value`` an int (not a bool) within ``[lo, hi]``; else one :class:`AutofitError` naming ``name``."""
    shown = value if len(repr(value)) <= 24 else f"{repr(value)[:20]}..."
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise AutofitError(f"{name} must be an integer >= {lo}{' or None' if or_none else ''}, but got {name}={shown}")
    if hi is not None and value > hi:
        raise AutofitError(f"{name} must be at most {hi}, but got {name}={shown}")
    return value


def format_bytes(n_bytes: float) -> str:
    """Binary units, three significant digits: 1610612736 -> '1.50 GiB'."""
    sign = "-" if n_bytes < 0 else ""
    value = abs(float(n_bytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
