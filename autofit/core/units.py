"""Byte sizes: parse what users type (``2GiB``, ``1.5GiB``, ``800MiB``) and print them back."""

from __future__ import annotations

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
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """``"1.5GiB"`` -> 1610612736. Decimal (GB) and binary (GiB) units; a bare number is bytes."""
    if isinstance(text, bool):
        raise AutofitError(f"memory size must be a number of bytes or a string such as 2GiB, but got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise AutofitError(f"memory size must be positive, but got {text!r}")
        return text
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise AutofitError(
            f"cannot parse memory size {text!r}: expected a number with a unit such as 2GiB, 1.5GiB, 800MiB"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if int(value) <= 0:  # also "0.5" (bytes): less than one byte is no budget
        raise AutofitError(f"memory size must be positive, but got {text!r}")
    return int(value)


def format_bytes(n_bytes: float) -> str:
    """Binary units, three significant digits: 1610612736 -> '1.50 GiB'."""
    sign = "-" if n_bytes < 0 else ""
    value = abs(float(n_bytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
