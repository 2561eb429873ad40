"""One command, one short GPU check: what a bare GPU machine says of autofit, in under 9 minutes.

    benchmarks/gpu_carry.sh                                          # here: the wheels the GPU image lacks, in .whl
    python3 benchmarks/gpu_check.py --install .whl --out OUT         # there (carry .whl): the check
    python benchmarks/gpu_check.py --dry-run --out tmp               # the same steps on the CPU, tiny, in CI

Steps, each a subprocess under its own time limit (its process group killed at the limit), a failure recorded and
the next step run; ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` are rewritten after every step (and the accuracy
step's rows as they are measured), so a run cut short still returns what it measured:

1. ``install``: the carried wheels into ``/tmp/site`` (``--install DIR``; skipped without);
2. ``env``: torch, CUDA, the device, NVML, and what autofit detects (hardware, the software the rules judge by);
3. ``ops``: DeepSpeed's compiled ops the checked configs need, built or loaded (:func:`autofit.probe.ops.prepare_ops`);
4. ``accuracy``: predicted vs measured peak memory and throughput of a handful of configs of one model (on the GPU a
   0.5 B Qwen2-shaped decoder built from ``benchmarks/models/hf/qwen2_0p5b/config.json``: bf16 ZeRO 0 and 3,
   checkpointing on and off, flash where flash-attn is installed, fp8 where the card and torchao have it, compile
   once); a config the rules prune here is listed with the reason;
5. ``run``: a 3-trial ``autofit run`` (1 in the dry run) with its verification, the winner's JSON written to ``OUT/ds_config.json``;
6. ``pytest``: ``pytest -m gpu``.

``--dry-run`` runs the same steps on the CPU with a tiny model (``examples/hf_configs/llama_gqa``) and tiny limits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("install", "env", "ops", "accuracy", "run", "pytest")
GIB = 2**30


@dataclass(frozen=True)
class Profile:
    """What the GPU check and its dry run differ in: the model, the device, the grid and the limits."""

    entry: str
    """An ``hf:`` entry built from its config (random weights)."""
    seq_len: int
    hardware: str
    micro_batch: int
    optimizer: str
    precision: str
    grid: dict[str, list[Any]]
    """The accuracy step's space: every value a checked config takes (the trace covers them all)."""
    checked: tuple[dict[str, Any], ...]
    """The handful of configs measured, as changes of the grid's first values; in this order."""
    limits_s: dict[str, float]
    budget_s: float
    """All steps together."""
    probe_timeout_s: float
    run_set: tuple[str, ...] = ()
    """``--set`` of the search, keeping it short."""
    trials: int = 3
    """The search's ``--trials`` (its verification probes come after them)."""
    pytest_paths: tuple[str, ...] = ("tests",)
    env: dict[str, str] = field(default_factory=dict)


GPU = Profile(
    entry="hf:benchmarks/models/hf/qwen2_0p5b", seq_len=1024, hardware="auto", micro_batch=4, optimizer="adamw",
    precision="bf16",
    grid={"precision": ["bf16", "fp8"], "zero_stage": [0, 3], "checkpoint_ratio": [0.0, 1.0],
          "attention": ["sdpa", "flash"], "compile": ["off", "on"]},
    checked=({}, {"zero_stage": 3}, {"checkpoint_ratio": 1.0}, {"attention": "flash"}, {"precision": "fp8"},
             {"compile": "on"}),
    # measured on an H100 machine of 16 cores (2026-11-27): FusedAdam's nvcc build 41 s (the ops step 60 s with its
    # trace), a 0.5 B probe 29-31 s (imports 14-15 s, model build 7-9 s); 180 s for the accuracy step cut the compile
    # probe, and 90 s of pytest ended inside its first probe test
    limits_s={"install": 30, "env": 30, "ops": 90, "accuracy": 230, "run": 130, "pytest": 30},
    budget_s=530, probe_timeout_s=120,
    run_set=("compile=off", "offload_optimizer=none", "offload_params=none", "attention=sdpa"),
    pytest_paths=("tests/probe/test_cuda.py::test_cuda_nvml_row_is_found_by_uuid_under_cuda_visible_devices",),
)

