"""Verification: a config wins only after a probe of its own confirms it fits and is fast.

The best measured config is probed again, and so are runners-up measured within
``contender_within`` of it (one probe on a shared machine can be that far off). Of those that run
again within the margin, the one with the higher mean over its probes wins. A config that does not
verify is dropped and the next best tried, up to ``max_verifications`` configs.
"""

from __future__ import annotations

from collections.abc import Callable

from autofit.core.config import Config
from autofit.tuner.records import TrialRecord, mean_samples, measured_leaders
from autofit.tuner.settings import SearchSettings


def contenders(records: list[TrialRecord], tried: set[str], settings: SearchSettings) -> list[Config]:
    """The next round's configs: the best measured not yet tried and the runners-up close to it."""
    leaders = [c for c in measured_leaders(records) if c.key() not in tried]
    if not leaders:
        return []
    lead = mean_samples(records, leaders[0])
    close = [
        c for c in leaders[1 : settings.contenders]
        if mean_samples(records, c) >= (1.0 - settings.contender_within) * lead
    ]
    return ([leaders[0]] + close)[: settings.max_verifications - len(tried)]


def verify(
    records: list[TrialRecord],
    probe: Callable[[Config], TrialRecord],
    settings: SearchSettings,
    on_round_failed: Callable[[], None] = lambda: None,
    has_time: Callable[[Config], bool] = lambda config: True,
) -> TrialRecord | None:
    """The winner's verification probe, or None when no leader verifies.

    ``probe(config)`` runs a verification probe and appends its record to ``records``; a config that an
    earlier run of the study already verified is not probed again. ``on_round_failed`` is called when a
    round verified nothing (the driver recalibrates: the failed probes say something). ``has_time(config)``: whether
    a verification probe of ``config`` would finish within the search's time budget; the first one runs whatever
    it says (the search kept time for it), a later one only where it does.
    """
    tried: set[str] = set()
    probed = False
    while len(tried) < settings.max_verifications:
        round_configs = contenders(records, tried, settings)
        if not round_configs:
            return None
        for config in round_configs:
            tried.add(config.key())
            if any(r.phase == "verify" and r.config.key() == config.key() for r in records):
                continue
            if not probed or has_time(config):
                probe(config)
                probed = True
        verified = [r for r in records if r.phase == "verify" and r.within_margin and r.config.key() in tried]
        if verified:
            return max(verified, key=lambda r: (mean_samples(records, r.config), r.number))
        on_round_failed()
    return None
