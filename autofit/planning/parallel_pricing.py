"""A large plan's candidates priced in forked processes (:func:`priced_in_parallel`), as the cut traces are
(:mod:`autofit.trace.parallel`): each candidate's price is a function of the candidate and the plan alone, so the
processes hand back what this one would have made.

The candidates are dealt out by group (:func:`dealt`), a group whole to one process: a group is one
:func:`~autofit.cost_model.allocation_sequence.reserve_key`'s candidates, whose allocator replay is then made once, as
in one process, and whose twins priced alike (:meth:`~autofit.cost_model.facts.ModelFacts.kernels_priced_as_sdpa`) are
priced together. Each process
hands back its predictions and the reserves it replayed, which join the plan's own (:func:`reserve_memo`), so the
reserve cache keeps them as it keeps this process's (:mod:`autofit.planning.reserve_cache`).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from autofit.core.config import Config
from autofit.cost_model import ModelFacts, Prediction
from autofit.cost_model.allocation_sequence import reserve_memo
from autofit.trace.parallel import FORK_FAILURES, forked_map, trace_workers

#: fewer candidates than this are priced in this process: forking and handing the predictions back cost about what
#: they save at this size (docs/results/planning.md, "Priced in bulk")
MIN_PARALLEL_CANDIDATES = 5_000

#: what the forked processes price: (the candidates, the pricing function, the facts whose reserves they replay)
_FORKED: list[Any] = []


def priced_in_parallel(configs: Sequence[Config], price: Callable[[Config], Prediction], group: Callable[[Config], Hashable],
                       facts: ModelFacts) -> list[Prediction] | None:
    """``price`` of each of ``configs``, in order, made by :func:`~autofit.trace.parallel.trace_workers` forked
    processes, each pricing whole ``group``\\ s (:func:`dealt`); the reserves they replayed added to ``facts``' memo.
    None where it is not worth it (fewer than :data:`MIN_PARALLEL_CANDIDATES` candidates, one process) or a process
    could not be forked or died: the caller prices them itself (the same predictions, slower)."""
    workers = trace_workers() if len(configs) >= MIN_PARALLEL_CANDIDATES else 1
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return None
    hands = dealt(configs, group, workers)
    memo = reserve_memo(facts)
    _FORKED[:] = [configs, price, facts]
    try:
        handed = forked_map(_priced_hand, hands, workers)
    except FORK_FAILURES:  # priced in this process
        return None
    finally:
        _FORKED.clear()
    by_index: dict[int, Prediction] = {}
    for hand, (priced, replayed) in zip(hands, handed, strict=True):
        by_index.update(zip(hand, priced, strict=True))
        memo.update(replayed)
    return [by_index[index] for index in range(len(configs))]


def dealt(configs: Sequence[Config], group: Callable[[Config], Hashable], hands: int) -> list[list[int]]:
    """The indices of ``configs`` dealt into ``hands`` lists, each ``group`` whole in one, the largest groups first
    each to the hand with the fewest (so the processes end together); each hand in the candidates' order."""
    groups: dict[Hashable, list[int]] = {}
    for index, config in enumerate(configs):
        groups.setdefault(group(config), []).append(index)
    dealt_hands: list[list[int]] = [[] for _ in range(hands)]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(dealt_hands, key=len).extend(members)
    return [sorted(hand) for hand in dealt_hands if hand]


def _priced_hand(hand: list[int]) -> tuple[list[Prediction], dict[tuple[object, ...], int]]:
    """In a forked process: the predictions of ``hand``'s candidates, and the reserves replayed meanwhile."""
    configs, price, facts = _FORKED
    memo = reserve_memo(facts)
    before = set(memo)
    priced = [price(configs[index]) for index in hand]
    return priced, {key: value for key, value in memo.items() if key not in before}