DRY = Profile(
    entry="hf:examples/hf_configs/llama_gqa", seq_len=128, hardware="cpu", micro_batch=2, optimizer="sgd",
    precision="fp32",
    grid={"precision": ["fp32"], "zero_stage": [0], "checkpoint_ratio": [0.0, 1.0], "attention": ["sdpa"],
          "compile": ["off"]},
    checked=({}, {"checkpoint_ratio": 1.0}),
    limits_s={"install": 30, "env": 60, "ops": 60, "accuracy": 150, "run": 150, "pytest": 90},
    budget_s=480, probe_timeout_s=90,
    run_set=("compile=off", "zero_stage=0", "checkpoint_granularity=block", "attention=sdpa", "micro_batch_size=2",
             "checkpoint_ratio=0"),
    trials=1,
    pytest_paths=("tests/probe/test_cuda.py",),
    env={"DS_ACCELERATOR": "cpu"},
)


# -- the driver ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.step:
        return run_step(args)
    profile = DRY if args.dry_run else GPU
    if args.budget is not None:
        profile = dataclasses.replace(profile, budget_s=args.budget)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"check": "gpu_check", "dry_run": args.dry_run, "model": profile.entry,
                              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": profile.budget_s,
                              "steps": {}}
    deadline = time.monotonic() + profile.budget_s
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    env = child_env(profile, args.install)
    for name in STEPS:
        left = deadline - time.monotonic()
        if name == "install" and not args.install:
            record = {"status": "skipped", "summary": "no --install: the packages are taken as installed"}
        elif left < 10:
            record = {"status": "skipped", "summary": f"the check's budget ({profile.budget_s:.0f} s) is spent"}
        else:
            limit = min(profile.limits_s[name], left)
            record = supervise(name, args, env, limit, scratch, report, out)
        report["steps"][name] = record
        write(out, report)
        print(f"gpu_check: {name}: {record['status']} {record.get('summary', '')}", flush=True)
    report["wall_s"] = round(profile.budget_s - (deadline - time.monotonic()), 1)
    write(out, report)
    return 0 if all(r["status"] in ("ok", "skipped") for r in report["steps"].values()) else 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Where gpu_check.json, gpu_check.md and ds_config.json go.")
    parser.add_argument("--dry-run", action="store_true", help="The same steps on the CPU, a tiny model, tiny limits.")
    parser.add_argument("--install", default=None, metavar="DIR", help="Install DIR/*.whl into /tmp/site first.")
    parser.add_argument("--budget", type=float, default=None, help="Seconds for all steps (default: 530; dry run 480).")
    parser.add_argument("--step", choices=STEPS, default=None, help=argparse.SUPPRESS)  # one step, in its process
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # where the step writes what it found
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # the step's end, epoch s
    return parser.parse_args(argv)


