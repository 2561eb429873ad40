"""Bulk work on many small objects (a plan's tens of thousands of candidates, each with its prediction and DeepSpeed
JSON): Python's cyclic garbage collector paused while it runs.

The collector runs a pass each time 700 more container objects (dicts, lists, dataclass instances) are alive than
were; each third young pass promotes, and the oldest generation's passes walk every live container. Pricing a plan
makes a few dozen containers a candidate and keeps them all (the ranked list, the document), none in a cycle: the
passes find nothing to free and walk a heap that grows as they go. For Llama-3.1-8B on 8 H100 (93,024 candidates) a
warm plan's pricing takes 18 s with the collector and 8 s without (one run each on a shared 2-core machine). Reference
counting frees what it always frees; a cycle made meanwhile waits for the next pass after :func:`paused_gc` ends.

The same heap costs again at the interpreter's exit: its last collections walk everything still alive (torch's and a
model's objects and a plan's; docs/results/planning.md has what it cost); :func:`frozen_at_exit` skips that walk for a
command that is done.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic collector off inside, as it was after (nested: the outermost turns it back on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def frozen_at_exit() -> None:
    """At this process's exit, after the exit handlers registered later, the heap frozen (:func:`gc.freeze`): the
    interpreter's last collections skip what the command left alive instead of walking it to free it a moment
    before the process ends. Reference counting still frees at exit what it frees; what only the collector would free
    (objects in cycles) is left to the process's end, as its memory is: nothing of autofit's waits on a collection
    to be written (files are closed where they are written, stdout and stderr are flushed by the interpreter). Once a
    process however often it is called (a test's runner invokes the command line many times)."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
