"""``autofit ladder`` and ``autofit.ladder``: the build-along table of memory techniques, one added per rung.

The command calls :func:`ladder_target` with the :class:`Target` its options make; :func:`ladder` makes the same
:class:`Target` from its keywords (:mod:`autofit.commands.options`) and calls it too.
"""

from __future__ import annotations

from collections.abc import Callable

from autofit.commands.options import Options, model_entry, quiet, takes_options
from autofit.planning.ladder import Ladder, check_target, run_ladder
from autofit.planning.target import Target, prepare
from autofit.workload.entry import check_loadable
from autofit.workload.types import Workload


def ladder_target(target: Target, workload: Workload | None = None, *, measure: bool = False, steps: int = 3,
                  timeout_s: float = 600.0, say: Callable[[str], None] = quiet) -> Ladder:
    """``autofit ladder``: the build-along table of memory techniques (:func:`autofit.planning.ladder.run_ladder`),
    its demands on ``target`` (a global batch, no space) checked before anything is loaded or traced."""
    check_target(target)
    return run_ladder(prepare(target, workload, probes_here=measure), measure=measure, steps=steps, timeout_s=timeout_s, say=say)


@takes_options(without=("space",))
def ladder(model: str | Workload, options: Options, *, measure: bool = False, steps: int = 3,
           timeout_s: float = 600.0, say: Callable[[str], None] | None = None) -> Ladder:
    """The build-along table of memory techniques (``autofit ladder``): from fp32 + AdamW + ZeRO-0, one technique
    added per rung, each priced and, with ``measure``, probed.

    The options are :func:`autofit.estimate`'s keywords but ``space``: the ladder's rungs are its space.
    ``global_batch`` is required (the rungs' micro-batch is ``global_batch / world size``); ``set`` may fix the
    micro-batch, the accumulation or the attention, not what the rungs step through.

    :param model: an entry point, an ``"hf:"`` config or a :class:`autofit.Workload` object (not with
        ``measure=True``: a probe loads the model from an entry point).
    :param measure: probe every rung predicted to fit (real DeepSpeed steps, one subprocess each).
    :param steps: measured steps per probe.
    :param timeout_s: seconds for each probe.
    :param say: where progress lines go (``print`` shows them); None: nowhere.
    :returns: :class:`autofit.planning.ladder.Ladder`, one row per rung (``.rows``; ``.to_dict()`` is ``--json``'s).
    """
    entry, workload = model_entry(model)
    target = options.target(entry)
    if measure and target.entry is not None:
        check_loadable(target.entry, "ladder(measure=True)")
    return ladder_target(target, workload, measure=measure, steps=steps, timeout_s=timeout_s, say=say or quiet)
