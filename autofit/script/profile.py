"""What the cost model knows about a script's model, from DeepSpeed's own profile; the plan of a script search.

A script's model cannot be traced (autofit never sees it), so its :class:`~autofit.cost_model.ModelFacts`
come from what DeepSpeed's autotuner measures (deepspeed/autotuning/autotuner.py,
``model_info_profile_run``), run on the script itself:

- a model-info run per activation dtype: ``num_params``, ``trainable_num_params`` and
  ``activation_mem_per_gpu``, the memory one forward of the smallest micro-batch allocates
  (``get_accelerator().memory_allocated()`` around the forward: the process RSS on the CPU);
- a metric run: the flops profiler counts the forward's FLOPs at the first profiled step, DeepSpeed
  takes x3 for forward and backward, and the metric file has ``FLOPS_per_gpu`` over ``latency``.

What a profile cannot say is bounded, not guessed: the largest tensor and the largest module are taken
as the whole model (ZeRO-3 gathers and per-tensor optimizer scratch priced at most), Adafactor's
factored state as full size. The peak of a forward and backward is the forward's activations plus
the gradients (the trace's ``peak_with_grads``, at most). No layers: the checkpoint ratio is not priced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autofit.core.config import WORKING_BYTES, Config
from autofit.core.errors import AutofitError
from autofit.core.hardware import Hardware
from autofit.core.recipe import Recipe, for_plain_deepspeed, narrow_space
from autofit.core.software import Software
from autofit.core.space import SearchSpace, enumerate_candidates
from autofit.cost_model import Coefficients, ModelFacts
from autofit.cost_model.facts import ActivationProfile, PeakPoint
from autofit.ds.emit import deepspeed_config, uses_client_optimizer
from autofit.machine.software import detect_software
from autofit.planning.plan import Plan, default_recipe
from autofit.script.command import ScriptCommand, with_metric, with_model_info_profile
from autofit.script.records import DeepSpeedMetric, ModelInfo, read_deepspeed_file
from autofit.script.runner import run_script

#: the attention kernel a script's facts are filed under (a script's model takes no attention keyword)
ATTENTION = "sdpa"


@dataclass(frozen=True)
class ScriptProfile:
    """DeepSpeed's model-info profile of a script, and the FLOPs of one sample."""

    n_params: int
    """``num_params``: every parameter the engine saw."""
    n_trainable_params: int
    """``trainable_num_params``."""
    micro_batch_size: int
    """The micro-batch the activation memory was measured at."""
    activation_bytes: dict[str, int]
    """``activation_mem_per_gpu`` by activation dtype (``fp32``, ``bf16``)."""
    flops_per_sample: float
    """Forward and backward FLOPs of one sample (the flops profiler's forward count x3)."""

    def facts(self, name: str) -> ModelFacts:
        """The profile as the cost model's :class:`ModelFacts` (bounds where the profile says nothing)."""
        profiles = {}
        for dtype, activations in self.activation_bytes.items():
            grads = WORKING_BYTES[dtype] * self.n_trainable_params
            point = PeakPoint(micro_batch_size=self.micro_batch_size, peak_with_grads_bytes=activations + grads,
                              peak_without_grads_bytes=activations, activation_bytes=activations, grad_bytes=grads,
                              flops=int(self.flops_per_sample * self.micro_batch_size))
            profiles[ActivationProfile.key(dtype, ATTENTION, False)] = ActivationProfile(
                dtype=dtype, attention=ATTENTION, checkpointed=False, points=(point,))
        return ModelFacts(
            name=name, n_params=self.n_params, n_trainable_params=self.n_trainable_params, n_layers=0,
            layer_params=(), largest_module_params=self.n_params, largest_param_numel=self.n_trainable_params,
            n_small_params=0, factored_state_numel=self.n_trainable_params, n_param_tensors=1, n_persistent_params=0,
            buffer_bytes=0, tokens_per_sample=None, profiles=profiles, trace_mode="deepspeed-profile",
        )


def profile_script(command: ScriptCommand, candidates: list[Config] | tuple[Config, ...], hardware: Hardware,
                   world_size: int, workdir: Path, timeout_s: float = 600.0,
                   software: Software | None = None) -> ScriptProfile:
    """Run the script's model-info profile for each activation dtype the candidates use, and one metric run
    (``software``: what the machine runs, for the JSONs; this one's by default)."""
    workdir.mkdir(parents=True, exist_ok=True)
    info: ModelInfo | None = None
    activation: dict[str, int] = {}
    for dtype in sorted({c.trace_dtype for c in candidates}):
        base = profile_config(candidates, dtype)
        path = workdir / f"model_info_{dtype}.json"
        _run(command, with_model_info_profile(deepspeed_config(base, world_size, hardware.kind, software), path), workdir,
             f"model_info_{dtype}", world_size, hardware, timeout_s)
        info = ModelInfo.from_json(_read(path, "model-info profile"))
        activation[dtype] = info.activation_mem_per_gpu
    base = profile_config(candidates, min(activation))
    path = workdir / "metric_profile.json"
    _run(command, with_metric(deepspeed_config(base, world_size, hardware.kind, software), path, 1, 1), workdir, "metric",
         world_size, hardware, timeout_s)
    metric = DeepSpeedMetric.from_json(_read(path, "metric"))
    flops_per_micro = metric.FLOPS_per_gpu * metric.step_time_s / base.grad_accum_steps
    if info is None:
        raise AutofitError("a script profile needs at least one candidate")
    return ScriptProfile(n_params=info.num_params, n_trainable_params=info.trainable_num_params,
                         micro_batch_size=base.micro_batch_size, activation_bytes=activation,
                         flops_per_sample=flops_per_micro / base.micro_batch_size)


