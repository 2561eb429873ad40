"""The steps of ``benchmarks/gpu_check.py``, each run in its own process by it: ``step_NAME(profile, args, save)``
returns what it found (a JSON object: ``summary`` one line, ``ok`` False for a failure); ``save`` writes what it
has so far, so a step cut at its limit still reports its rows."""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from gpu_check import GIB, ROOT, SITE, Profile, host_line

from autofit.core.config import Config

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
    return {"ok": done.returncode == 0, "wheels": names, "stderr": done.stderr[-2000:],
            "summary": f"{len(wheels)} wheels into {SITE}" if done.returncode == 0 else done.stderr.strip()[-300:]}


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


def setup_of(profile: Profile, args: Any) -> Any:
    """The accuracy grid's setup, probed here (the rules judge by this machine's software)."""
    from autofit.planning.target import Target, prepare

    space = Path(args.part).with_suffix(".space.yaml")
    space.write_text(yaml.safe_dump(space_values(profile)))
    allow = ("fp8",) if "fp8" in profile.grid.get("precision", ()) else ()
    target = Target(entry=profile.entry, seq_len=profile.seq_len, hardware=profile.hardware, gpus=1,
                    global_batch=profile.micro_batch, space=str(space), optimizer=profile.optimizer,
                    precision=profile.precision, allow=allow)
    return prepare(target, probes_here=True)


def space_values(profile: Profile) -> dict[str, Any]:
    """The accuracy step's space: the grid, every other key at one value."""
    fixed = {"micro_batch_size": [profile.micro_batch], "checkpoint_granularity": ["block"],
             "optimizer": [profile.optimizer], "offload_optimizer": ["none"], "offload_params": ["none"],
             "overlap_comm": [False], "contiguous_gradients": [True], "bucket_scale": [1]}
    return {"description": "gpu_check's accuracy grid", "global_batch_size": profile.micro_batch, **fixed,
            **{key: list(values) for key, values in profile.grid.items()}}


def checked_configs(profile: Profile) -> list[Config]:
    """The handful measured: the grid's first values, each changed as :attr:`Profile.checked` says."""
    base = {key: values[0] for key, values in profile.grid.items()}
    return [Config(micro_batch_size=profile.micro_batch, optimizer=profile.optimizer, **(base | change))
            for change in profile.checked]


def step_ops(profile: Profile, args: Any, save: Save) -> dict[str, Any]:
    """DeepSpeed's compiled ops the checked configs need, built or loaded once (their own step, as the probes)."""
    from autofit.probe.ops import prepare_ops

    setup = setup_of(profile, args)
    report = prepare_ops(checked_configs(profile), setup.hardware, setup.software)
    failed = {op: state for op, state in report.loaded.items() if state != "ok"}
    return {"ok": not failed, "ops": list(report.ops), "loaded": report.loaded, "seconds": report.seconds,
            "summary": "; ".join(report.lines()) or "no compiled op needed"}


def step_accuracy(profile: Profile, args: Any, save: Save) -> dict[str, Any]:
    """Predicted vs measured peak and throughput of each checked config the rules let run here; saved row by row."""
    from autofit.probe.ops import prepare_ops

    setup = setup_of(profile, args)
    plan = setup.plan()
    offered = {c.key() for c in plan.candidates}
    found: dict[str, Any] = {"rows": [], "pruned": [], "software": setup.software.to_dict(),
                             "hardware": setup.hardware.name}
    configs = checked_configs(profile)
    software = prepare_ops(configs, setup.hardware, setup.software).software(setup.software)
    for config in configs:
        if config.key() not in offered:
            found["pruned"].append(f"{config.label()}: {pruned_reason(plan, config)}")
            continue
        left = float(args.deadline) - time.time() - 5
        if left < 20:
            found["pruned"].append(f"{config.label()}: not run, {left:.0f} s left in the step")
            continue
        found["rows"].append(measure(setup, plan, config, min(profile.probe_timeout_s, left), software))
        found["summary"] = accuracy_summary(found)
        save(found)
    found["summary"] = accuracy_summary(found)
    found["ok"] = bool(found["rows"]) and all(r["status"] == "ok" for r in found["rows"])
    return found


