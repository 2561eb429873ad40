"""One probe rank, in its own process: ``python -m autofit.probe.rank.worker SPEC.json``.

The parent (:mod:`autofit.probe.launch`) writes SPEC.json (a :class:`~autofit.probe.records.ProbeSpec`, read back
here with :meth:`~autofit.probe.records.ProbeSpec.from_json`) and sets RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. This process loads the
workload, builds the model, runs warm-up and measured DeepSpeed steps, and writes
``rank<R>.json`` (status, peak, step times, phase times) into the spec's
``result_dir``. It never prints its result on stdout: DeepSpeed logs there.

Memory is metered by :mod:`autofit.probe.rank.meter` (docs/design.md, "Memory, measured"), steps are timed by
:mod:`autofit.probe.rank.steps`; this module is the driver.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from autofit.ds.apply import (
    LongContext,
    apply_to_model,
    build_context,
    causal_lm_loss,
    client_optimizer,
    compile_engine,
    hf_deepspeed_config_class,
    sequence_parallel_mpu,
    shard_batch,
)
from autofit.ds.tensor_parallel import tp_degree
from autofit.machine.lifetime import die_with_parent, parent_from_env
from autofit.probe.failure import classify_exception
from autofit.probe.rank import memory_history
from autofit.probe.rank.fake import run_fake
from autofit.probe.rank.meter import Meter
from autofit.probe.rank.steps import run_steps
from autofit.probe.records import ProbeSpec, RankResult, write_rank_result
from autofit.workload.entry import load_workload

_T_MAIN = time.time()  # before any heavy import: the end of "process start"
_PPID_AT_START = os.getppid()


def main(argv: list[str]) -> int:
    _die_with_parent()
    run_rank(Path(argv[1]), started_at=_T_MAIN)
    return 0  # not reached: run_rank ends the process


def run_rank(spec_path: Path, started_at: float, prepaid_bytes: int = 0) -> None:
    """Run the rank ``spec_path`` describes and write its result; ends the process. ``started_at``: when this
    process began to be this rank (its start, or its fork from the warm parent, :mod:`autofit.probe.rank.zygote`);
    ``prepaid_bytes``: resident bytes the warm parent made that a fresh rank makes after its memory baseline (its
    baseline is lowered by them)."""
    spec = ProbeSpec.from_json(json.loads(spec_path.read_text()))
    rank = int(os.environ.get("RANK", "0"))
    out = Path(spec.result_dir) / f"rank{rank}.json"
    phases: dict[str, float] = {"process_start_s": max(0.0, started_at - spec.spawn_time)}
    result: RankResult
    try:
        if spec.mode == "fake":
            result = run_fake(spec, rank, phases)
        else:
            result = _run_real(spec, rank, phases, out, prepaid_bytes)
    except BaseException as exc:  # everything the user's code or DeepSpeed raises becomes a result
        result = failure_result(rank, phases, exc, traceback.format_exc()[-4000:], _METERS[-1] if _METERS else None)
    write_rank_result(out, result)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: DeepSpeed/gloo atexit hooks can hang once a peer is gone
    os._exit(0)


#: the rank's meter once :func:`_run_real` made it: a failure reports the peak it reached
_METERS: list[Any] = []


def failure_result(rank: int, phases: dict[str, float], exc: BaseException, trace: str, meter: Any) -> RankResult:
    """The result of a rank that raised: why (:func:`autofit.probe.failure.classify_exception`) and the peak the
    meter saw before it (a CUDA out-of-memory held what it held, not 0). Where no meter ran yet, or it cannot be
    read, an out-of-memory's peak is unknown: 0 with the message saying so, never a measured 0."""
    failure = classify_exception(exc)
    peak, memory = 0, {}
    if meter is not None:
        try:
            peak, memory = int(meter.peak_bytes(final=True)), meter.report()
        except Exception:  # a broken CUDA context: the peak is unknown
            peak, memory = 0, {}
    if peak <= 0 and failure["status"] == "oom":
        failure["message"] = f"{failure['message']} (peak unknown: it failed before memory was metered)"
    return RankResult(rank=rank, phases_s=phases, traceback=trace, peak_bytes=max(peak, 0), device_memory=memory,
                      **failure)


