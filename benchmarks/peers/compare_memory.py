"""Peak memory of one training step: autofit's prediction beside the estimators people use, against a probe.

    python -m benchmarks.peers.compare_memory                      # probes cached in benchmarks/results/compare_memory_probes.json
    python -m benchmarks.peers.compare_memory --models vit,cnn --out-dir /tmp/x

For each model of ``benchmarks/models/`` (decoder, encoder-decoder, ViT, CNN, mixture-of-experts) and each
config of :data:`CONFIGS` (micro-batch sizes, checkpoint ratios, fp32/bf16, ZeRO 0-3; AdamW, world size 1):

- **measured**: ``autofit.probe.run.run_probe`` (a real ``deepspeed.initialize`` step in a subprocess, peak RSS
  over imports, one warm-up and one measured step, as ``benchmarks/accuracy/memory_accuracy.py``); cached by model
  and config, so re-rendering the table runs no probe;
- **autofit**: ``autofit.planning.plan.trace_for`` + ``autofit.cost_model.predict`` (what ``autofit estimate`` prints);
- **DeepSpeed**: ``estimate_zero2_model_states_mem_needs_all_live`` (ZeRO 0-2; DeepSpeed has none for 0
  and 1, and on one rank their model states are ZeRO-2's) or ``estimate_zero3_..._all_live`` (ZeRO 3),
  called on the built model; the "per GPU" figure of its ``offload=none`` row. Those functions print
  GB to two decimals, so the number is read from the function they print from
  (``estimate_zero{2,3}_model_states_mem_needs`` over DeepSpeed's own ``model_to_params``);
- **Accelerate**: ``accelerate estimate-memory``'s path: the model built under ``init_empty_weights``,
  ``calculate_maximum_sizes``, ``estimate_training_usage(total, dtype)``, and the max of its parts
  (the CLI's "Training using Adam" column);
- **MemTracker**: ``torch.distributed._tools.mem_tracker.MemTracker`` over two plain training steps
  (``torch.optim.AdamW``; bf16 as ``torch.autocast``; checkpointing applied) on fake tensors; the
  ``peak`` snapshot's ``Total``.

Error = (estimate - measured) / measured. Writes ``compare_memory.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any

from autofit.core.config import Config
from autofit.cost_model import predict
from autofit.machine.device import get_hardware
from autofit.planning.plan import trace_for
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec
from autofit.workload.entry import load_workload
from autofit.workload.types import Workload
from benchmarks import common as cc
from benchmarks.accuracy.memory_accuracy import MODELS as ACCURACY_MODELS

#: the five held-out architectures of benchmarks/models/, by short name
MODELS = {Path(e.split(":")[0]).stem: e for e in ACCURACY_MODELS if e.startswith("benchmarks/models/")}
#: (micro-batch, checkpoint ratio, precision, ZeRO stage); AdamW, no accumulation, world size 1
GRID = [
    (1, 0.0, "fp32", 0), (8, 0.0, "fp32", 0), (8, 1.0, "fp32", 0), (4, 0.5, "fp32", 2), (4, 0.0, "fp32", 3),
    (4, 0.0, "bf16", 0), (8, 0.5, "bf16", 2),
]
CONFIGS = [
    Config(micro_batch_size=mb, checkpoint_ratio=r, precision=p, zero_stage=z, optimizer="adamw", attention="sdpa")
    for mb, r, p, z in GRID
]
TOOLS = ("autofit", "deepspeed", "accelerate", "memtracker")
#: what each estimate leaves out, said once under the table
COVERS = {
    "autofit": "params, grads, optimizer states by precision/ZeRO, DeepSpeed's buffers, traced activations",
    "deepspeed": "model states only (no activations, no buffers); assumes 16-bit params + fp32 master and Adam "
    "(20 B/param on one rank) whatever the precision",
    "accelerate": "model states only, batch size 1 and no activations; Adam; no ZeRO",
    "memtracker": "a plain PyTorch step (no DeepSpeed buffers, no ZeRO); bf16 as autocast over fp32 weights",
}


def probe_key(model: str, config: Config) -> str:
    return f"{model} {json.dumps(config.to_dict(), sort_keys=True)}"


def measure(model: str, entry: str, config: Config, cache: cc.JsonCache) -> dict[str, Any]:
    """The probe's peak (cached): ``{"status", "peak_bytes", "message", "wall_s"}``."""
    hardware = get_hardware("cpu")

    def probe() -> dict[str, Any]:
        r = run_probe(probe_spec(entry, config, hardware, 1, steps=1, warmup_steps=1), timeout_s=900)
        print(f"  probe {model} {config.label()}: {r.status} {r.peak_bytes / cc.MIB:.1f} MiB ({r.wall_s:.0f} s)", flush=True)
        return {"status": r.status, "peak_bytes": r.peak_bytes, "message": r.message, "wall_s": r.wall_s}

    return cache.get_or_compute(probe_key(model, config), probe)


