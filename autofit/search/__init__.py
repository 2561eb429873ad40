"""``autofit run``: the search, as a package of small parts.

- :mod:`~autofit.search.records`: what a search records (``TrialRecord``, ``SearchResult``);
- :mod:`~autofit.search.settings`: its knobs (``SearchSettings``);
- :mod:`~autofit.search.policy`: what to probe next and when to stop (pure);
- :mod:`~autofit.search.study`: the Optuna study (open, resume, record a probe, read back);
- :mod:`~autofit.search.verify`: verification of the winner and close runners-up;
- :mod:`~autofit.search.advice`: what to say when nothing fits;
- :mod:`~autofit.search.driver`: ``run_search``, the short loop over those, with a pluggable ``prober``.
"""

from __future__ import annotations

from autofit.search.driver import Prober, SearchEvent, run_search, subprocess_prober
from autofit.search.records import SearchResult, TrialRecord
from autofit.search.settings import SearchSettings
from autofit.search.study import DEFAULT_STORAGE

__all__ = [
    "DEFAULT_STORAGE",
    "Prober",
    "SearchEvent",
    "SearchResult",
    "SearchSettings",
    "TrialRecord",
    "run_search",
    "subprocess_prober",
]
