"""Script mode: search a config for an unmodified DeepSpeed training script.

``autofit run --script "python train.py --deepspeed_config {config}"`` has no entry point to trace
or to run in its own probe. DeepSpeed's autotuning section (what ``deepspeed --autotuning`` uses,
deepspeed/autotuning/autotuner.py) makes the script measure itself:

- :mod:`~autofit.script.profile`: a model-info run (``"model_info": {"profile": true}``: the engine
  counts the parameters, measures one forward's activation memory and exits) and a metric run (the
  flops profiler's FLOPs) give the cost model its :class:`~autofit.cost_model.ModelFacts`, and
  :func:`~autofit.script.profile.script_plan` the :class:`~autofit.planning.plan.Plan` of what a script can be
  told through its JSON;
- :mod:`~autofit.script.prober`: each candidate's JSON with ``start_profile_step``/``end_profile_step``
  and a ``metric_path``: the engine times those steps, writes its metric file and ends the script;
- :mod:`~autofit.script.runner` starts the script's ranks and :mod:`~autofit.script.tree` measures
  their memory from outside (the RSS of each rank's process tree on the CPU, NVML per process on CUDA).
"""

from __future__ import annotations

from autofit.script.command import ScriptCommand
from autofit.script.prober import script_prober
from autofit.script.profile import ScriptProfile, profile_script, script_plan

__all__ = ["ScriptCommand", "ScriptProfile", "profile_script", "script_plan", "script_prober"]