def child_env(profile: Profile, install: str | None) -> dict[str, str]:
    """The steps' environment: this checkout (and the installed wheels) importable, output unbuffered."""
    paths = ([SITE] if install else []) + [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return os.environ | profile.env | {"PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}


#: where --install puts the wheels
SITE = "/tmp/site"


def supervise(name: str, args: argparse.Namespace, env: dict[str, str], limit_s: float, scratch: Path,
              report: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run one step in its own process group under ``limit_s``; what it wrote, its status and its output's tail.
    While it runs, the rows it writes reach the report (every 5 s)."""
    part = scratch / f"{name}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--step", name, "--part", str(part), "--out", args.out,
               "--deadline", str(time.time() + limit_s)]
    command += ["--dry-run"] if args.dry_run else []
    command += ["--install", args.install] if args.install else []
    log = scratch / f"{name}.log"
    start = time.monotonic()
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        status = wait(process, start + limit_s, lambda: _progress(name, part, report, out))
    found = _read(part)
    record = {"status": status if status != "ok" or found.get("ok", True) else "failed",
              "wall_s": round(time.monotonic() - start, 1), "limit_s": round(limit_s, 1),
              "returncode": process.returncode, "summary": found.pop("summary", ""), "result": found,
              "log_tail": log.read_text(errors="replace")[-3000:]}
    if status == "timeout":
        record["summary"] = f"cut at {limit_s:.0f} s; {record['summary']}".rstrip("; ")
    return record


def wait(process: subprocess.Popen[Any], deadline: float, tick: Any) -> str:
    """``ok``, ``failed`` or ``timeout`` (the whole process group killed: probes, builds, workers)."""
    while process.poll() is None:
        if time.monotonic() > deadline:
            with _quiet():
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return "timeout"
        time.sleep(0.5)
        tick()
    with _quiet():  # what the step left behind (a probe's rank) goes with it
        os.killpg(process.pid, signal.SIGKILL)
    return "ok" if process.returncode == 0 else "failed"


def _quiet() -> contextlib.suppress:
    """Ignores a process group already gone."""
    return contextlib.suppress(ProcessLookupError, PermissionError)


_last_progress = [0.0]


def _progress(name: str, part: Path, report: dict[str, Any], out: Path) -> None:
    """Every 5 s, what the running step wrote so far into the report (a cut-short check keeps its rows)."""
    if time.monotonic() - _last_progress[0] < 5:
        return
    _last_progress[0] = time.monotonic()
    found = _read(part)
    if found:
        report["steps"][name] = {"status": "running", "summary": found.get("summary", ""), "result": found}
        write(out, report)


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write(out: Path, report: dict[str, Any]) -> None:
    """``gpu_check.json`` and ``gpu_check.md``, each replaced whole (a reader never sees half of one)."""
    for name, text in (("gpu_check.json", json.dumps(report, indent=1, default=str)), ("gpu_check.md", markdown(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def markdown(report: dict[str, Any]) -> str:
    """The steps' table, the accuracy rows, and the tail of each failure's output."""
    kind = "dry run (CPU)" if report["dry_run"] else "GPU"
    lines = [f"# gpu_check: {kind}, {report['started']}", "", f"Model: `{report['model']}`.", "",
             "| step | status | wall s | limit s | summary |", "|---|---|---:|---:|---|"]
    for name in STEPS:
        r = report["steps"].get(name, {"status": "not run"})
        lines.append(f"| {name} | {r['status']} | {r.get('wall_s', '')} | {r.get('limit_s', '')} | "
                     f"{str(r.get('summary', '')).replace('|', '/')} |")
    rows = report["steps"].get("accuracy", {}).get("result", {}).get("rows", [])
    if rows:
        lines += ["", "| config | status | predicted GiB | measured GiB | error | predicted samples/s | measured "
                  "samples/s | error |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        lines += [accuracy_line(row) for row in rows]
    pruned = report["steps"].get("accuracy", {}).get("result", {}).get("pruned", [])
    lines += [f"- pruned here: {reason}" for reason in pruned]
    for name, r in report["steps"].items():
        if r["status"] in ("failed", "timeout"):
            lines += ["", f"## {name}: {r['status']}", "", "```", str(r.get("log_tail", ""))[-1500:], "```"]
    return "\n".join(lines) + "\n"


def accuracy_line(row: dict[str, Any]) -> str:
    def pct(value: Any) -> str:
        return f"{value:+.1%}" if isinstance(value, float) else ""

    measured = f"{row['measured_peak_bytes'] / GIB:.2f}" if row.get("measured_peak_bytes") else ""
    speed = f"{row['measured_samples_per_s']:.3g}" if row.get("measured_samples_per_s") else ""
    return (f"| {row['label']} | {row['status']} | {row['predicted_peak_bytes'] / GIB:.2f} | {measured} | "
            f"{pct(row.get('peak_error'))} | {row['predicted_samples_per_s']:.3g} | {speed} | "
            f"{pct(row.get('throughput_error'))} |")


# -- the steps, each in its own process ------------------------------------------------------------------------------


def run_step(args: argparse.Namespace) -> int:
    """One step: what it finds goes to ``--part`` (a JSON object; ``summary`` a line, ``ok`` false for a failure)."""
    import gpu_check_steps as steps  # beside this file

    profile = DRY if args.dry_run else GPU
    part = Path(args.part)
    result = getattr(steps, f"step_{args.step}")(profile, args, lambda found: _save(part, found))
    _save(part, result)
    return 0 if result.get("ok", True) else 1


def _save(part: Path, found: dict[str, Any]) -> None:
    tmp = part.with_suffix(".tmp")
    tmp.write_text(json.dumps(found, indent=1, default=str))
    tmp.replace(part)


def host_line() -> str:
    return f"Python {platform.python_version()} on {platform.machine()}"


if __name__ == "__main__":
    sys.exit(main())
