"""``autofit estimate`` and ``autofit.estimate``: price every candidate with the cost model; no training step runs.

The command calls :func:`estimate_target` with the :class:`Target` its options make; :func:`estimate` makes the same
:class:`Target` from its keywords (:mod:`autofit.commands.options`) and calls it too, so the two cannot drift.
"""

from __future__ import annotations

from autofit.commands.options import Options, model_entry, takes_options
from autofit.planning.estimate import EstimateResult
from autofit.planning.estimate import estimate as price_candidates
from autofit.planning.target import Target, prepare
from autofit.workload.types import Workload


def estimate_target(target: Target, workload: Workload | None = None) -> EstimateResult:
    """``autofit estimate``: trace the model once and price every candidate of the space (no training step);
    ranked, fitting first (:func:`autofit.planning.estimate.estimate`). ``workload``: a :class:`Workload` object used
    instead of loading ``target.entry`` (:func:`autofit.planning.target.prepare`)."""
    return price_candidates(prepare(target, workload).plan())


@takes_options()
def estimate(model: str | Workload, options: Options) -> EstimateResult:
    """Price every candidate of the space with the cost model; no training step runs (``autofit estimate``).

    The options are keywords (``hardware="cpu", memory="2GiB", global_batch=16, set={"zero_stage": 2}, lr=3e-4``,
    ...): each field of the sections of :mod:`autofit.commands.options` (``DeviceOptions``, ``SearchOptions``,
    ``ModelOptions``, ``RecipeOptions``), with the commands' defaults; the function receives them as one
    ``Options``.

    :param model: an entry point (``"path/to/file.py:function"``, ``"package.module:function"``), an ``"hf:"``
        config, or a :class:`autofit.Workload` object, priced in this process (no kernel-footprint subprocess).
    :returns: every candidate with its predicted peak memory and step time, fitting first, fastest first
        (:class:`autofit.planning.estimate.EstimateResult`; ``.fitting[0].deepspeed`` is the best one's DeepSpeed
        dict).
    """
    entry, workload = model_entry(model)
    return estimate_target(options.target(entry), workload)
