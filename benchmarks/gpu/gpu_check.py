"""One command, one short GPU check that brings the GPU's truth home as data, in under 9 minutes.

    benchmarks/gpu/gpu_carry.sh                                          # here: the wheels the GPU image lacks, in .whl
    python3 -m benchmarks.gpu.gpu_check --install .whl --out OUT         # there (carry .whl): the check
    python -m benchmarks.gpu.gpu_check --dry-run --out tmp               # the same steps on the CPU, tiny, in CI

Steps, each a subprocess under its own time limit (its process group killed at the limit), a failure recorded and
the next step run; ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` are rewritten after every step (and as a step's
rows come), so a run cut short still returns what it measured:

1. ``install``: the carried wheels into ``/tmp/site`` (``--install DIR``; skipped without), byte-compiled;
2. ``env``: torch, CUDA, the device, NVML, and what autofit detects (hardware, the software the rules judge by);
3. ``ops``: DeepSpeed's compiled ops the grid needs, built or loaded (:func:`autofit.probe.ops.prepare_ops`);
4. ``host``: the host's own constants (a kernel launch, autograd per layer, DeepSpeed per step, tensor and module at
   ZeRO 0-3) from micro-benchmarks that share nothing with the grid (``benchmarks/gpu/gpu_check_host.py``);
5. ``grid``: the raw truth of a grid of configs of two models, one of them held out from any fitting
   (``benchmarks/gpu/gpu_check_grid.py``, one process a model): every step's time, the allocator's allocated and
   reserved peaks, NVML's peak, the allocator's counters and segments, and for some configs the allocator's whole
   event history (``OUT/alloc_history_<model>.json.gz``). No prediction is made there: the CPU prices the rows
   afterwards with whatever cost model it has then;
6. ``run``: a 3-trial ``autofit run`` (1 in the dry run) with its verification, the winner's JSON in ``OUT/ds_config.json``;
7. ``pytest``: ``pytest -m gpu``.

``--dry-run`` runs the same steps on the CPU with tiny models and tiny limits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from autofit.machine.lifetime import kill_session
from benchmarks.gpu.gpu_check_profiles import DRY, GIB, GPU, ROOT, SITE, STEPS, GridModel, Profile, host_line  # noqa: F401

# -- the driver ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.step:
        return run_step(args)
    profile = DRY if args.dry_run else GPU
    if args.budget is not None:
        profile = dataclasses.replace(profile, budget_s=args.budget)
    if args.grid_s is not None:
        profile = with_grid_seconds(profile, args.grid_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"check": "gpu_check", "dry_run": args.dry_run, "model": profile.run_entry,
                              "grid_models": [dataclasses.asdict(m) for m in profile.grid],
                              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": profile.budget_s,
                              "steps": {}}
    deadline = time.monotonic() + profile.budget_s
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    env = child_env(profile, args.install)
    for name in STEPS:
        left = deadline - time.monotonic()
        if name == "install" and not args.install:
            record = {"status": "skipped", "summary": "no --install: the packages are taken as installed"}
        elif args.only and name not in args.only.split(","):
            record = {"status": "skipped", "summary": f"not among --only {args.only}"}
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


def with_grid_seconds(profile: Profile, seconds: float) -> Profile:
    """``profile`` with ``seconds`` for the grid step, each model's share scaled alike."""
    scale = seconds / profile.limits_s["grid"]
    grid = tuple(dataclasses.replace(m, limit_s=m.limit_s * scale) for m in profile.grid)
    return dataclasses.replace(profile, grid=grid, limits_s=profile.limits_s | {"grid": seconds})


