"""What a model's kernels leave resident on a CPU device: measured once, in a fresh process.

On a CPU the device is the process (docs/design.md: peak RSS less RSS after the imports), so a step's
peak holds, beside its tensors, every page of code and every kernel cache its operators touched
since the imports: libtorch's and oneDNN's code (a first convolution forward and backward maps
~10 MiB of it, a first fp32 matmul ~7), oneDNN's JIT kernels and primitives (a 16-bit matmul of a
new shape ~1.7 MiB, up to the primitive cache's capacity), the allocator's arenas. Which pages,
and how many, depends on the model's operators, not on the config's tensors: measured here on this
project's CPU, 15.4 MiB (a residual MLP) to 24.1 MiB (a ResNet) in fp32, 19.9 to 36.0 MiB (a ViT)
in bf16, over eight architectures. No count of the traced operators predicted it, and the trace
runs on fake tensors, which touch no kernel.

So on a CPU device autofit measures it: ``python -m autofit.probe.footprint ENTRY PRECISION
ATTENTION OUT`` imports what a probe imports (:func:`autofit.probe.rank.worker.import_workload`), takes
the same baseline, builds the model in that precision, runs :data:`FOOTPRINT_STEPS` forward and
backward passes of one sample, frees the model and writes what stays resident. The cost model adds
it to the runtime (:attr:`autofit.cost_model.facts.ModelFacts.kernel_footprint_bytes`). Where it is
not measured (a GPU, a model too large to run here, a failure), the runtime's default stands.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from autofit.ds.emit import write_json_atomic
from autofit.probe.launch import free_port, rank_env
from autofit.probe.rank.memory import rss_bytes
from autofit.probe.rank.worker import import_workload
from autofit.trace.tensors import cast_batch, to_dtype

#: forward and backward passes measured: the first touches the kernels, the second their caches' reuse
FOOTPRINT_STEPS = 2
#: seconds one measurement may take (imports ~5, the passes of a model that fits a CPU a few more)
FOOTPRINT_TIMEOUT_S = 300.0


@functools.cache
def measured_footprint_bytes(entry: str, precision: str, attention: str) -> int | None:
    """Bytes a fresh process holds after ``entry``'s model ran in ``precision`` (``fp32``, ``bf16``), beyond
    its imports and with the model freed; None when the measurement fails (the caller keeps its default)."""
    env = rank_env(dict(os.environ), 0, 1, free_port(), "cpu")
    with tempfile.TemporaryDirectory(prefix="autofit-footprint-") as workdir:
        out = Path(workdir) / "footprint.json"
        try:
            subprocess.run([sys.executable, "-m", "autofit.probe.footprint", entry, precision, attention, str(out)],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=FOOTPRINT_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return None
        if not out.exists():
            return None
        return int(json.loads(out.read_text())["bytes"])


def measure(entry: str, precision: str, attention: str) -> int:
    """In this (fresh) process: RSS left by :data:`FOOTPRINT_STEPS` passes of one sample, less the baseline."""
    import deepspeed  # noqa: F401  (a probe imports it before its baseline)
    import torch


    workload = import_workload(entry, attention, torch)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    baseline = rss_bytes()
    model = to_dtype(workload.build_model(attention=attention), dtype)
    model.train()
    for _ in range(FOOTPRINT_STEPS):
        loss = workload.compute_loss(model, cast_batch(workload.batch(1), dtype))
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)
    del model
    gc.collect()
    return max(0, rss_bytes() - baseline)


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print("usage: python -m autofit.probe.footprint ENTRY PRECISION ATTENTION OUT", file=sys.stderr)
        return 2
    entry, precision, attention, out = argv[1:5]
    write_json_atomic(Path(out), {"bytes": measure(entry, precision, attention)})
    return 0


def footprints_for(entry: str, precisions: tuple[str, ...], attention: str) -> dict[str, int]:
    """``{precision: bytes}`` for the precisions measured; those that failed are left out."""
    measured = {p: measured_footprint_bytes(entry, p, attention) for p in precisions}
    return {p: b for p, b in measured.items() if b is not None}


if __name__ == "__main__":
    sys.exit(main(sys.argv))
