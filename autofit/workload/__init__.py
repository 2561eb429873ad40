"""The workload: the type a user's entry point returns (:class:`Workload`, :mod:`~autofit.workload.types`) apart from
its loaders: entry points (:mod:`~autofit.workload.entry`), Hugging Face models (:mod:`~autofit.workload.hf`) and the
sources a result depends on (:mod:`~autofit.workload.sources`)."""

from __future__ import annotations

from autofit.workload.types import Workload

__all__ = ["Workload"]
