"""What a model's kernels leave resident on a CPU device: measured once, in a fresh process.

On a CPU the device is the process (docs/design.md: peak RSS less RSS after the imports), so a step's
peak holds, beside its tensors, every page of code and every kernel cache its operators touched
since the imports: libtorch's and oneDNN's code (a first convolution forward and backward maps
~10 MiB of it, a first fp32 matmul ~7), oneDNN's JIT kernels and primitives (a 16-bit matmul of a
new shape ~1.7 MiB, up to the primitive cache's capacity), the allocator's arenas. Which pages,
and how many, depends on the model's operators, not on the config's tensors: measured on an avx512_bf16
CPU, 15.4 MiB (a residual MLP) to 24.1 MiB (a ResNet) in fp32, 19.9 to 36.0 MiB (a ViT)
in bf16, over eight architectures. No count of the traced operators predicted it, and the trace
runs on fake tensors, which touch no kernel.

So on a CPU device autofit measures it: ``python -m autofit.probe.footprint ENTRY PRECISION
ATTENTION OUT`` imports what a probe imports (:func:`autofit.probe.rank.worker.import_workload`), builds the
model in that precision and initializes it as a probe does (DeepSpeed, ZeRO-0), runs :data:`FOOTPRINT_STEPS`
forward and backward passes of one sample and writes what they left resident beyond the initialized process
(:func:`measure`). The cost model adds it to the runtime
(:attr:`autofit.cost_model.facts.ModelFacts.kernel_footprint_bytes`). Where it is not measured (a GPU, a model
too large to run here, a failure), the runtime's default stands.

Checkpointing leaves more resident, whatever the model: non-reentrant checkpointing
(torch/utils/checkpoint.py, ``early_stop`` on by default) ends each recompute by raising
``_StopRecomputationError`` from a saved tensor's unpack hook, through libtorch's C++ frames, and the C++
unwinder reads libtorch_cpu's and libtorch_python's unwind tables (``.eh_frame``, ``.gcc_except_table``: 17.3 and
5.6 MiB in libtorch_cpu 2.13) to get there. Those pages stay mapped: measured from ``/proc/self/smaps``, a first
checkpointed forward and backward adds 2.9 MiB of libtorch_cpu and 0.9 of libtorch_python to a process that ran
the same model plainly (a two-layer MLP), and 0.3 and 0.1 with ``set_checkpoint_early_stop(False)``. So the
same process then runs the model again with every repeated layer checkpointed (as :func:`autofit.ds.apply.
apply_checkpointing` wraps them) and writes what is resident after that too, under
:func:`autofit.cost_model.facts.footprint_key`'s checkpointed key.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from autofit.cost_model.facts import footprint_key
from autofit.ds.apply import apply_checkpointing
from autofit.ds.emit import bare_engine_config, write_json_atomic
from autofit.machine.lifetime import die_with_parent, parent_from_env
from autofit.probe.launch import free_port, rank_env
from autofit.probe.rank.memory import settled_rss_bytes
from autofit.probe.rank.worker import import_workload
from autofit.trace.cache import read_entry, software_versions, sources_digest, write_entry
from autofit.trace.tensors import cast_batch, to_dtype

#: forward and backward passes measured: the first touches the kernels, the second their caches' reuse
FOOTPRINT_STEPS = 2
#: seconds one measurement may take (imports ~5, the passes of a model that fits a CPU a few more)
FOOTPRINT_TIMEOUT_S = 300.0


#: what this process measured, by (entry, precision, attention): a model planned again here is not measured again
_MEASURED: dict[tuple[str, str, str], dict[str, int] | None] = {}


def measured_footprints(entry: str, precision: str, attention: str) -> dict[str, int] | None:
    """``{key: bytes}`` a fresh process holds after ``entry``'s model ran in ``precision`` (``fp32``, ``bf16``),
    beyond its imports and with the model freed: plainly, and then (where the workload has repeated layers)
    checkpointed too, keyed by :func:`autofit.cost_model.facts.footprint_key`; None when the measurement fails
    (the caller keeps its default). Once a process (:func:`forget_measured`)."""
    key = (entry, precision, attention)
    if key not in _MEASURED:
        with tempfile.TemporaryDirectory(prefix="autofit-footprint-") as workdir:
            out = Path(workdir) / "footprint.json"
            _MEASURED[key] = _finished(_start(entry, precision, attention, out), out, precision)
    return _MEASURED[key]


def forget_measured() -> None:
    """Forget what this process measured: the next ask measures again."""
    _MEASURED.clear()


def _start(entry: str, precision: str, attention: str, out: Path, most_params: int | None = None) -> subprocess.Popen:
    """The measuring process (``python -m autofit.probe.footprint``), writing to ``out``; with ``most_params`` it
    measures nothing of a model of more parameters than that (counted on the meta device first)."""
    env = rank_env(dict(os.environ), 0, 1, free_port(), "cpu")
    limit = [] if most_params is None else ["--most-params", str(most_params)]
    return subprocess.Popen([sys.executable, "-m", "autofit.probe.footprint", entry, precision, attention, str(out),
                             *limit], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _finished(process: subprocess.Popen, out: Path, precision: str, timeout_s: float = FOOTPRINT_TIMEOUT_S
              ) -> dict[str, int] | None:
    """What ``process`` measured into ``out`` (:func:`measured_footprints`), once it ends; None where it wrote
    nothing or ran past ``timeout_s`` (then it is killed)."""
    try:
        process.wait(timeout=max(0.0, timeout_s))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None
    if not out.exists():
        return None
    data = json.loads(out.read_text())
    found = {footprint_key(precision, False): int(data["bytes"])}
    if data.get("checkpointed_bytes") is not None:
        found[footprint_key(precision, True)] = int(data["checkpointed_bytes"])
    return found


class PendingFootprints:
    """A plan's kernel-footprint measurements started while its trace runs, one process a precision
    (:meth:`start`, the trace's ``before_tracing``; the trace runs on fake tensors and the measurement reads resident
    pages, so neither times anything the other slows), taken by :func:`footprints_for` where no cached one is read,
    and every one still running killed by :meth:`close` (a plan that ends another way, or reads them from the cache,
    leaves none behind). A model past ``most_params`` is not measured (the plan's own rule:
    :func:`autofit.planning.plan.with_kernel_footprints`), and the process checks it too before it builds the model
    for real."""

    def __init__(self, entry: str, precisions: tuple[str, ...], attention: str, most_params: int) -> None:
        self.entry, self.precisions, self.attention, self.most_params = entry, precisions, attention, most_params
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._running: dict[str, tuple[subprocess.Popen, Path, float]] = {}
        self._started = False

    def start(self, n_params: int) -> None:
        """Start each precision's measurement (once), where the model (``n_params``) is within
        :attr:`most_params`; one that cannot start is measured later, as without this."""
        if self._started or n_params > self.most_params:
            return
        self._started = True
        self._workdir = tempfile.TemporaryDirectory(prefix="autofit-footprints-")
        for precision in self.precisions:
            if (self.entry, precision, self.attention) in _MEASURED:  # measured here before: nothing to start
                continue
            out = Path(self._workdir.name) / f"{precision}.json"
            with contextlib.suppress(OSError):
                process = _start(self.entry, precision, self.attention, out, self.most_params)
                self._running[precision] = (process, out, time.monotonic())

    def has(self, precision: str, attention: str) -> bool:
        """Whether a measurement of ``precision`` with ``attention`` was started and not yet taken."""
        return attention == self.attention and precision in self._running

    def take(self, precision: str, attention: str) -> dict[str, int] | None:
        """What the measurement of ``precision`` with ``attention`` (:meth:`has`) found, waited for; None where it
        failed (the cost model's default stands, as for a failure of :func:`measured_footprints`)."""
        process, out, started = self._running.pop(precision)
        found = _finished(process, out, precision, FOOTPRINT_TIMEOUT_S - (time.monotonic() - started))
        if found is not None:  # a failure, or a model past the limit, is not remembered
            _MEASURED[(self.entry, precision, attention)] = found
        return found

    def close(self) -> None:
        for process, _, _ in self._running.values():
            process.kill()
            process.wait()
        self._running.clear()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> PendingFootprints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measured_footprint_bytes(entry: str, precision: str, attention: str, checkpointed: bool = False) -> int | None:
    """One of :func:`measured_footprints`: the plain run's, or the checkpointed one's (None where not measured)."""
    found = measured_footprints(entry, precision, attention)
    return None if found is None else found.get(footprint_key(precision, checkpointed))


def _passes(workload: Any, model: Any, dtype: Any) -> None:
    """:data:`FOOTPRINT_STEPS` forward and backward passes of one sample, gradients dropped after each."""
    model.train()
    for _ in range(FOOTPRINT_STEPS):
        loss = workload.compute_loss(model, cast_batch(workload.batch(1), dtype))
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)


