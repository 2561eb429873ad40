"""The GPU check's grid: many configs of one model measured in one process, as raw data for the CPU to fit against.

    python -m benchmarks.gpu.gpu_check_grid --entry hf:M?seq_len=1024 --configs GRID.json --part ROWS.json \
        --history HISTORY.json.gz --deadline EPOCH_S

Run by ``benchmarks/gpu/gpu_check.py``'s ``grid`` step, one process per model. A probe of the product pays 15-30 s of
imports and model build around 2 s of steps (issue 49); here torch, DeepSpeed and the model's code are imported and
the model is built on the host once, and every config of the grid then gets a fresh copy of it (``copy.deepcopy`` of
the fp32 host model, converted by ``deepspeed.zero.Init(module=...)`` under ZeRO-3), its own
``deepspeed.initialize`` and steps, and is torn down (``engine.destroy()``, ``torch.cuda.empty_cache()``) before the
next. What is shared is said in each row: ``before`` holds what the process held when the config began (the CUDA
context, cuBLAS's workspace, what an earlier config leaked), so a fresh process's figure is ``context_bytes`` plus
the config's own growth.

Each config's row (written to ``--part`` as soon as it is measured, so a step cut at its limit keeps its rows):

- every step's seconds (no untimed warm-up: which steps are warm-up is for the reader to judge, issue 48), the
  optimizer's own seconds per step, the last loss;
- the caching allocator's ``max_memory_allocated`` and ``max_memory_reserved``, NVML's per-process peak, the
  allocator's counters (``torch.cuda.memory_stats``: segments, retries, splits) and its segments at the end
  (``torch.cuda.memory_snapshot``: size, pool, allocated bytes, blocks);
- with ``history``: every allocator event from the model's copy through the first :data:`HISTORY_STEPS` steps
  (``torch.cuda.memory._record_memory_history``, no stacks), compacted into ``--history`` (alloc, free, segment
  events with address and size): the allocation sequence an allocator model replays.

On the CPU (the dry run) the same loop runs on DeepSpeed's CPU accelerator and the memory fields are None.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.gpu.gpu_check_profiles import save, save_histories

#: steps whose allocator events a ``history`` row keeps (the peak is reached within the first two)
HISTORY_STEPS = 3
#: the allocator events a history keeps at most (PyTorch drops the oldest past it)
HISTORY_MAX_ENTRIES = 400_000
#: the exit status of a process that stopped because a config left tensors allocated (its caller starts another)
LEAKED = 3
#: a config is not started with fewer seconds than this left
MIN_LEFT_S = 15.0
#: the allocator's event names, written as their index
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "snapshot", "oom")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(key, value)
    t0 = time.time()
    import deepspeed
    import torch

    from autofit.probe.rank.worker import import_workload

    items = json.loads(Path(args.configs).read_text())
    workload = import_workload(args.entry, "sdpa", torch)
    found: dict[str, Any] = {"entry": args.entry, "imports_s": round(time.time() - t0, 2), "rows": [],
                             "cuda": torch.cuda.is_available()}
    if found["cuda"]:
        torch.cuda.set_device(0)
        found["context_bytes"] = context_bytes(torch)
    t0 = time.time()
    template = build_template(torch, workload) if any(i["config"]["zero_stage"] != 3 for i in items) else None
    found["template_build_s"] = round(time.time() - t0, 2)
    with torch.device("meta"):
        found["n_params"] = sum(p.numel() for p in workload.build_model(attention="sdpa").parameters())
    deepspeed.init_distributed(dist_backend="nccl" if found["cuda"] else "gloo", verbose=False)
    histories: dict[str, Any] = {}
    for item in items:
        label = item["label"]
        if time.time() > args.deadline - MIN_LEFT_S:
            found["rows"].append({"label": label, "status": "skipped", "message": "the step's time is spent"})
            continue
        row = measure_guarded(torch, deepspeed, workload, template, item, args.hidden_size, args.steps, histories)
        found["rows"].append(row)
        save(args.part, found)
        if args.history and label in histories:  # rewritten whole: a step cut at its limit keeps what it has
            save_histories(args.history, histories)
        print(f"grid: {label}: {row['status']} {row.get('summary', row.get('message', ''))}", flush=True)
        if found["cuda"] and torch.cuda.memory_allocated() > 0:
            # a config left tensors behind (ZeRO-3's engine keeps references destroy() does not drop): the next
            # config would start on them, so this process ends and the caller starts a fresh one for the rest
            found["leaked_after"] = {"label": label, "allocated_bytes": int(torch.cuda.memory_allocated())}
            save(args.part, found)
            sys.stdout.flush()
            os._exit(LEAKED)
    found["ok"] = all(r["status"] == "ok" for r in found["rows"])
    found["summary"] = f"{sum(r['status'] == 'ok' for r in found['rows'])} of {len(found['rows'])} configs ran"
    save(args.part, found)
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's and NCCL's atexit hooks are no part of the measurement


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entry", required=True)
    parser.add_argument("--configs", required=True, help="JSON list of {label, config, history, alloc_conf}.")
    parser.add_argument("--part", required=True, help="Where the rows go (rewritten after each).")
    parser.add_argument("--history", default=None, help="Where the allocator histories go (.json.gz).")
    parser.add_argument("--hidden-size", type=int, default=0, help="The model's, which sizes ZeRO's buckets.")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--deadline", type=float, default=time.time() + 3600)
    return parser.parse_args(argv)


def context_bytes(torch: Any) -> int:
    """The CUDA context's bytes (NVML's figure for this process before any tensor), as the product's meter reads it."""
    from autofit.probe.rank.meter import cuda_context_bytes

    return cuda_context_bytes(torch, 0)


