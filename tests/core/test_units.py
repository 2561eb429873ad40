"""Byte sizes as users type them."""

from __future__ import annotations

import pytest

from autofit.core.errors import AutofitError
from autofit.core.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("800MiB", 800 * 2**20),
        ("512KiB", 512 * 2**10),
        ("1TiB", 2**40),
        ("2GB", 2 * 10**9),
        ("2gib", 2 * 2**30),
        (" 2 GiB ", 2 * 2**30),
        ("4096", 4096),
        ("4096B", 4096),
        (".5GiB", 2**29),
        (1234, 1234),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "two GiB", "2 GiBs", "2XB", "-1GiB", "0GiB", "0", "0.5", "1e9", "1,5GiB", 0, -5, True]
)
def test_parse_bytes_refuses_bad_input_naming_it(text):
    with pytest.raises(AutofitError) as info:
        parse_bytes(text)
    assert repr(text) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("n_bytes", [1, 1023, 2**20, 3 * 2**29, 80 * 2**30, 3 * 2**40])
def test_format_bytes_round_trips_within_its_precision(n_bytes):
    text = format_bytes(n_bytes).replace(" ", "")
    assert abs(parse_bytes(text) - n_bytes) <= 0.005 * n_bytes


def test_format_bytes_picks_binary_units():
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(-(2**20)).startswith("-")