def measure(entry: str, precision: str, attention: str) -> dict[str, int | None]:
    """In this (fresh) process, under the rank's environment the parent set: the model built in ``precision`` and
    handed to ``deepspeed.initialize`` (ZeRO-0, no optimizer), then the RSS :data:`FOOTPRINT_STEPS` passes of one
    sample add beyond that (``bytes``); then, where the workload has repeated layers, what as many passes with each of
    them checkpointed have added in all (``checkpointed_bytes``; None where it has none). The model's parameters are
    held at every reading.

    Measured beyond ``initialize``, not beyond the imports: what the build and ``initialize`` make resident (the
    weight initialisers' code, gloo's and the shared-memory communicator's buffers, the copies' code the passes call
    again) is in every probe whatever the model, and priced there (:attr:`Coefficients.runtime_overhead_bytes`,
    ``runtime_at_init_bytes``); a footprint from a bare process counted the part the passes touch again a second
    time (measured beyond the imports and beyond ``initialize``: 15.9 and 13.8 MiB on a two-layer StarCoder2, 17.9
    and 15.8 on examples/hf_configs/llama_gqa, 20.0 and 19.0 on examples/gpt.py: by how much depends on the model).

    Each reading is settled (:func:`~autofit.probe.rank.memory.settled_rss_bytes`: glibc's free heap pages handed
    back first): the blocks the passes freed below the probe's mmap threshold are holes the next step's small
    objects fill, not something the kernels keep, and how many there are depends on the batch (one sample here, a
    micro-batch in the probe): a two-layer Mamba's reference scan leaves 25 MiB of them at one sample, and counted,
    its probes at two samples came 9-10 % over, left out within 2.1 % (docs/results/families.md); a StarCoder2 copy
    leaves 0.06 MiB."""
    import deepspeed
    import torch

    workload = import_workload(entry, attention, torch)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = to_dtype(workload.build_model(attention=attention), dtype)
    deepspeed.initialize(model=model, config=bare_engine_config(precision))
    gc.collect()
    initialized = settled_rss_bytes()
    _passes(workload, model, dtype)
    gc.collect()
    plain = max(0, settled_rss_bytes() - initialized)
    try:
        apply_checkpointing(model, workload.repeated_layers(model), 1.0)
    except Exception:  # no repeated layers to wrap: no checkpointed config runs on this model
        return {"bytes": plain, "checkpointed_bytes": None}
    _passes(workload, model, dtype)
    gc.collect()
    return {"bytes": plain, "checkpointed_bytes": max(plain, settled_rss_bytes() - initialized)}


