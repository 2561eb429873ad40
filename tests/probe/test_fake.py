"""Fake-mode pieces in process: the live-bytes tracker and the optimizer state table."""

from __future__ import annotations

import pytest
import torch

from autofit.probe.fake import LiveBytes, fake_device, optimizer_state_bytes


def test_tracker_counts_new_storages_once_and_frees_them() -> None:
    tracker = LiveBytes()
    with fake_device(tracker):
        a = torch.empty(1000)  # 4000 B
        b = a.view(10, 100).t()  # a view: no new storage
        assert tracker.total() == 4000
        c = a * 2
        assert tracker.total() == 8000
        del a, b  # the last references to the first storage
        assert tracker.total() == 4000
        del c
    assert tracker.total() == 0
    assert tracker.peak_bytes == 8000


def test_explicit_tags_survive_views_and_scale() -> None:
    tracker = LiveBytes()
    with fake_device(tracker):
        w = torch.nn.Parameter(torch.empty(10, 10))
        tracker.add(w, "params", scale=0.5)
        _ = w.t() @ w  # a view of w and a new activation
        assert tracker.live["params"] == 200
        assert tracker.live["activations"] == 400


@pytest.mark.parametrize(
    ("optimizer", "shape", "expected"),
    [
        ("adamw", (10, 20), 8 * 200),
        ("lion", (10, 20), 4 * 200),
        ("sgd", (7,), 28),
        ("adafactor", (10, 20), 4 * (10 + 20)),
        ("adafactor", (3, 10, 20), 4 * (30 + 60)),
        ("adafactor", (200,), 800),
        ("adamw8bit", (512,), 2 * 512 + 2 * 4 * 2),
    ],
)
def test_optimizer_state_bytes(optimizer: str, shape: tuple[int, ...], expected: int) -> None:
    assert optimizer_state_bytes(optimizer, shape) == expected