def deepspeed_estimate(model: Any, config: Config) -> dict[str, Any]:
    """DeepSpeed's "per GPU" bytes for ``offload=none``, and what ``..._all_live`` printed."""
    from deepspeed.runtime.zero import stage3
    from deepspeed.runtime.zero import stage_1_and_2 as stage2

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        if config.zero_stage == 3:
            stage3.estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1)
            total, largest = stage3.model_to_params(model)
            _, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
                total, largest, num_gpus_per_node=1, num_nodes=1, cpu_offload=False, cpu_offload_params=False
            )
        else:
            stage2.estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1)
            _, gpu = stage2.estimate_zero2_model_states_mem_needs(
                stage2.model_to_params(model), num_gpus_per_node=1, num_nodes=1, cpu_offload=False
            )
    return {"bytes": int(gpu), "printed": printed.getvalue().strip()}


def accelerate_estimate(workload: Workload, config: Config) -> int:
    """``accelerate estimate-memory``'s "Training using Adam" for the config's dtype."""
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    with init_empty_weights():
        model = workload.build_model(attention=config.attention)
    total_size, _largest = calculate_maximum_sizes(model)
    usage = estimate_training_usage(total_size, "float32" if config.precision == "fp32" else "bfloat16")
    return int(max(usage.values()))


def memtracker_estimate(workload: Workload, config: Config) -> dict[str, Any]:
    """MemTracker's peak over two plain AdamW steps (the second has optimizer states), on fake tensors;
    on real ones where a fake (meta) kernel refuses what the real one runs (Mixtral's fp32 ``_grouped_mm``)."""
    import logging

    from torch._subclasses.fake_tensor import FakeTensorMode

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level, log.level = log.level, logging.CRITICAL
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            return {"bytes": _tracked_steps(workload, config), "tensors": "fake"}
    except RuntimeError:
        return {"bytes": _tracked_steps(workload, config), "tensors": "real"}
    finally:
        log.setLevel(level)


def _tracked_steps(workload: Workload, config: Config) -> int:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from autofit.ds.apply import apply_checkpointing

    model = workload.build_model(attention=config.attention)
    model.train()
    apply_checkpointing(model, workload.repeated_layers(model), config.checkpoint_ratio)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = workload.batch(config.micro_batch_size)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.precision == "bf16"):
                loss = workload.compute_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                tracker.reset_mod_stats()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _guarded(fn: Any, *args: Any) -> tuple[Any, str | None]:
    """A peer's number, or None and the one-line reason it failed."""
    try:
        return fn(*args), None
    except Exception as exc:  # a peer failing on a model is a result, not a crash of the benchmark
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def autofit_estimates(workload: Workload) -> dict[Config, int]:
    """``autofit estimate``'s predicted peak of each config: one trace, the cost model's prior."""
    facts, hardware = trace_for(workload, CONFIGS), get_hardware("cpu")
    return {config: predict(config, facts, hardware, 1).peak_bytes for config in CONFIGS}


def refresh_autofit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with the autofit column priced again by this checkout's cost model (probes and peers kept)."""
    by_model: dict[str, dict[Config, int]] = {}
    for workload in (load_workload(entry) for entry in MODELS.values()):
        if any(row["model"] == workload.name for row in rows):
            by_model[workload.name] = autofit_estimates(workload)
    for row in rows:
        value = by_model[row["model"]][Config.from_dict(row["config"])]
        row["estimates_bytes"]["autofit"] = value
        row["errors"]["autofit"] = cc.relative_error(value, row["measured_bytes"]) if row["measured_bytes"] else None
    return rows


def model_rows(name: str, entry: str, cache: cc.JsonCache, configs: list[Config] = CONFIGS) -> list[dict[str, Any]]:
    """Every tool's estimate and the probe's peak, one row per config."""
    workload = load_workload(entry)
    t0 = time.monotonic()
    predicted = autofit_estimates(workload)
    autofit_s = time.monotonic() - t0
    rows = []
    for config in configs:
        measured = measure(name, entry, config, cache)
        built = workload.build_model(attention=config.attention)
        ds, ds_error = _guarded(deepspeed_estimate, built, config)
        accelerate, acc_error = _guarded(accelerate_estimate, workload, config)
        tracked, mt_error = _guarded(memtracker_estimate, workload, config)
        estimates = {"autofit": predicted[config], "deepspeed": ds["bytes"] if ds else None,
                     "accelerate": accelerate, "memtracker": tracked["bytes"] if tracked else None}
        ok = measured["status"] == "ok"
        rows.append({
            "model": workload.name, "config": config.to_dict(), "label": config.label(),
            "measured_bytes": measured["peak_bytes"] if ok else None,
            "measured_status": measured["status"], "measured_message": measured["message"],
            "estimates_bytes": estimates,
            "errors": {t: cc.relative_error(v, measured["peak_bytes"]) if ok else None for t, v in estimates.items()},
            "peer_failures": {k: v for k, v in (("deepspeed", ds_error), ("accelerate", acc_error),
                                                 ("memtracker", mt_error)) if v},
            "deepspeed_printed": ds["printed"] if ds else None,
            "memtracker_tensors": tracked["tensors"] if tracked else None,
            "autofit_estimate_s": autofit_s,
        })
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t: cc.error_summary(r["errors"][t] for r in rows) for t in TOOLS}


