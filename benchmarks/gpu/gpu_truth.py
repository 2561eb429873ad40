"""Every GPU row measured so far, priced again on this CPU by the cost model as it is now.

    python -m benchmarks.gpu.gpu_truth                      # the table; benchmarks/results/gpu_truth.json
    python -m benchmarks.gpu.gpu_truth --out DIR

The GPU is the truth and GPU time is rare (issue 48), so each GPU run comes home as raw data
(``benchmarks/results/gpu_check/``) and this command judges the prior against all of it, with no GPU:

- the H100 run of 2026-11-27 (``h100_2026-11-27_run2*``): four accuracy rows (micro-batch 4; their step times were
  not logged, so their throughput is not a steady-state figure) and the search's two probes (five logged steps);
- the H200 runs of 2026-11-28 (``h200_2026-11-28_run{1,2}.json``): the harvester's grid (a 0.5 B Qwen2-shaped
  model, and a 1.6 B StableLM-2 held out from any fitting; micro-batch x ZeRO 0/3 x checkpointing, ten logged
  steps each) and the search's three probes (``autofit run``'s progress lines: samples/s and NVML peak).

Measured memory is NVML's per-process peak, as the product meters a probe. A grid row measured in a process that
held cached segments from the config before (``before.reserved_bytes`` > 0) is marked ``warm``: its allocator could
reuse them, so its peak can be below a fresh process's. Throughput is judged only where the step times were logged:
the median of the steps after the third (the first steps carry ZeRO-3's module-order recording, the allocator's
growth and cuBLAS's autotuning; ``first_steps_s`` shows them).

Each row is priced by ``plan.predict`` with the catalog's hardware (``h100-80gb``, ``h200``), the uncalibrated
prior, from a trace of the model made here (cached).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
GPU = RESULTS / "gpu_check"
GIB = 2**30
#: the steps a logged row's steady state leaves out
WARMUP_STEPS = 3
#: where each model of the GPU rows is, by the name the runs give it
MODELS = {"qwen2_0p5b": "hf:benchmarks/models/hf/qwen2_0p5b",
          "stablelm_2_1p6b": "hf:benchmarks/models/families/stablelm-2-1.6b"}
HELD_OUT = ("stablelm_2_1p6b",)


@dataclass
class GpuRow:
    """One measured config on a GPU."""

    source: str
    card: str
    hardware: str
    """The catalog's preset the row is priced on."""
    model: str
    seq_len: int
    config: dict[str, Any]
    nvml_peak_bytes: int
    samples_per_s: float | None = None
    steady: bool = False
    """Step times were logged: the throughput is the steady state's."""
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    warm: bool = False
    first_steps_s: list[float] = field(default_factory=list)
    predicted: dict[str, Any] = field(default_factory=dict)

    @property
    def held_out(self) -> bool:
        return self.model in HELD_OUT

    def label(self) -> str:
        from autofit.core.config import Config

        return Config.from_dict(self.config).label()


def steady_samples_per_s(step_times_s: list[float], samples: int) -> float:
    """Samples a second at the median of the steps after :data:`WARMUP_STEPS`."""
    return samples / statistics.median(step_times_s[WARMUP_STEPS:])


def h100_rows() -> list[GpuRow]:
    run = json.loads((GPU / "h100_2026-11-27_run2.json").read_text())
    rows = []
    for row in run["steps"]["accuracy"]["result"]["rows"]:
        if row["status"] == "ok":
            rows.append(GpuRow("h100 run 2 accuracy", "H100 80GB HBM3", "h100-80gb", "qwen2_0p5b", 1024, row["config"],
                               row["nvml_peak_bytes"], row["measured_samples_per_s"]))
    trials = json.loads((GPU / "h100_2026-11-27_run2_search_trials.json").read_text())["trials"]
    for trial in trials:
        measured = trial.get("measured")
        if not measured or measured["status"] != "ok":
            continue
        memory = measured["device_memory"]
        rows.append(GpuRow("h100 run 2 search", "H100 80GB HBM3", "h100-80gb", "qwen2_0p5b", 1024, trial["config"],
                           memory["nvml_peak_bytes"], measured["samples_per_s"], steady=True,
                           allocated_bytes=memory["max_memory_allocated_bytes"],
                           reserved_bytes=memory["max_memory_reserved_bytes"]))
    return rows


def h200_rows() -> list[GpuRow]:
    rows = []
    for run in ("run1", "run2"):
        report = json.loads((GPU / f"h200_2026-11-28_{run}.json").read_text())
        for model, found in report["steps"]["grid"]["result"]["models"].items():
            for row in found.get("rows", []):
                if row["status"] != "ok":
                    continue
                config = row["config"]
                times = row["step_times_s"]
                samples = config["micro_batch_size"] * config["grad_accum_steps"]
                rows.append(GpuRow(f"h200 {run} grid", "H200", "h200", model, 1024, config, row["nvml_peak_bytes"],
                                   steady_samples_per_s(times, samples), steady=True,
                                   allocated_bytes=row["max_memory_allocated_bytes"],
                                   reserved_bytes=row["max_memory_reserved_bytes"],
                                   warm=bool(row["before"].get("reserved_bytes")) or bool(row.get("alloc_conf")),
                                   first_steps_s=times[:WARMUP_STEPS]))
        rows += search_rows(report, run)
    return rows