def _die_with_parent() -> None:
    """SIGKILLed when the parent dies (no probe outlives its search): :func:`autofit.machine.lifetime.die_with_parent`,
    the parent being the launcher that passed ``AUTOFIT_PARENT_PID``, or under torch's elastic agent the parent seen
    at start."""
    parent = _PPID_AT_START if "TORCHELASTIC_RUN_ID" in os.environ else parent_from_env(_PPID_AT_START)
    die_with_parent(parent)


def _run_real(spec: ProbeSpec, rank: int, phases: dict[str, float], out: Path, prepaid_bytes: int = 0) -> RankResult:
    """Import, meter, build, initialize, step: the probe of one rank (docs/design.md, "Memory, measured")."""
    t0 = time.time()
    import deepspeed
    import torch


    config, ds = spec.config, spec.deepspeed
    workload = import_workload(spec.entry, config.attention, torch)
    phases["imports_s"] = time.time() - t0
    meter = _meter(torch, spec, rank, phases, out, prepaid_bytes)
    snapshot_path = spec.memory_snapshot if meter.cuda and rank == 0 else None
    if snapshot_path:
        memory_history.start_recording(torch)
    t0 = time.time()
    model, n_ckpt = _build_model(workload, config, ds)
    phases["model_build_s"] = time.time() - t0
    build_peak_bytes, param_elements = meter.peak_bytes(final=False), held_param_elements(model)

    t0 = time.time()
    engine, mpu = _initialize(deepspeed, model, ds)
    phases["initialize_s"] = time.time() - t0
    initialize_peak_bytes = meter.peak_bytes(final=False)

    dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
    if tp_degree(ds) > 1:  # a TP group trains on one micro-batch (the engine asserts it at the first forward, engine.py)
        torch.manual_seed(rank // tp_degree(ds))
    batch = to_device(workload.batch(config.micro_batch_size), meter.device, dtype)
    t_steps = time.time()
    times = run_steps(engine, loss_of(workload, engine, batch, ds, mpu), config.grad_accum_steps, meter, ds,
                      spec.warmup_steps, spec.steps)
    phases["steps_s"] = time.time() - t_steps
    if times.compile_s is not None:
        phases["compile_s"] = times.compile_s
    if snapshot_path:
        memory_history.dump(torch, snapshot_path)
    trains = math.isfinite(times.loss)
    return RankResult(
        rank=rank,
        status="ok" if trains else "error",
        message=None if trains else untrained_message(times.loss),
        phases_s=phases,
        peak_bytes=int(times.peak_bytes),
        step_times_s=list(times.step_times_s),
        step_time_s=times.step_time_s(),
        warmup_times_s=list(times.warmup_times_s),
        optimizer_time_s=times.optimizer_time_s(),
        loss=times.loss,
        device_memory=meter.report(),
        n_checkpointed=n_ckpt,
        optimizer_state_bytes=optimizer_state_bytes(engine.optimizer),
        tokens_per_sample=workload.tokens_per_sample,
        elastic_run_id=os.environ.get("TORCHELASTIC_RUN_ID"),  # set when torch.distributed.run started it
        build_peak_bytes=build_peak_bytes,
        initialize_peak_bytes=initialize_peak_bytes,
        param_elements=param_elements,
    )


def _meter(torch: Any, spec: ProbeSpec, rank: int, phases: dict[str, float], out: Path, prepaid_bytes: int = 0) -> Any:
    """The rank's :class:`~autofit.probe.rank.meter.Meter`, its baseline taken now (after the imports, less the
    ``prepaid_bytes`` a warm parent made for it); past a CPU budget it writes this rank's ``oom`` result and ends
    the process."""

    def on_exceeded(used: int) -> None:
        message = f"rank {rank}: resident memory {used} B passed the budget {spec.budget_bytes()} B"
        write_rank_result(out, RankResult(rank=rank, status="oom", oom_on="device", peak_bytes=used, phases_s=phases,
                                          message=message))
        os._exit(0)

    meter = Meter(torch, spec.hardware.kind, spec.budget_bytes(), on_exceeded,
                  device_budget_bytes=spec.hardware.memory_bytes, later_outside_bytes=spec.nccl_bytes,
                  prepaid_bytes=prepaid_bytes)
    _METERS.append(meter)
    return meter


def untrained_message(loss: float) -> str:
    """Why a run whose loss is not finite is no candidate: it does not train, whatever it measured."""
    return (f"the loss was {loss} at the last measured step: this config does not train (one cause under ZeRO-3: "
            "a transformers model made by its class's constructor inside zero.Init keeps uninitialised weights; "
            "build it with from_config, autofit.ds.apply.build_context)")


def import_workload(entry: str, attention: str, torch: Any) -> Any:
    """Load the workload and everything the probe imports, before the memory baseline is taken."""
    try:  # part of the baseline when installed (~120 MB of RSS on import; docs/design.md's baseline)
        import bitsandbytes  # noqa: F401
    except ImportError:
        pass

    workload = load_workload(entry)
    # building once on the meta device imports what the model's code imports lazily
    # (transformers loads its modeling modules on first use): imports, not training memory
    with torch.device("meta"):
        workload.build_model(attention=attention)
    hf_deepspeed_config_class()  # what build_context imports for a ZeRO-3 build
    return workload


def _build_model(workload: Any, config: Any, ds: dict[str, Any]) -> tuple[Any, int]:
    """The model with the candidate's checkpointing applied; returns it and its checkpointed layers.

    ZeRO-3 builds under ``deepspeed.zero.Init`` (:func:`autofit.ds.apply.build_context`), as a training
    script following the emitted JSON does: each rank holds its partition from the start.
    """

    with build_context(ds):
        model = workload.build_model(attention=config.attention)
    return model, apply_to_model(model, ds, workload.repeated_layers(model), workload.attention_of)


def held_param_elements(model: Any) -> int:
    """Parameter elements this rank holds: its ZeRO-3 partition (``ds_tensor``) where there is one."""
    return sum(int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else int(p.numel()) for p in model.parameters())


def _initialize(deepspeed: Any, model: Any, ds: dict[str, Any]) -> tuple[Any, Any]:
    """``deepspeed.initialize`` with the candidate's JSON, its client optimizer, if any, and under sequence
    parallelism the SP groups DeepSpeed's Ulysses attention registered (:func:`autofit.ds.apply.sequence_parallel_mpu`),
    then ``engine.compile()`` where the JSON says so; returns the engine and that ``mpu`` (None without SP)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = client_optimizer(model, ds)
    mpu = sequence_parallel_mpu(model, ds)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer, config=ds,
                                           mpu=mpu)
    compile_engine(engine, ds)  # lazy: the first step builds the graph (run_steps times it as compile_s)
    return engine, mpu


def loss_of(workload: Any, engine: Any, batch: Any, ds: dict[str, Any], mpu: Any) -> Any:
    """``() -> loss`` of one micro-batch: the workload's own, or under sequence parallelism this rank's shard of the
    batch (the SP group's, :func:`autofit.ds.apply.shard_batch`) and the loss aggregated over the group
    (:func:`autofit.ds.apply.causal_lm_loss`)."""

    if not LongContext.of(ds).own_loss:
        return lambda: workload.compute_loss(engine, batch)
    shard = shard_batch(batch, mpu)
    return lambda: causal_lm_loss(engine, shard, ds, mpu)


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer's own state tensors on this rank, each storage once: the torch optimizer under
    DeepSpeed's wrappers (``FP16_UnfusedOptimizer``, the ZeRO optimizers: each keeps it as ``.optimizer``)."""
    import torch

    seen: set[tuple[int, str]] = set()
    while getattr(optimizer, "optimizer", None) is not None and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    total = 0
    for state in getattr(optimizer, "state", {}).values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key = (storage.data_ptr(), str(value.device))
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
    return total


def to_device(batch: Any, device: Any, float_dtype: Any | None) -> Any:
    """Move every tensor of a (nested) batch to ``device``; cast floating tensors to ``float_dtype``."""
    import torch

    if isinstance(batch, torch.Tensor):
        if float_dtype is not None and batch.is_floating_point():
            return batch.to(device=device, dtype=float_dtype)
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device, float_dtype) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, float_dtype) for v in batch)
    return batch


if __name__ == "__main__":
    main(sys.argv)