def step_names(text: str) -> str:
    """``--only``'s value: step names separated by commas, each one of :data:`STEPS`."""
    unknown = [name for name in text.split(",") if name not in STEPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown step {', '.join(unknown)} (steps: {', '.join(STEPS)})")
    return text


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Where gpu_check.json, gpu_check.md and ds_config.json go.")
    parser.add_argument("--dry-run", action="store_true", help="The same steps on the CPU, a tiny model, tiny limits.")
    parser.add_argument("--install", default=None, metavar="DIR", help="Install DIR/*.whl into /tmp/site first.")
    parser.add_argument("--budget", type=float, default=None, help="Seconds for all steps (default: 535; dry run 1000).")
    parser.add_argument("--grid-s", type=float, default=None, help="Seconds for the grid step (default: 190).")
    parser.add_argument("--only", default=None, metavar="STEP,...", type=step_names,
                        help="Run these steps alone (the rest: skipped).")
    parser.add_argument("--resume", default=None, metavar="REPORT",
                        help="A former gpu_check.json: the grid's configs it holds as measured are not measured again.")
    parser.add_argument("--step", choices=STEPS, default=None, help=argparse.SUPPRESS)  # one step, in its process
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # where the step writes what it found
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # the step's end, epoch s
    return parser.parse_args(argv)


def child_env(profile: Profile, install: str | None) -> dict[str, str]:
    """The steps' environment: this checkout (and the installed wheels) importable, output unbuffered, and
    ``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's builder reads it (the ops step builds with it; a process that loads
    the op with another would build it again)."""
    paths = ([SITE] if install else []) + [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = os.environ | profile.env | {"PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}
    from autofit.core.software import deepspeed_arch_list

    if arch_list := deepspeed_arch_list(env.get("TORCH_CUDA_ARCH_LIST")):
        env["TORCH_CUDA_ARCH_LIST"] = arch_list
    return env


def supervise(name: str, args: argparse.Namespace, env: dict[str, str], limit_s: float, scratch: Path,
              report: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run one step in its own process group under ``limit_s``; what it wrote, its status and its output's tail.
    While it runs, the rows it writes reach the report (every 5 s)."""
    part = scratch / f"{name}.json"
    command = [sys.executable, "-m", "benchmarks.gpu.gpu_check", "--step", name, "--part", str(part), "--out", args.out,
               "--deadline", str(time.time() + limit_s)]
    command += ["--dry-run"] if args.dry_run else []
    command += ["--install", args.install] if args.install else []
    command += ["--resume", str(Path(args.resume).resolve())] if args.resume else []
    command += ["--grid-s", str(args.grid_s)] if args.grid_s is not None else []
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
    """``ok``, ``failed`` or ``timeout`` (the step leads a session: the whole session killed, its children's process
    groups and the compilers a build's ninja starts in groups of their own included)."""
    while process.poll() is None:
        if time.monotonic() > deadline:
            _end(process)
            process.wait()
            return "timeout"
        time.sleep(0.5)
        tick()
    _end(process)  # what the step left behind (a probe's rank, a build) goes with it
    return "ok" if process.returncode == 0 else "failed"


def _end(process: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group and the session ``process`` leads."""
    with _quiet():
        os.killpg(process.pid, signal.SIGKILL)
    kill_session(process.pid)


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
    """The steps' table, the grid's rows, and the tail of each failure's output."""
    kind = "dry run (CPU)" if report["dry_run"] else "GPU"
    lines = [f"# gpu_check: {kind}, {report['started']}", "", f"Model: `{report['model']}`.", "",
             "| step | status | wall s | limit s | summary |", "|---|---|---:|---:|---|"]
    for name in STEPS:
        r = report["steps"].get(name, {"status": "not run"})
        lines.append(f"| {name} | {r['status']} | {r.get('wall_s', '')} | {r.get('limit_s', '')} | "
                     f"{str(r.get('summary', '')).replace('|', '/')} |")
    for model, found in report["steps"].get("grid", {}).get("result", {}).get("models", {}).items():
        lines += ["", f"Grid: {model} ({found.get('n_params', 0) / 1e9:.2f} B parameters"
                  f"{', held out' if found.get('held_out') else ''}).", "",
                  "| config | status | median step ms | first step ms | allocated GiB | reserved GiB | NVML GiB |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        lines += [grid_line(row) for row in found.get("rows", [])]
    for name, r in report["steps"].items():
        if r["status"] in ("failed", "timeout"):
            lines += ["", f"## {name}: {r['status']}", "", "```", str(r.get("log_tail", ""))[-1500:], "```"]
    return "\n".join(lines) + "\n"


def grid_line(row: dict[str, Any]) -> str:
    def gib(key: str) -> str:
        return f"{row[key] / GIB:.2f}" if row.get(key) else ""

    times = row.get("step_times_s") or []
    settled = sorted(times[len(times) // 2:])
    median = f"{settled[len(settled) // 2] * 1e3:.1f}" if settled else ""
    first = f"{times[0] * 1e3:.0f}" if times else ""
    return (f"| {row['label']} | {row['status']} | {median} | {first} | {gib('max_memory_allocated_bytes')} | "
            f"{gib('max_memory_reserved_bytes')} | {gib('nvml_peak_bytes')} |")


# -- the steps, each in its own process ------------------------------------------------------------------------------


def run_step(args: argparse.Namespace) -> int:
    """One step: what it finds goes to ``--part`` (a JSON object; ``summary`` a line, ``ok`` false for a failure)."""
    from benchmarks.gpu import gpu_check_steps as steps

    profile = DRY if args.dry_run else GPU
    if args.grid_s is not None:
        profile = with_grid_seconds(profile, args.grid_s)
    part = Path(args.part)
    result = getattr(steps, f"step_{args.step}")(profile, args, lambda found: _save(part, found))
    _save(part, result)
    return 0 if result.get("ok", True) else 1


def _save(part: Path, found: dict[str, Any]) -> None:
    tmp = part.with_suffix(".tmp")
    tmp.write_text(json.dumps(found, indent=1, default=str))
    tmp.replace(part)


if __name__ == "__main__":
    sys.exit(main())
