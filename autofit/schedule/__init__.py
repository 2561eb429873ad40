"""Scheduling searches on many machines over Optuna's storage (``autofit schedule``, ``worker``, ``results``).

- :mod:`~autofit.schedule.store`: the claim table and the workers table beside Optuna's, on one URL;
- :mod:`~autofit.machine.fingerprint`: workload, machine and request fingerprints (the cache key);
- :mod:`~autofit.schedule.queue`: add (or find cached), claim atomically, heartbeat, finish;
- :mod:`~autofit.schedule.submit`: a request from ``schedule add``'s options;
- :mod:`~autofit.schedule.worker`: the worker loop around :func:`autofit.tuner.run_search`;
- :mod:`~autofit.schedule.status`: ``schedule list``;
- :mod:`~autofit.schedule.results`: winners across hardware, priced, as a table and a chart.

A search is an Optuna study (SQLite on one machine, PostgreSQL across machines).
"""

from __future__ import annotations