#: a probe's line in ``autofit run``'s progress: its label, samples/s and NVML peak
PROBED = re.compile(r"\| (mb\S+ .+?): ([\d.]+) samples/s, ([\d.]+) GiB$")


def search_rows(report: dict[str, Any], run: str) -> list[GpuRow]:
    """The search's probes, from its progress lines (the step was cut before it wrote its JSON)."""
    from autofit.core.config import Config

    rows = []
    for line in report["steps"].get("run", {}).get("result", {}).get("progress", []):
        found = PROBED.search(line)
        if not found:
            continue
        config = config_of_label(found.group(1))
        rows.append(GpuRow(f"h200 {run} search", "H200", "h200", "qwen2_0p5b", 1024, Config.from_dict(config).to_dict(),
                           int(float(found.group(3)) * GIB), float(found.group(2)), steady=True))
    return rows


def config_of_label(label: str) -> dict[str, Any]:
    """``mb16x1 bf16 adamw z1 ckpt0 sdpa`` as a config (the keys a label names; the rest at their defaults)."""
    parts = label.split()
    mb, accum = parts[0][2:].split("x")
    return {"micro_batch_size": int(mb), "grad_accum_steps": int(accum), "precision": parts[1], "optimizer": parts[2],
            "zero_stage": int(parts[3][1:]), "checkpoint_ratio": float(parts[4][4:]), "attention": parts[5]}


def price(rows: list[GpuRow]) -> None:
    """Each row's prediction, one plan per model, card and precision set (their space holds every row's values)."""
    from autofit.core.config import Config

    groups: dict[tuple[str, str, int], list[GpuRow]] = {}
    for row in rows:
        groups.setdefault((row.model, row.hardware, row.seq_len), []).append(row)
    for (model, hardware, seq_len), members in groups.items():
        plan = plan_for(model, hardware, seq_len, [row.config for row in members])
        for row in members:
            predicted = plan.predict(Config.from_dict(row.config))
            row.predicted = {"peak_bytes": predicted.peak_bytes, "samples_per_s": predicted.samples_per_s,
                             "breakdown": asdict(predicted.breakdown), "time_breakdown": predicted.time_breakdown}


def plan_for(model: str, hardware: str, seq_len: int, configs: list[dict[str, Any]]) -> Any:
    import yaml

    from autofit.planning.target import Target, prepare

    keys = ("micro_batch_size", "precision", "zero_stage", "checkpoint_ratio", "attention", "optimizer")
    values = {key: sorted({c[key] for c in configs}) for key in keys}
    space = {"description": "every GPU row's values", "checkpoint_granularity": ["block"], "offload_optimizer": ["none"],
             "offload_params": ["none"], "compile": ["off"], **values}
    path = Path(tempfile.mkdtemp()) / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    allow = ("fp8",) if "fp8" in values["precision"] else ()
    target = Target(entry=MODELS[model], seq_len=seq_len, hardware=hardware, gpus=1, space=str(path),
                    optimizer="adamw", precision="bf16", allow=allow)
    return prepare(target).plan()


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def summary(rows: list[GpuRow]) -> dict[str, Any]:
    memory = [error(r.predicted["peak_bytes"], r.nvml_peak_bytes) for r in rows]
    steady = [r for r in rows if r.steady and r.samples_per_s]
    speed = [error(r.predicted["samples_per_s"], r.samples_per_s) for r in steady]
    return {"rows": len(rows), "memory_error_range": [min(memory), max(memory)],
            "memory_within_band": sum(-0.03 <= e <= 0.08 for e in memory),
            "steady_rows": len(steady), "throughput_error_range": [min(speed), max(speed)],
            "throughput_within_20": sum(abs(e) <= 0.2 for e in speed)}


def table(rows: list[GpuRow]) -> str:
    lines = ["| source | model | config | NVML GiB | predicted GiB | error | samples/s | predicted | error |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        speed = f"{r.samples_per_s:.3g}" if r.samples_per_s else ""
        speed_error = (f"{error(r.predicted['samples_per_s'], r.samples_per_s):+.1%}" + ("" if r.steady else " (not steady)")
                       if r.samples_per_s else "")
        lines.append(f"| {r.source}{' (warm)' if r.warm else ''} | {r.model}{' (held out)' if r.held_out else ''} | "
                     f"{r.label()} | {r.nvml_peak_bytes / GIB:.2f} | {r.predicted['peak_bytes'] / GIB:.2f} | "
                     f"{error(r.predicted['peak_bytes'], r.nvml_peak_bytes):+.1%} | {speed} | "
                     f"{r.predicted['samples_per_s']:.3g} | {speed_error} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS), help="Where gpu_truth.json goes.")
    args = parser.parse_args(argv)
    rows = h100_rows() + h200_rows()
    price(rows)
    result = {"benchmark": "gpu_truth", "summary": summary(rows), "rows": [asdict(r) for r in rows]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_truth.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(table(rows))
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
