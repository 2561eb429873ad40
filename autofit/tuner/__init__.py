"""``autofit run``: the search, as a package of small parts.

- :mod:`~autofit.tuner.records`: what a search records (``TrialRecord``, ``SearchResult``);
- :mod:`~autofit.tuner.settings`: its knobs (``SearchSettings``);
- :mod:`~autofit.tuner.policy`: what to probe next and when to stop (pure);
- :mod:`~autofit.tuner.study`: the Optuna study (open, resume, record a probe, read back);
- :mod:`~autofit.tuner.verify`: verification of the winner and close runners-up;
- :mod:`~autofit.tuner.advice`: what to say when nothing fits;
- :mod:`~autofit.tuner.driver`: ``run_search``, the short loop over those, with a pluggable ``prober``.
"""

from __future__ import annotations

from autofit.tuner.driver import Prober, SearchEvent, run_search, subprocess_prober
from autofit.tuner.records import SearchResult, TrialRecord
from autofit.tuner.settings import SearchSettings
from autofit.tuner.study import DEFAULT_STORAGE

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
