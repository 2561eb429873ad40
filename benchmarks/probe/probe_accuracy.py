"""Is the probe right? Its peak memory and throughput against an independent measurement.

    python -m benchmarks.probe.probe_accuracy [--models mlp,gpt,cnn,lstm] [--repeats 1] [--zero 0]

For each model of benchmarks/probe/probe_models.py (fp32, AdamW, CPU, world size 1):

* the probe: ``autofit.probe.run.run_probe`` (VmHWM - VmRSS after imports, median step time);
* fake mode: ``run_probe(probe_spec(..., mode="fake"))`` (FakeTensorMode simulation, memory only);
* independent: this file run as a plain script (``--independent``) that trains the
  same steps with the same DeepSpeed JSON but shares no measuring code: memory is
  the child's ``ru_maxrss`` from ``os.wait4`` minus the ``ru_maxrss`` of a second
  child that only does the same imports (both with the probe's ``MALLOC_MMAP_THRESHOLD_``);
  throughput is a third child's own wall clock over the measured steps, started as a
  user would start training (no allocator setting).

Prints a markdown table of medians over ``--repeats`` and the relative errors
(targets: peak within 5 %, throughput within 30 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODELS_FILE = HERE / "probe_models.py"
STEPS, WARMUP = 5, 1


def independent(name: str, micro: int, zero: int, only_imports: bool) -> None:
    """The plain training script (run as a child): same imports, same JSON, its own clock."""
    import bitsandbytes  # noqa: F401
    import deepspeed
    import torch

    from autofit.core.config import Config
    from autofit.ds.emit import deepspeed_config
    from benchmarks.probe import probe_models

    if only_imports:
        workload = getattr(probe_models, name)()
        return
    workload = getattr(probe_models, name)()
    ds = deepspeed_config(Config(micro_batch_size=micro, zero_stage=zero))
    model = workload.model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    batch = workload.batch(micro)
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            t0 = time.perf_counter()
        loss = workload.compute_loss(engine, batch)
        engine.backward(loss)
        engine.step()
    elapsed = time.perf_counter() - t0
    print(
        json.dumps({"samples_per_s": micro * STEPS / elapsed, "loss": float(loss.item()), "torch": torch.__version__})
    )


def run_child(args: list[str], mmap_threshold: bool = True) -> tuple[int, str]:
    """Run this file as a child (with the probe's allocator setting, or none); returns (max RSS bytes, stdout)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    env["PYTHONPATH"] = str(ROOT)
    from autofit.probe.launch import free_port

    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.Popen(
        [sys.executable, __file__, "--independent", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    out = proc.stdout.read().decode() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"independent run {args} failed with status {status}")
    return usage.ru_maxrss * 1024, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,gpt,cnn,lstm", help="comma-separated names from probe_models.py")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each measurement (medians are reported)")
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage")
    parser.add_argument("--no-fake", action="store_true", help="skip the fake-mode column")
    parser.add_argument(
        "--independent", nargs=4, metavar=("NAME", "MICRO", "ZERO", "ONLY_IMPORTS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.independent:
        name, micro, zero, only = args.independent
        independent(name, int(micro), int(zero), only == "1")
        return

    from autofit.core.config import Config
    from autofit.core.units import format_bytes
    from autofit.machine.device import get_hardware
    from autofit.probe.run import run_probe
    from autofit.probe.spec import probe_spec
    from benchmarks.probe.probe_models import MODELS

    cpu = get_hardware("cpu")
    print(
        "| model | probe peak | independent peak | peak err | fake peak | fake err | probe samples/s "
        "| independent samples/s | throughput err |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        micro = MODELS[name]
        config = Config(micro_batch_size=micro, zero_stage=args.zero)
        probe_peak, probe_tput, ind_peak, ind_tput, fake_peak = [], [], [], [], []
        for _ in range(args.repeats):
            r = run_probe(probe_spec(f"{MODELS_FILE}:{name}", config, cpu, steps=STEPS, warmup_steps=WARMUP), timeout_s=900)
            if r.status != "ok":
                raise SystemExit(f"{name}: probe {r.status}: {r.message}")
            probe_peak.append(r.peak_bytes)
            probe_tput.append(r.samples_per_s)
            base, _ = run_child([name, str(micro), str(args.zero), "1"])
            full, _ = run_child([name, str(micro), str(args.zero), "0"])
            _, out = run_child([name, str(micro), str(args.zero), "0"], mmap_threshold=False)
            ind_peak.append(full - base)
            ind_tput.append(json.loads(out.strip().splitlines()[-1])["samples_per_s"])
            if not args.no_fake:
                f = run_probe(probe_spec(f"{MODELS_FILE}:{name}", config, cpu, mode="fake"), timeout_s=900)
                fake_peak.append(f.peak_bytes if f.status == "ok" else 0)
        pp, ip, pt, it = (statistics.median(v) for v in (probe_peak, ind_peak, probe_tput, ind_tput))
        fp = statistics.median(fake_peak) if fake_peak else 0
        fake_cells = f"{format_bytes(fp)} | {100 * (fp - pp) / pp:+.1f} %" if fake_peak else "- | -"
        print(
            f"| {name} | {format_bytes(pp)} | {format_bytes(ip)} | {100 * (pp - ip) / ip:+.1f} % | {fake_cells} "
            f"| {pt:.1f} | {it:.1f} | {100 * (pt - it) / it:+.1f} % |",
            flush=True,
        )


if __name__ == "__main__":
    main()
