"""The peers of ``compare_search.py``, each run as its users run it: Lightning's batch-size finder and
DeepSpeed's autotuner.

**Lightning** (``Tuner(trainer).scale_batch_size(module, mode=...)``, ``power`` and ``binsearch``) runs in a
child process per model, budget and mode: a ``LightningModule`` around the workload's model (fp32,
``torch.optim.AdamW``, checkpointing off), one OpenMP thread, default ``init_val``/``max_val``/
``steps_per_trial``. A CPU has no device to run out of, so the budget is imposed the way autofit's probe
and the oracle measure a CPU device (docs/design.md, "Memory, measured"): the process starts with ``MALLOC_MMAP_THRESHOLD_=65536``
(freed tensors go back to the OS), its RSS after the imports is the baseline, the high-water mark is reset
before each step, and a callback raises the error a CPU allocator raises (``RuntimeError("DefaultCPUAllocator:
can't allocate memory: ...")``, which Lightning's ``is_oom_error`` recognises) after any step whose
``VmHWM - baseline`` passed the budget. The finder then does what it does on a GPU's OOM.

**DeepSpeed's autotuner** (``deepspeed --autotuning tune --num_gpus 1 ds_autotune_train.py --deepspeed
ds.json``, fast mode, AdamW, micro-batch 1-4 asked) runs once per model: it has no memory-budget setting
(it sizes against ``get_accelerator().total_memory()``, the whole 24 GiB host here), so its pick is the
same for every budget and is judged against each by its measured peak.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common as cc

AUTOTUNE_CONFIG = {
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "autotuning": {"enabled": True, "fast": True, "min_train_batch_size": 4, "max_train_batch_size": 4,
                   "max_train_micro_batch_size_per_gpu": 4, "start_profile_step": 2, "end_profile_step": 4},
}
#: DeepSpeed 0.19's scheduler cleans up every experiment with ``pdsh -w localhost pkill -f <exp>``
NEEDS = ("pdsh",)


def run_finder(entry: str, budget_bytes: int, mode: str) -> dict[str, Any]:
    """Lightning's finder in a child (``--child``): the batch size it returns, the trials, the wall time."""
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(cc.ROOT)}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, __file__, "--child", entry, str(budget_bytes), mode], capture_output=True,
                         text=True, env=env, cwd=cc.ROOT, timeout=1800)
    wall_s = time.monotonic() - t0
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {out.returncode}: {tail[:200]}", "wall_s": wall_s}
    return json.loads(lines[-1]) | {"wall_s": wall_s}


def finder_child(entry: str, budget_bytes: int, mode: str) -> dict[str, Any]:
    """Runs in the child: build the module, impose the budget, let Lightning search."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from autofit.probe.rank.memory import hwm_bytes, reset_peak, rss_bytes
    from autofit.workload.entry import load_workload

    torch.set_num_threads(1)
    workload = load_workload(entry)
    baseline = rss_bytes()  # after the imports, as the probe measures
    trials: list[list[Any]] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = workload.build_model(attention="sdpa")
            self.batch_size = 1

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return workload.compute_loss(self.net, batch)

        # the budget lives in the module's own hooks: the finder takes the trainer's callbacks away while it runs
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                trials.append([self.batch_size, "ok", 0])
            reset_peak()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            peak = hwm_bytes() - baseline
            trials[-1][2] = max(trials[-1][2], peak)
            print(f"  finder batch {self.batch_size} step {batch_idx}: {peak / cc.MIB:.1f} MiB", file=sys.stderr, flush=True)
            if peak > budget_bytes:
                trials[-1][1] = "oom"
                raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: the step held {peak} bytes, "
                                   f"past the {budget_bytes}-byte budget")

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            return DataLoader(range(4096), batch_size=self.batch_size, collate_fn=lambda ids: workload.batch(len(ids)))

    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
        try:
            found = L.pytorch.tuner.Tuner(trainer).scale_batch_size(Module(), mode=mode, init_val=1)
        except ValueError as exc:  # what Lightning raises when even batch size 1 ran out of memory: it tries 0
            return {"found": None, "error": f"{type(exc).__name__}: {exc}", "trials": trials, "lightning": L.__version__}
    return {"found": found, "trials": trials, "lightning": L.__version__}


def run_autotuner(model: str, work: Path) -> dict[str, Any]:
    """DeepSpeed's autotuner on one model; what it wrote as optimal, its experiments, the wall time."""
    missing = [tool for tool in NEEDS if shutil.which(tool) is None]
    if missing:
        return {"error": f"needs {', '.join(missing)} on PATH (apt-get install pdsh): its scheduler runs "
                         "`pdsh -w localhost pkill -f <experiment>` after every experiment, even on one node"}
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "ds.json").write_text(json.dumps(AUTOTUNE_CONFIG))
    cmd = ["deepspeed", "--autotuning", "tune", "--num_gpus", "1", str(cc.ROOT / "benchmarks" / "peers" / "ds_autotune_train.py"),
           "--model", model, "--deepspeed", str(work / "ds.json")]
    env = os.environ | {"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(cc.ROOT)}
    t0 = time.monotonic()
    with open(work / "autotune.log", "w") as log:
        subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600, check=False)
    wall_s = time.monotonic() - t0
    results = work / "autotuning_results"
    optimal = results / "ds_config_optimal.json"
    experiments = {d.name: json.loads((d / "metrics.json").read_text()).get("throughput")
                   for d in sorted(results.glob("z*")) if (d / "metrics.json").exists()}
    if not optimal.exists():
        lines = [ln for ln in (work / "autotune.log").read_text().splitlines() if "ERROR" in ln or "Error" in ln]
        return {"error": (lines or ["no ds_config_optimal.json written"])[-1][-300:], "wall_s": wall_s,
                "experiments": experiments}
    return {"optimal": json.loads(optimal.read_text()), "experiments": experiments, "wall_s": wall_s,
            "n_experiments": len(experiments) + 1}  # + the model-info profile run


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    print(json.dumps(finder_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
