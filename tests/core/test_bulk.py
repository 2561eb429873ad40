"""paused_gc: the cyclic collector off inside, as it was after; what it would have freed is freed after."""

from __future__ import annotations

import gc
import weakref

from autofit.core.bulk import paused_gc


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_the_collector_is_off_inside_and_as_it_was_after() -> None:
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outermost turns it back on
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # off before: off after
    finally:
        gc.enable()


def test_a_cycle_made_inside_is_freed_after_and_an_error_still_restores() -> None:
    with paused_gc():
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
    gc.collect()
    assert alive() is None
    try:
        with paused_gc():
            raise KeyError("inside")
    except KeyError:
        pass
    assert gc.isenabled()