def measure_guarded(torch: Any, deepspeed: Any, workload: Any, template: Any, item: dict[str, Any], hidden_size: int,
                    steps: int, histories: dict[str, Any]) -> dict[str, Any]:
    """:func:`measure`, a failure (an out-of-memory among them) recorded as the row's status."""
    from autofit.probe.failure import classify_exception

    held: dict[str, Any] = {}
    try:
        return measure(torch, deepspeed, workload, template, item, hidden_size, steps, histories, held)
    except BaseException as exc:  # a config that fails is a row, and the next config runs
        failure = classify_exception(exc)
        row = {"label": item["label"], "config": item["config"], "status": failure["status"],
               "message": str(failure.get("message") or exc)[:400], "traceback": traceback.format_exc()[-2000:]}
        if torch.cuda.is_available():
            row["max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            row["max_memory_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        return row
    finally:
        tear_down(torch, held)


def measure(torch: Any, deepspeed: Any, workload: Any, template: Any, item: dict[str, Any], hidden_size: int,
            steps: int, histories: dict[str, Any], held: dict[str, Any]) -> dict[str, Any]:
    """One config: a fresh copy of the model, ``deepspeed.initialize``, ``steps`` steps each timed; its figures."""
    from autofit.core.config import Config
    from autofit.ds.apply import activation_offload_context, apply_to_model
    from autofit.ds.emit import deepspeed_config
    from autofit.machine.nvml import start_sampler
    from autofit.probe.rank.steps import train_step
    from autofit.probe.rank.worker import _initialize, loss_of, to_device

    cuda = torch.cuda.is_available()
    config = Config.from_dict(item["config"])
    ds = deepspeed_config(config, 1, "cuda" if cuda else "cpu", hidden_size=hidden_size)
    if cuda and item.get("alloc_conf"):
        set_allocator(torch, item["alloc_conf"])
    row: dict[str, Any] = {"label": item["label"], "config": config.to_dict(), "alloc_conf": item.get("alloc_conf"),
                           "deepspeed": ds, "before": allocator_now(torch)}
    sampler = None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        sampler = start_sampler(torch, 0, os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if item.get("history"):  # what the allocator held when the history began: a replay starts from it
            row["segments_at_start"] = segments(torch)
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                     max_entries=HISTORY_MAX_ENTRIES)
    t0 = time.time()
    held["model"] = model = fresh_model(workload, template, ds, config.zero_stage)
    row["n_checkpointed"] = apply_to_model(model, ds, workload.repeated_layers(model), workload.attention_of)
    row["copy_s"] = round(time.time() - t0, 3)
    t0 = time.time()
    held["engine"], mpu = _initialize(deepspeed, model, ds)
    engine = held["engine"]
    row["initialize_s"] = round(time.time() - t0, 3)
    row["after_initialize"] = allocator_now(torch)
    dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    batch = to_device(workload.batch(config.micro_batch_size), device, dtype)
    compute = loss_of(workload, engine, batch, ds, mpu)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step_s, optimizer_s, loss = [], [], None
    for index in range(steps):
        seconds, optimizer, loss = train_step(engine, compute, config.grad_accum_steps, sync,
                                              lambda: activation_offload_context(ds))
        step_s.append(round(seconds, 6))
        optimizer_s.append(round(optimizer, 6))
        if index + 1 == HISTORY_STEPS and cuda and item.get("history"):
            histories[item["label"]] = compact_history(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
    row.update(step_times_s=step_s, optimizer_times_s=optimizer_s,
               loss=float(loss.detach().float().item()) if loss is not None else None,
               tokens_per_sample=workload.tokens_per_sample, status="ok")
    if cuda:
        row.update(max_memory_allocated_bytes=int(torch.cuda.max_memory_allocated()),
                   max_memory_reserved_bytes=int(torch.cuda.max_memory_reserved()),
                   nvml_peak_bytes=sampler.stop() if sampler else None,
                   memory_stats=allocator_counters(torch), segments=segments(torch))
    settled = sorted(step_s[len(step_s) // 2:])
    median = settled[len(settled) // 2] if settled else 0.0
    samples = config.micro_batch_size * config.grad_accum_steps
    row["summary"] = (f"step {median * 1e3:.1f} ms (first {step_s[0] * 1e3:.0f} ms), {samples / median:.3g} samples/s"
                      + (f", allocated {row['max_memory_allocated_bytes'] / 2**30:.2f} GiB, reserved "
                         f"{row['max_memory_reserved_bytes'] / 2**30:.2f} GiB" if cuda else ""))
    return row


def build_template(torch: Any, workload: Any) -> Any:
    """The model every config copies: fp32 on the host, as the product's probe builds it (its random weights drawn
    on the GPU where there is one, seconds faster for a 1.6 B model, then moved to the host, the allocator emptied)."""
    if not torch.cuda.is_available():
        return workload.build_model(attention="sdpa")
    try:
        with torch.device("cuda"):
            model = workload.build_model(attention="sdpa")
        model = model.to("cpu")
    except Exception:  # a model whose build needs the host: built there
        model = workload.build_model(attention="sdpa")
    gc.collect()
    torch.cuda.empty_cache()
    return model


def fresh_model(workload: Any, template: Any, ds: dict[str, Any], zero_stage: int) -> Any:
    """A copy of the host model (the product's probe builds it on the host, which takes 5-15 s a config); under
    ZeRO-3 built as the product builds it, inside ``zero.Init`` (:func:`autofit.ds.apply.build_context`: each
    parameter made on the GPU in bf16 and partitioned). Not ``zero.Init(module=copy)``: that keeps the host
    model's fp32, so the steps would run in fp32."""
    if zero_stage != 3:
        return copy.deepcopy(template)
    from autofit.ds.apply import build_context

    with build_context(ds):
        return workload.build_model(attention="sdpa")


def tear_down(torch: Any, held: dict[str, Any]) -> None:
    """Free what a config held so the next starts from an empty allocator (its cached segments given back)."""
    engine = held.pop("engine", None)
    if engine is not None:
        try:
            engine.destroy()
        except Exception:  # a half-made engine: what it holds goes with the references below
            pass
    held.clear()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:  # cuBLAS's workspaces are the allocator's blocks: freed before the cache is emptied
            clear()
        torch.cuda.empty_cache()
        set_allocator(torch, "expandable_segments:False")


def set_allocator(torch: Any, settings: str) -> None:
    """``PYTORCH_CUDA_ALLOC_CONF``'s settings changed for what is allocated from now on (PyTorch 2.11 names the
    function ``torch._C._accelerator_setAllocatorSettings``; ``torch.cuda.memory._set_allocator_settings`` before)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(settings)


def allocator_now(torch: Any) -> dict[str, int | None]:
    """What the process holds now: the allocator's allocated and reserved bytes, NVML's figure for the process."""
    if not torch.cuda.is_available():
        return {}
    from autofit.machine.nvml import process_used_bytes

    nvml = None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        nvml = process_used_bytes(pynvml.nvmlDeviceGetComputeRunningProcesses(handle), os.getpid())
    except Exception:  # no NVML: the allocator's figures alone
        pass
    return {"allocated_bytes": int(torch.cuda.memory_allocated()), "reserved_bytes": int(torch.cuda.memory_reserved()),
            "nvml_bytes": nvml}


#: the allocator counters kept (torch.cuda.memory_stats names; "all" pools and the small and large ones)
COUNTERS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "max_split_size",
            "segment.all.peak", "segment.large_pool.peak", "segment.small_pool.peak",
            "reserved_bytes.large_pool.peak", "reserved_bytes.small_pool.peak",
            "allocated_bytes.large_pool.peak", "allocated_bytes.small_pool.peak",
            "inactive_split_bytes.all.peak", "inactive_split.all.peak", "oversize_allocations.peak",
            "oversize_segments.peak", "allocation.all.allocated", "requested_bytes.all.peak")


def allocator_counters(torch: Any) -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {key: int(stats[key]) for key in COUNTERS if key in stats}


def segments(torch: Any) -> list[dict[str, Any]]:
    """The allocator's segments now (after the steps: what it kept reserved), each with its blocks' sizes and states."""
    return [{"size": s["total_size"], "pool": s["segment_type"], "allocated": s["allocated_size"],
             "blocks": [[b["size"], BLOCK_STATES.get(b["state"], b["state"])] for b in s["blocks"]]}
            for s in torch.cuda.memory_snapshot()]


#: a block's state, in one letter: allocated, freed but its stream's work pending, free
BLOCK_STATES = {"active_allocated": "a", "active_pending_free": "p", "inactive": "i"}


def compact_history(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The device's allocator events as parallel lists (action index, address, size, stream): a few MB for a
    0.5 B model's three steps, where the pickle with stacks is hundreds."""
    events = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    names = list(ACTIONS)
    for event in events:  # an event this PyTorch names that the list lacks: appended, not lost
        if event["action"] not in names:
            names.append(event["action"])
    return {"actions": names, "action": [names.index(e["action"]) for e in events],
            "addr": [int(e["addr"]) for e in events], "size": [int(e["size"]) for e in events],
            "stream": [int(e.get("stream", 0)) for e in events]}


if __name__ == "__main__":
    sys.exit(main())