def pruned_reason(plan: Any, config: Config) -> str:
    """Why the plan's rules removed ``config``: the reasons of the rejections its values match."""
    values = config.to_dict()
    reasons = [reason for partial, reason in plan.rejected if all(values.get(k) == v for k, v in partial.items())]
    return "; ".join(dict.fromkeys(reasons)) or "not a candidate here"


def measure(setup: Any, plan: Any, config: Config, timeout_s: float, software: Any) -> dict[str, Any]:
    from autofit.probe.run import run_probe
    from autofit.probe.spec import probe_spec

    predicted = plan.predict(config)
    spec = probe_spec(plan.entry, config, plan.hardware, 1, steps=5, warmup_steps=2, software=software,
                      facts=plan.facts)
    result = run_probe(spec, timeout_s=timeout_s)
    memory = result.device_memory
    allocator = (memory.get("max_memory_reserved_bytes") or 0) + (memory.get("context_bytes") or 0)
    ok = result.status == "ok"
    return {
        "label": config.label(), "config": config.to_dict(), "status": result.status,
        "message": (result.message or "")[:300] or None,
        "predicted_peak_bytes": predicted.peak_bytes, "measured_peak_bytes": result.peak_bytes if ok else None,
        "nvml_peak_bytes": memory.get("nvml_peak_bytes"), "reserved_plus_context_bytes": allocator or None,
        # the live tensors' peak, apart from what the caching allocator keeps reserved beside them
        "max_memory_allocated_bytes": memory.get("max_memory_allocated_bytes"),
        "max_memory_reserved_bytes": memory.get("max_memory_reserved_bytes"),
        "predicted": predicted.to_dict(),
        "step_times_s": result.step_times_s, "phases_s": result.phases_s,
        "predicted_samples_per_s": predicted.samples_per_s,
        "measured_samples_per_s": result.samples_per_s if ok else None,
        "peak_error": error(predicted.peak_bytes, result.peak_bytes) if ok else None,
        "throughput_error": error(predicted.samples_per_s, result.samples_per_s) if ok else None,
        "compile_s": result.phases_s.get("compile_s"), "wall_s": round(result.wall_s, 1),
    }


def error(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured else None


def accuracy_summary(found: dict[str, Any]) -> str:
    ok = [r for r in found["rows"] if r["status"] == "ok"]
    if not ok:
        return f"no config ran ({len(found['rows'])} tried, {len(found['pruned'])} pruned)"
    peak = max(abs(r["peak_error"]) for r in ok)
    speed = max(abs(r["throughput_error"]) for r in ok if r["throughput_error"] is not None)
    return (f"{len(ok)} of {len(found['rows'])} configs ran, {len(found['pruned'])} pruned; worst |error| peak "
            f"{peak:.1%}, throughput {speed:.1%}")


def step_run(profile: Profile, args: Any, save: Save) -> dict[str, Any]:
    """A 3-trial ``autofit run`` (1 in the dry run) with its verification; the winner's JSON in ``OUT/ds_config.json``."""
    out = Path(args.out).resolve() / "ds_config.json"
    storage = f"sqlite:///{Path(args.part).with_suffix('.db')}"
    command = [sys.executable, "-c", "from autofit.cli import main; main()", "run", profile.entry,
               "--seq-len", str(profile.seq_len), "--hardware", profile.hardware, "--gpus", "1",
               "--optimizer", profile.optimizer, "--precision", profile.precision, "--trials", str(profile.trials),
               "--out", str(out), "--storage", storage, "--json", *run_options(profile)]
    timeout = max(float(args.deadline) - time.time() - 5, 1)
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
            "summary": (f"{len(trials)} probes ({len(verified)} verifying); winner "
                        f"{Config.from_dict(best['config']).label()}: {measured.get('samples_per_s', 0):.3g} samples/s, "
                        f"peak {measured.get('peak_bytes', 0) / GIB:.2f} GiB")}


def run_options(profile: Profile) -> list[str]:
    """The search's own options: the global batch, the space's keys fixed to keep it short, a CPU's budget."""
    options = ["--global-batch", str(4 * profile.micro_batch)]
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
