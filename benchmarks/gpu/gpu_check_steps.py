"""The steps of ``benchmarks/gpu/gpu_check.py``, each run in its own process by it: ``step_NAME(profile, args, save)``
returns what it found (a JSON object: ``summary`` one line, ``ok`` False for a failure); ``save`` writes what it
has so far, so a step cut at its limit still reports its rows."""

from __future__ import annotations

import contextlib
import functools
import glob
import gzip
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autofit.core.config import Config
from benchmarks.gpu.gpu_check_profiles import GIB, ROOT, SITE, Profile, host_line, save_histories

Save = Callable[[dict[str, Any]], None]
#: the packages whose versions the env step reports
PACKAGES = ("torch", "deepspeed", "transformers", "optuna", "sqlalchemy", "torchao", "flash_attn", "triton",
            "nvidia-ml-py", "pytest")


def step_install(profile: Profile, args: Any, save: Save) -> dict[str, Any]:
    """The carried wheels into ``/tmp/site`` (offline: no index, no dependencies resolved)."""
    wheels = sorted(glob.glob(str(Path(args.install) / "*.whl")))
    if not wheels:
        return {"ok": False, "summary": f"no wheels in {args.install}"}
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", SITE, *wheels], capture_output=True, text=True)
    names = [Path(w).name.split("-")[0] for w in wheels]
    if done.returncode != 0:
        return {"ok": False, "wheels": names, "stderr": done.stderr[-2000:], "summary": done.stderr.strip()[-300:]}
    # byte-compiled once here, not again by every process that imports them (pip's --no-compile kept the carry small)
    t0 = time.time()
    compiled = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", SITE, str(ROOT / "autofit")],
                              capture_output=True, text=True)
    return {"ok": True, "wheels": names, "compile_s": round(time.time() - t0, 1), "compiled": compiled.returncode == 0,
            "summary": f"{len(wheels)} wheels into {SITE}, byte-compiled in {time.time() - t0:.0f} s"}