def profile_config(candidates: list[Config] | tuple[Config, ...], dtype: str) -> Config:
    """The candidate a profile runs: of ``dtype``, the smallest micro-batch, the lowest ZeRO stage (a forward
    without parameter gathering), no offload."""
    of_dtype = [c for c in candidates if c.trace_dtype == dtype]
    return min(of_dtype, key=lambda c: (c.micro_batch_size, c.zero_stage, c.offload_optimizer != "none",
                                        c.offload_params != "none", c.optimizer != "adamw", c.precision))


def _run(command: ScriptCommand, ds: dict[str, Any], workdir: Path, name: str, world_size: int, hardware: Hardware,
         timeout_s: float) -> None:

    config_path = workdir / f"{name}.json"
    config_path.write_text(json.dumps(ds, indent=2))
    budget = hardware.memory_bytes if hardware.kind == "cpu" else None
    run = run_script(command, config_path, workdir, world_size, hardware.kind, timeout_s, budget)
    if run.over_budget or run.timed_out or any(code != 0 for code in run.returncodes):
        why = "passed the memory budget" if run.over_budget else "timed out" if run.timed_out else "failed"
        lines = [line for line in run.log_tails[0].splitlines() if line.strip()]
        raise AutofitError(f"the script's {name} profile run {why}: {lines[-1].strip() if lines else 'no output'}")


def _read(path: Path, what: str) -> dict[str, Any]:
    data = read_deepspeed_file(path, what)
    if data is None:
        raise AutofitError(f"the script wrote no DeepSpeed {what} file ({path}): does it call deepspeed.initialize "
                           "with the JSON given as --deepspeed_config, and train through the engine?")
    return data


def script_plan(command: ScriptCommand, hardware: Hardware, space: SearchSpace, *, world_size: int = 1,
                global_batch: int | None = None, fixed: dict[str, Any] | None = None, workdir: Path,
                timeout_s: float = 600.0, software: Software | None = None, recipe: Recipe | None = None) -> Plan:
    """The plan of a script search: what a DeepSpeed JSON alone can change, priced from the script's profile.

    The checkpoint ratio is fixed at 0, ``compile`` at ``off`` and client optimizers and fp8 are left out (a
    script that does not call :mod:`autofit.ds.apply` ignores the JSON's ``autofit`` section), unless ``--set`` fixes them: then the
    script is taken to read that section. The attention kernel is the script's own. ``software``: what the
    machine runs (``--nvme-path`` included), this one's by default. The optimizer and precision are the
    ``recipe``'s (default: :func:`autofit.planning.plan.default_recipe`) and its allowed substitutes; its learning rate is
    required and nothing is written ``"auto"`` (:func:`autofit.core.recipe.for_plain_deepspeed`).
    """
    fixed = dict(fixed or {})
    software = software if software is not None else detect_software()
    recipe = for_plain_deepspeed(recipe if recipe is not None else default_recipe(hardware, fixed))
    space = narrow_space(space, recipe)
    enumeration = enumerate_candidates(space, hardware=hardware, world_size=world_size, global_batch=global_batch,
                                       fixed=SCRIPT_FIXED | fixed, searches_attention=False,
                                       software=software)
    candidates, rejected = [], list(enumeration.rejected)
    for config in enumeration.candidates:
        reason = script_cannot(config, hardware.kind, fixed)
        if reason is None:
            candidates.append(config)
        elif (partial := {"optimizer": config.optimizer, "precision": config.precision}, reason) not in rejected:
            rejected.append((partial, reason))
    if not candidates:
        raise AutofitError(f"no config of search space {space.name!r} can be given to a script through its JSON alone")
    facts = profile_script(command, candidates, hardware, world_size, workdir, timeout_s, software).facts(command.name)
    return Plan(entry=command.template, name=command.name, hardware=hardware, space=space, world_size=world_size,
                global_batch=global_batch, fixed=SCRIPT_FIXED | fixed, candidates=tuple(candidates),
                rejected=tuple(rejected), facts=facts, coefficients=Coefficients.for_hardware(hardware),
                software=software, recipe=recipe)


#: what a script that ignores the JSON's ``autofit`` section runs: no checkpointing, no engine.compile()
SCRIPT_FIXED: dict[str, Any] = {"checkpoint_ratio": 0.0, "compile": "off"}


def script_cannot(config: Config, device_kind: str, fixed: dict[str, Any]) -> str | None:
    """Why an unmodified script cannot run ``config`` from its JSON (None: it can)."""
    if "optimizer" not in fixed and uses_client_optimizer(config, device_kind):
        return "script mode: the JSON cannot name this optimizer here, and the script builds no client optimizer"
    if "precision" not in fixed and config.precision == "fp8":
        return "script mode: fp8 needs torchao's conversion (autofit.ds.apply) in the script"
    return None