def _cell(row: dict[str, Any], tool: str) -> str:
    value = row["estimates_bytes"][tool]
    if value is None:
        return "failed"
    error = row["errors"][tool]
    return f"{value / cc.MIB:.0f} ({cc.pct(error)})" if error is not None else f"{value / cc.MIB:.0f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    stats = summary(rows)
    head = ["", "configs with a number", "median \\|error\\|", "worst \\|error\\|", "worst under-prediction", "covers"]
    lines = [cc.markdown_table(head, [
        [t, s["n"], cc.pct(s["median_abs"]).lstrip("+"), cc.pct(s["worst_abs"]).lstrip("+"), cc.pct(s["worst_under"]), COVERS[t]]
        for t, s in stats.items()
    ], right=1), ""]
    detail = [
        [r["model"], r["label"], f"{r['measured_bytes'] / cc.MIB:.0f}" if r["measured_bytes"] else r["measured_status"],
         *(_cell(r, t) for t in TOOLS)]
        for r in rows
    ]
    lines.append(cc.markdown_table(["model", "config", "measured MiB", *(f"{t} MiB (error)" for t in TOOLS)], detail, right=2))
    real = sorted({r["model"] for r in rows if r.get("memtracker_tensors") == "real"})
    if real:
        lines += ["", f"MemTracker ran on real tensors for {', '.join(real)}: a fake (meta) kernel refused what the real one runs."]
    failures = sorted({f"{t}: {m}" for r in rows for t, m in r["peer_failures"].items()})
    failures += sorted({f"probe of {r['model']} {r['label']}: {r['measured_message']}" for r in rows if not r["measured_bytes"]})
    if failures:
        lines += ["", "Did not run: " + "; ".join(failures)]
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]]) -> Any:
    fig, axes = cc.new_figure(2, width=6.0, height=4.5)
    scatter, bars = axes[0]
    measured = [r for r in rows if r["measured_bytes"]]
    top = max(max(v or 0 for v in r["estimates_bytes"].values()) for r in measured) / cc.MIB
    for tool, marker in zip(TOOLS, "os^D", strict=True):
        points = [(r["measured_bytes"] / cc.MIB, r["estimates_bytes"][tool] / cc.MIB)
                  for r in measured if r["estimates_bytes"][tool] is not None]
        scatter.scatter(*zip(*points, strict=True), label=tool, marker=marker, s=18, alpha=0.8)
    scatter.plot([0, top], [0, top], color="grey", lw=0.8, ls="--", label="estimate = measured")
    scatter.set(xlabel="measured peak (MiB, DeepSpeed step on CPU)", ylabel="estimated peak (MiB)",
                title="Peak memory: estimate vs measured")
    scatter.legend(fontsize=8)
    stats = summary(rows)
    bars.bar(list(TOOLS), [100 * (stats[t]["median_abs"] or 0) for t in TOOLS], color="tab:blue", label="median")
    bars.scatter(list(TOOLS), [100 * (stats[t]["worst_abs"] or 0) for t in TOOLS], color="tab:red", label="worst", zorder=3)
    n_models = len({r["model"] for r in measured})
    bars.set(ylabel="|estimate - measured| / measured (%)", title=f"{len(measured)} configs, {n_models} architectures")
    bars.legend(fontsize=8)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--cache", type=Path, default=cc.RESULTS / "compare_memory_probes.json")
    parser.add_argument("--out-dir", type=Path, default=cc.RESULTS)
    parser.add_argument("--render-only", action="store_true", help="re-draw the table and chart from --out-dir's JSON")
    parser.add_argument("--grid", default=None, help="comma-separated indexes into GRID (default: all)")
    parser.add_argument("--rows", type=Path, nargs="*", help="with --render-only: the JSON rows to draw (default: --out-dir's)")
    parser.add_argument("--refresh-autofit", action="store_true",
                        help="price the autofit column again with this checkout's cost model (no probe, no peer)")
    args = parser.parse_args()
    os.chdir(cc.ROOT)  # the entries are relative to the repository, as in the other benchmarks
    if args.render_only or args.refresh_autofit:
        rows = [row for path in args.rows or [args.out_dir / "compare_memory.json"] for row in json.loads(path.read_text())]
        rows = refresh_autofit(rows) if args.refresh_autofit else rows
    else:
        cache = cc.JsonCache(args.cache)
        configs = [CONFIGS[int(i)] for i in args.grid.split(",")] if args.grid else CONFIGS
        rows = [row for name in args.models.split(",") for row in model_rows(name, MODELS[name], cache, configs)]
    cc.write_results("compare_memory", rows, markdown(rows), chart(rows), args.out_dir)


if __name__ == "__main__":
    main()