def parameter_count(entry: str, attention: str) -> int:
    """Parameters of ``entry``'s model, each shared tensor once, built on the meta device (no memory)."""
    import torch

    workload = import_workload(entry, attention, torch)
    with torch.device("meta"):
        model = workload.build_model(attention=attention)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str]) -> int:
    if len(argv) not in (5, 7) or (len(argv) == 7 and argv[5] != "--most-params"):
        print("usage: python -m autofit.probe.footprint ENTRY PRECISION ATTENTION OUT [--most-params N]",
              file=sys.stderr)
        return 2
    entry, precision, attention, out = argv[1:5]
    die_with_parent(parent_from_env(os.getppid()))  # the user's model runs here: not on, past a SIGKILLed autofit
    if len(argv) == 7 and parameter_count(entry, attention) > int(argv[6]):
        return 3  # too large to build here: nothing measured
    write_json_atomic(Path(out), measure(entry, precision, attention))
    return 0


def footprints_for(entry: str, precisions: tuple[str, ...], attention: str, model_digest: str | None = None,
                   pending: PendingFootprints | None = None) -> dict[str, int]:
    """``{key: bytes}`` (:func:`autofit.cost_model.facts.footprint_key`) for the precisions measured, plain and
    checkpointed; those that failed are left out. With ``model_digest`` (what the model traced to), each precision's
    measurement is kept in the trace cache (:func:`footprint_cache_name`) and read back instead of measured again;
    ``pending``: measurements already started (:class:`PendingFootprints`), taken before any is started here."""
    found: dict[str, int] = {}
    for precision in precisions:
        name = footprint_cache_name(entry, precision, attention, model_digest) if model_digest else None
        cached = read_entry(name) if name else None
        kept = cached.get("footprints") if cached else None
        if isinstance(kept, dict) and all(isinstance(v, int) for v in kept.values()):
            found |= {str(k): int(v) for k, v in kept.items()}
            continue
        measured = pending.take(precision, attention) if pending is not None and pending.has(precision, attention) \
            else measured_footprints(entry, precision, attention)
        if measured and name:
            write_entry(name, {"footprints": measured})
        found |= measured or {}
    return found


def footprint_cache_name(entry: str, precision: str, attention: str, model_digest: str) -> str:
    """The trace cache's name for one footprint measurement: a digest of what it depends on: the model (as traced:
    ``model_digest``), the entry, the precision and kernel, the software (:func:`autofit.trace.cache.software_versions`
    and this module's source) and the machine it ran on (its CPU's model and its C library: the kernels' code and
    oneDNN's JIT differ by both)."""
    document = {"model": model_digest, "entry": entry, "precision": precision, "attention": attention,
                "software": software_versions(), "measured_by": sources_digest(("probe/footprint.py",)),
                "machine": machine_fingerprint()}
    return "footprint-" + hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:40]


@functools.cache
def machine_fingerprint() -> dict[str, str]:
    """What sets a footprint on this machine beside the software: the CPU's architecture, model and flags, and the C
    library."""
    cpu = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "flags") and key.strip() not in cpu:
                cpu[key.strip()] = value.strip()
    return {"machine": platform.machine(), **cpu, "libc": " ".join(platform.libc_ver())}


if __name__ == "__main__":
    sys.exit(main(sys.argv))
