"""Click types for the numbers the commands take: finite, within bounds (:func:`autofit.core.units.finite`).
click's ``FloatRange`` lets NaN through (``nan < 0`` is False), which an endless ``--idle-exit nan`` shows."""

from __future__ import annotations

from typing import Any

import click

from autofit.core.errors import AutofitError
from autofit.core.units import finite


class FiniteFloat(click.ParamType):
    """A finite float in ``[lo, hi]`` (``(lo, hi]`` with ``above``); NaN and infinities are usage errors."""

    name = "float"

    def __init__(self, lo: float | None = None, hi: float | None = None, *, above: bool = False) -> None:
        self.lo, self.hi, self.above = lo, hi, above

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            number = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
        try:
            return finite(param.opts[0] if param else "value", number, self.lo, self.hi, above=self.above)
        except AutofitError as exc:
            self.fail(str(exc), param, ctx)


#: seconds a command waits (a probe's timeout): finite and > 0
SECONDS = FiniteFloat(0.0, above=True)


class Duration(FiniteFloat):
    """Seconds, written plainly (``600``) or with a unit: ``s``, ``m`` (minutes) or ``h`` (``90s``, ``10m``, ``1.5h``);
    finite and > 0."""

    name = "duration"
    UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}

    def __init__(self) -> None:
        super().__init__(0.0, above=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, str):
            text = value.strip()
            scale = self.UNITS.get(text[-1:].lower())
            try:
                value = float(text[:-1]) * scale if scale else float(text)
            except ValueError:
                self.fail(f"{value!r} is not a duration (seconds, or with s, m or h: 90s, 10m, 1.5h)", param, ctx)
        return super().convert(value, param, ctx)


#: a time budget (``--time-budget 10m``)
DURATION = Duration()