def step_env(profile: Profile, args: Any, save: Save) -> dict[str, Any]:
    """torch, CUDA, the device, NVML, and what autofit detects here."""
    import torch

    from autofit.machine.device import get_hardware
    from autofit.machine.software import software_here_dict

    found: dict[str, Any] = {"host": host_line(), "versions": versions(), "cuda_available": torch.cuda.is_available(),
                             "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found["device"] = {"name": props.name, "capability": f"sm{props.major}{props.minor}",
                           "memory_bytes": props.total_memory, "count": torch.cuda.device_count()}
    found["nvml"] = nvml()
    found["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    found["cpu_count"] = os.cpu_count()
    hardware = get_hardware(profile.hardware)
    found["autofit_hardware"] = hardware.to_dict()
    found["autofit_software"] = software_here_dict()
    device = found.get("device")
    where = (f"{device['name']} ({device['capability']}, {device['memory_bytes'] / GIB:.1f} GiB)" if device
             else "no CUDA device")
    software = found["autofit_software"]
    has = [k for k in ("flash_attn", "triton", "cuda_toolkit", "libaio", "torchao") if software.get(k)]
    found["summary"] = (f"torch {torch.__version__}, CUDA {torch.version.cuda}, {where}; NVML "
                        f"{found['nvml'].get('driver', found['nvml'].get('error'))}; autofit detects {hardware.name}, "
                        f"software {', '.join(has) or 'none of flash-attn/triton/nvcc/libaio/torchao'}")
    found["ok"] = bool(device) or args.dry_run
    return found


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def nvml() -> dict[str, Any]:
    """NVML's driver and first device, or why not."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        return {"driver": pynvml.nvmlSystemGetDriverVersion(), "device": name if isinstance(name, str) else name.decode(),
                "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)}
    except Exception as error:  # no bindings, no driver, no device: said, not fatal
        return {"error": f"{type(error).__name__}: {error}"[:200]}


def grid_configs(profile: Profile) -> list[Any]:
    """Every config the grid measures (the ops step builds what they need)."""
    from autofit.core.config import Config

    return [Config.from_dict(item["config"]) for model in profile.grid
            for item in model.items(profile.precision, profile.optimizer)]


def step_ops(profile: Profile, args: Any, save: Save) -> dict[str, Any]:
    """DeepSpeed's compiled ops the grid and the search need, built or loaded once (their own step, as the probes)."""
    from autofit.machine.device import get_hardware
    from autofit.probe.ops import prepare_ops

    report = prepare_ops(grid_configs(profile), get_hardware(profile.hardware))
    failed = {op: state for op, state in report.loaded.items() if state != "ok"}
    return {"ok": not failed, "ops": list(report.ops), "loaded": report.loaded, "seconds": report.seconds,
            "arch_list": report.arch_list, "summary": "; ".join(report.lines()) or "no compiled op needed"}


def step_host(profile: Profile, args: Any, save: Save) -> dict[str, Any]:
    """The host's constants (benchmarks/gpu/gpu_check_host.py), in a process of their own."""
    part = Path(args.part).with_suffix(".host.json")
    command = [sys.executable, "-m", "benchmarks.gpu.gpu_check_host", "--part", str(part)]
    command += ["--quick"] if profile.host_quick else []
    done = run_child(command, float(args.deadline), Path(args.part).with_suffix(".host.log"))
    found = read_json(part)
    found.setdefault("summary", done["summary"])
    found["ok"] = done["ok"] and found.get("ok", False)
    found["log_tail"] = done["log_tail"]
    return found


def step_grid(profile: Profile, args: Any, save: Save) -> dict[str, Any]:
    """Each grid model in processes of its own (benchmarks/gpu/gpu_check_grid.py) under its own share of the step; a
    process that stops because a config leaked tensors is followed by a fresh one for the configs left. The rows as
    they come; the allocator histories merged into ``OUT/alloc_history_<model>.json.gz``. ``--resume REPORT``: the
    configs a report already holds as measured are not measured again."""
    found: dict[str, Any] = {"models": {}}
    scratch = Path(args.part).parent
    for index, model in enumerate(profile.grid):
        later = sum(m.limit_s for m in profile.grid[index + 1:])
        deadline = min(time.time() + model.limit_s, float(args.deadline) - later)
        measured = resumed_labels(args.resume, model.name)
        todo = [item for item in model.items(profile.precision, profile.optimizer) if item["label"] not in measured]
        rows: dict[str, Any] = {"rows": [], "processes": [], "resumed": sorted(measured)}
        found["models"][model.name] = rows
        histories: dict[str, Any] = {}
        while todo and time.time() < deadline - 20:
            done, part = grid_process(profile, model, todo, deadline, scratch / f"grid_{model.name}_{len(rows['processes'])}",
                                      functools.partial(_grid_progress, found, model.name, rows, save))
            histories |= read_histories(part.with_suffix(".history.json.gz"))
            result = read_json(part)
            ran = [r for r in result.get("rows", []) if r["status"] != "skipped"]
            rows["rows"] += ran
            rows.update({k: v for k, v in result.items() if k not in ("rows", "ok", "summary")})
            rows["processes"].append({"configs": len(ran), "summary": done["summary"],
                                      "leaked_after": result.get("leaked_after"),
                                      "log_tail": done["log_tail"] if not done["ok"] else ""})
            todo = [item for item in todo if item["label"] not in {r["label"] for r in ran}]
            if not result.get("leaked_after") or not ran:
                break
        rows["rows"] += [{"label": item["label"], "status": "skipped", "message": "the step's time is spent"}
                         for item in todo]
        if histories:
            save_histories(str(Path(args.out).resolve() / f"alloc_history_{model.name}.json.gz"), histories)
        found["models"][model.name] = rows  # the progress showed a copy
        rows.update(held_out=model.held_out, ok=all(r["status"] == "ok" for r in rows["rows"]),
                    summary=f"{sum(r['status'] == 'ok' for r in rows['rows'])} of {len(rows['rows'])} configs ran "
                            f"in {len(rows['processes'])} processes")
        save(found)
    all_rows = [r for m in found["models"].values() for r in m.get("rows", [])]
    ran = sum(r["status"] == "ok" for r in all_rows)
    found["ok"] = all(m["ok"] for m in found["models"].values())
    found["summary"] = (f"{ran} of {len(all_rows)} configs ran in {len(found['models'])} models; "
                        + "; ".join(f"{n}: {m['summary']}" for n, m in found["models"].items()))
    return found


def grid_process(profile: Profile, model: Any, items: list[dict[str, Any]], deadline: float, stem: Path,
                 tick: Callable[[Path], None]) -> tuple[dict[str, Any], Path]:
    """One process of ``benchmarks/gpu/gpu_check_grid.py`` measuring ``items`` until ``deadline``; (its end, its rows' file)."""
    configs, part = stem.with_suffix(".configs.json"), stem.with_suffix(".json")
    configs.write_text(json.dumps(items))
    command = [sys.executable, "-m", "benchmarks.gpu.gpu_check_grid", "--entry", model.entry,
               "--configs", str(configs), "--part", str(part), "--hidden-size", str(model.hidden_size),
               "--steps", str(profile.steps), "--deadline", str(deadline - 5),
               "--history", str(part.with_suffix(".history.json.gz"))]
    done = run_child(command, deadline, stem.with_suffix(".log"), tick=functools.partial(tick, part))
    return done, part


def resumed_labels(report: str | None, model: str) -> set[str]:
    """The labels a former report (``--resume``) holds as measured for ``model``."""
    if not report:
        return set()
    found = read_json(Path(report)).get("steps", {}).get("grid", {}).get("result", {}).get("models", {})
    return {r["label"] for r in found.get(model, {}).get("rows", []) if r["status"] not in ("skipped", "invalid")}


def read_histories(path: Path) -> dict[str, Any]:
    try:
        with gzip.open(path, "rt") as source:
            return json.load(source)
    except (OSError, ValueError):
        return {}


def _grid_progress(found: dict[str, Any], name: str, rows: dict[str, Any], save: Save, part: Path) -> None:
    """The running process's rows shown after the rows of the processes before it."""
    running = [r for r in read_json(part).get("rows", []) if r["status"] != "skipped"]
    if running:
        found["models"][name] = rows | {"rows": rows["rows"] + running}
        save(found)


def run_child(command: list[str], deadline: float, log: Path, tick: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """``command`` until ``deadline`` (epoch s; its process group killed then), its output into ``log``."""
    with open(log, "w") as sink:
        # a process group of its own in this step's session, not a session of its own: gpu_check kills the step's
        # session at the step's limit, and a session of its own would outlive it
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, preexec_fn=os.setpgrp)
        timed_out = False
        while process.poll() is None:
            if time.time() > deadline:
                timed_out = True
                break
            time.sleep(1.0)
            tick()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    tail = log.read_text(errors="replace")[-3000:]
    ok = not timed_out and process.returncode == 0
    last = (tail.strip().splitlines() or ["no output"])[-1][:200]
    summary = "cut at its limit" if timed_out else ("done" if ok else f"exit {process.returncode}: {last}")
    return {"ok": ok, "summary": summary, "log_tail": tail}


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def step_run(profile: Profile, args: Any, save: Save) -> dict[str, Any]:
    """A 3-trial ``autofit run`` (1 in the dry run) with its verification; the winner's JSON in ``OUT/ds_config.json``."""
    out = Path(args.out).resolve() / "ds_config.json"
    storage = f"sqlite:///{Path(args.part).with_suffix('.db')}"
    command = [sys.executable, "-c", "from autofit.cli import main; main()", "run", profile.run_entry,
               "--seq-len", str(profile.seq_len), "--hardware", profile.hardware, "--gpus", "1",
               "--optimizer", profile.optimizer, "--precision", profile.precision, "--trials", str(profile.trials),
               "--out", str(out), "--storage", storage, "--json", *run_options(profile)]
    timeout = max(float(args.deadline) - time.time() - 5, 1)
    # the search's own budget ends it with a verified winner before the step's limit cuts it
    command += ["--time-budget", f"{max(timeout - 15, 1):.0f}"]
    log = Path(args.part).with_suffix(".run.log")
    with open(log, "w") as progress:  # the search's progress lines: what a cut-short run got to
        try:
            done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=progress, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            lines = log.read_text(errors="replace").strip().splitlines()
            return {"ok": False, "progress": lines[-20:],
                    "summary": f"autofit run passed its {timeout:.0f} s at: {(lines or ['its start'])[-1][:200]}"}
    stderr = log.read_text(errors="replace")
    hint = [line for line in stderr.splitlines() if "fill_auto" in line]
    if done.returncode != 0:
        return {"ok": False, "returncode": done.returncode, "stderr": stderr[-3000:],
                "summary": (stderr.strip().splitlines() or ["no output"])[-1][:300]}
    result = json.loads(done.stdout)
    best, trials = result["best"], result["trials"]
    verified = [t for t in trials if t.get("phase") == "verify"]
    measured = best["measured"]
    return {"ok": bool(verified), "best": best["config"], "measured_peak_bytes": measured.get("peak_bytes"),
            "measured_samples_per_s": measured.get("samples_per_s"), "n_probes": len(trials),
            "n_verify": len(verified), "stop_reason": result["search"]["stop_reason"], "auto_hint": hint,
            "wrote": str(out) if out.exists() else None,
            "ranks": [line for line in stderr.splitlines() if "probe ranks" in line][:1],
            "probes": [probe_costs(t) for t in trials],
            "summary": (f"{len(trials)} probes ({len(verified)} verifying); winner "
                        f"{Config.from_dict(best['config']).label()}: {measured.get('samples_per_s', 0):.3g} samples/s, "
                        f"peak {measured.get('peak_bytes', 0) / GIB:.2f} GiB")}


def probe_costs(trial: dict[str, Any]) -> dict[str, Any]:
    """One trial's probe: its wall time, its timed steps, its phases (start-up, untimed steps apart)."""
    measured = trial.get("measured", {})
    timed = sum(measured.get("step_times_s") or [])
    return {"config": Config.from_dict(trial["config"]).label(), "status": measured.get("status"),
            "wall_s": measured.get("wall_s"), "timed_steps_s": timed,
            "overhead_s": (measured.get("wall_s") or 0.0) - timed, "phases_s": measured.get("phases_s"),
            "warmup_times_s": measured.get("warmup_times_s")}


def run_options(profile: Profile) -> list[str]:
    """The search's own options: the global batch, the space's keys fixed to keep it short, a CPU's budget."""
    options = ["--global-batch", str(4 * profile.run_micro_batch)]
    for value in profile.run_set:
        options += ["--set", value]
    if profile.hardware == "cpu":
        options += ["--space", "cpu", "--memory", "2GiB"]
    return options


def step_pytest(profile: Profile, args: Any, save: Save) -> dict[str, Any]:
    """``pytest -m gpu``: the tests that need a CUDA device (skipped without one)."""
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=",
               "-v", "-rfEs", "--durations=0", *profile.pytest_paths]
    timeout = max(float(args.deadline) - time.time() - 5, 1)
    log = Path(args.part).with_suffix(".pytest.log")  # each test's line as it ends: what a cut-short run got to
    with open(log, "w") as sink:
        try:
            done = subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout,
                                  env=os.environ | {"PYTHONDONTWRITEBYTECODE": "1"})
        except subprocess.TimeoutExpired:
            output = log.read_text(errors="replace")
            ended = [line for line in output.splitlines() if "::" in line and ("PASSED" in line or "FAILED" in line
                                                                               or "SKIPPED" in line)]
            return {"ok": False, "summary": f"pytest passed its {timeout:.0f} s after {len(ended)} tests",
                    "tests": ended, "output": output[-3000:]}
    output = log.read_text(errors="replace")
    lines = output.strip().splitlines()
    return {"ok": done.returncode in (0, 5), "returncode": done.returncode, "output": output[-3000:],
            "summary": lines[-1] if lines else "no output"}
