"""The click types of the commands' numbers: a time budget with its unit, and what is refused."""

from __future__ import annotations

import click
import pytest

from autofit.commands.numbers import DURATION


@pytest.mark.parametrize(("text", "seconds"), [("600", 600.0), ("90s", 90.0), ("10m", 600.0), ("1.5h", 5400.0),
                                               (" 2M ", 120.0), (45.0, 45.0)])
def test_a_duration_reads_seconds_minutes_and_hours(text: object, seconds: float) -> None:
    assert DURATION.convert(text, None, None) == seconds


@pytest.mark.parametrize("text", ["abc", "10 minutes", "m", "nan", "infh", "0", "-5m", ""])
def test_a_duration_that_is_no_positive_finite_time_is_refused(text: str) -> None:
    with pytest.raises(click.BadParameter):
        DURATION.convert(text, None, None)
