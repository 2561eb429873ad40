"""One probe rank, in its own process: ``python -m autofit.probe.worker SPEC.json``.

The parent (:mod:`autofit.probe.launch`) writes SPEC.json and sets RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. This process loads the
workload, builds the model, runs warm-up and measured DeepSpeed steps, and writes
``rank<R>.json`` (status, peak, step times, phase times) into the spec's
``result_dir``. It never prints its result on stdout: DeepSpeed logs there.

Memory follows DESIGN.md. CPU: ``VmHWM - VmRSS`` after the imports, the
high-water mark reset after them, and a watchdog that ends the process with
``oom`` once RSS passes the budget. CUDA: ``max_memory_reserved`` after a reset,
plus the CUDA context.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_T_MAIN = time.time()  # before any heavy import: the end of "process start"


def main(argv: list[str]) -> int:
    _die_with_parent()
    spec = json.loads(Path(argv[1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    out = Path(spec["result_dir"]) / f"rank{rank}.json"
    phases: dict[str, float] = {"process_start_s": max(0.0, _T_MAIN - float(spec["spawn_time"]))}
    state: dict[str, Any] = {"rank": rank, "phases_s": phases, "step_times_s": [], "peak_bytes": 0}
    try:
        if spec["mode"] == "fake":
            from autofit.probe.fake import run_fake

            state |= run_fake(spec, phases)
        else:
            state |= _run_real(spec, rank, phases, out)
        state.setdefault("status", "ok")
    except BaseException as exc:  # everything the user's code or DeepSpeed raises becomes a result
        state |= classify_exception(exc)
        state["traceback"] = traceback.format_exc()[-4000:]
    write_result(out, state)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: DeepSpeed/gloo atexit hooks can hang once a peer is gone
    os._exit(0)


def classify_exception(exc: BaseException) -> dict[str, Any]:
    """``oom`` for an allocator failure (CUDA or CPU), ``error`` otherwise; the message is one line."""
    name = type(exc).__name__
    text = str(exc).strip().splitlines()
    last = text[-1] if text else ""
    message = f"{name}: {last}" if last else name
    if name == "OutOfMemoryError" or "can't allocate memory" in str(exc) or "out of memory" in str(exc).lower():
        return {"status": "oom", "message": message[:500]}
    return {"status": "error", "message": message[:500]}


def write_result(path: Path, state: dict[str, Any]) -> None:
    """Write atomically, so the parent never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the parent dies (no probe outlives its search)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)
    except OSError:
        pass


def _run_real(spec: dict[str, Any], rank: int, phases: dict[str, float], out: Path) -> dict[str, Any]:
    t0 = time.time()
    import deepspeed
    import torch

    try:  # part of the baseline when installed (DESIGN.md: ~120 MB of RSS on import)
        import bitsandbytes  # noqa: F401
    except ImportError:
        pass
    from autofit.apply import apply_to_model, client_optimizer
    from autofit.config import Config
    from autofit.probe import memory
    from autofit.workload import load_workload

    config = Config.from_dict(spec["config"])
    ds = spec["deepspeed"]
    workload = load_workload(spec["entry"])
    # building once on the meta device imports what the model's code imports lazily
    # (transformers loads its modeling modules on first use): imports, not training memory
    with torch.device("meta"):
        workload.build_model(attention=config.attention)
    phases["imports_s"] = time.time() - t0
    out_extra = {"tokens_per_sample": workload.tokens_per_sample}

    cuda = spec["kind"] == "cuda"
    baseline_bytes = 0
    watchdog = None
    context_bytes = 0
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        context_bytes = _cuda_context_bytes(torch, local_rank)
        torch.cuda.reset_peak_memory_stats()
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        baseline_bytes = memory.rss_bytes()
        memory.reset_peak()
        budget = spec.get("budget_bytes")

        def on_exceeded(used: int) -> None:
            write_result(
                out,
                {
                    "rank": rank,
                    "status": "oom",
                    "peak_bytes": used,
                    "phases_s": phases,
                    "step_times_s": [],
                    "message": f"rank {rank}: resident memory {used} B passed the budget {budget} B",
                },
            )
            os._exit(0)

        watchdog = memory.RssWatchdog(baseline_bytes, budget, on_exceeded).start()

    def peak_now() -> int:
        if cuda:
            return int(torch.cuda.max_memory_reserved()) + context_bytes
        return max(memory.hwm_bytes(), watchdog.max_rss_bytes if watchdog else 0) - baseline_bytes

    t0 = time.time()
    model = workload.build_model(attention=config.attention)
    n_ckpt = apply_to_model(model, ds, workload.repeated_layers(model))
    phases["model_build_s"] = time.time() - t0

    t0 = time.time()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = client_optimizer(params, ds)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer, config=ds)
    phases["initialize_s"] = time.time() - t0

    dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
    batch = to_device(workload.batch(config.micro_batch_size), device, dtype)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def train_step() -> tuple[float, float]:
        """One optimizer step: seconds in all, and seconds of the optimizer's own ``engine.step``."""
        nonlocal loss
        sync()
        t0 = time.perf_counter()
        optimizer_s = 0.0
        for _ in range(config.grad_accum_steps):
            loss = workload.compute_loss(engine, batch)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:
                sync()
                t_opt = time.perf_counter()
            engine.step()
            if boundary:
                sync()
                optimizer_s += time.perf_counter() - t_opt
        sync()
        return time.perf_counter() - t0, optimizer_s

    loss = None
    t_steps = time.time()
    for _ in range(spec["warmup_steps"]):
        train_step()
    if not cuda:
        # the peak is read under the probe's allocator setting, then glibc goes back to reusing freed
        # blocks and one more step refills its heap before the timed ones
        train_step()
        peak = peak_now()
        if watchdog:
            watchdog.stop()
        if memory.use_default_allocator():
            train_step()
    step_times: list[float] = []
    optimizer_times: list[float] = []
    for _ in range(spec["steps"]):
        step_s, optimizer_s = train_step()
        step_times.append(step_s)
        optimizer_times.append(optimizer_s)
    phases["steps_s"] = time.time() - t_steps
    if cuda:
        peak = peak_now()
    return {
        "status": "ok",
        "peak_bytes": int(peak),
        "step_times_s": step_times,
        "step_time_s": statistics.median(step_times) if step_times else 0.0,
        "optimizer_time_s": statistics.median(optimizer_times) if optimizer_times else 0.0,
        "context_bytes": context_bytes,
        "n_checkpointed": n_ckpt,
        "loss": float(loss.detach().float().item()),
    } | out_extra


def _cuda_context_bytes(torch: Any, device_index: int) -> int:
    """Device memory this process holds outside PyTorch's caching allocator (the CUDA context).

    NVML's per-process figure when available; else ``total - free`` right after the
    context is created, which assumes the GPU is otherwise idle.
    """
    free, total = torch.cuda.mem_get_info(device_index)  # creates the context
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory) - int(torch.cuda.memory_reserved(device_index))
    except Exception:  # no NVML, or no per-process accounting in a container
        pass
    return int(total - free) - int(torch.cuda.memory_reserved(device_index))


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
