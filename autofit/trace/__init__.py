"""Measure the model itself: one training step's forward and backward, run on fake tensors.

What the cost model needs and cannot guess for an architecture it has never seen comes from here
(:class:`autofit.cost_model.facts.ModelFacts`): parameter counts and shapes, the peak of live activation
bytes during forward+backward (with and without the gradients held), the FLOPs of forward+backward
(recompute included), per-layer activation bytes and the largest layer.

How, module by module:

- :mod:`autofit.trace.structure` builds the model on the meta device: parameter counts, shapes and what
  each optimizer keeps per tensor. Nothing runs, nothing costs memory.
- :mod:`autofit.trace.tracer` runs the step under ``FakeTensorMode`` (shapes and dtypes only, so a 7 B
  model traces on a laptop). A ``TorchDispatchMode`` adds each new storage's bytes when an op creates it
  and subtracts them when the storage dies (a weak reference on the untyped storage, which PyTorch keeps
  alive exactly as long as the storage): the method of ``torch.distributed._tools.mem_tracker``.
  ``torch.utils.flop_counter`` counts FLOPs (:mod:`autofit.trace.tensors` adds the CPU SDPA kernels' formulas
  it lacks and the convolution reorder copies). Models whose shapes depend on data (mixture-of-experts
  routing) cannot run on fake tensors; they are traced on real CPU tensors instead when small enough.
  Each (precision, attention, checkpointing) is traced at micro-batches 1 and 4 (and the space's largest);
  the cost model interpolates linearly in the micro-batch. The peak is convex in the micro-batch (it moves
  from the gradient-heavy end of backward to the activation-heavy start as the batch grows), so
  interpolating errs on the high side and beyond the last point follows the activation slope.
- :mod:`autofit.trace.layers` cuts a many-layer model to its first few repeated layers, when they are
  alike, and marks where each layer's forward and backward begin and end (PyTorch's ``ModTracker``);
  :mod:`autofit.trace.scaling` (pure, no torch) extrapolates the cut traces to the whole depth, so a
  70 B model costs the trace of 2-5 of its layers.
- :mod:`autofit.trace.hooks`: torch's module trackers learn that a module's backward ended from
  ``register_multi_grad_hook(..., mode="all")``, which keeps every input gradient until the last one
  arrives; where an input is shared by every layer (a T5 decoder's encoder output, its position bias) that
  is the end of the whole backward, a cost no real run pays (T5 mb16 fp32, every block checkpointed:
  122.7 MiB traced, 102.6 measured). The trace's trackers run with hooks that count instead of holding.
- :mod:`autofit.trace.cache` keeps each trace on disk (``$AUTOFIT_CACHE_DIR``, default ``~/.cache/autofit``),
  keyed by the model's structure and code, the batch's shapes, what was asked and the software's versions: a
  model traced before answers from there (``--no-cache`` or ``AUTOFIT_NO_CACHE=1`` to trace again). With
  the cut traces of a many-layer model run in forked processes, one per usable core (up to 8) where the process
  runs one Python thread (each step is independent; each result is what the step gives in one process);
  ``AUTOFIT_TRACE_WORKERS=N`` sets how many (1 on a loaded machine: each worker pays its own caches; a value
  that is not a positive integer is an error); a worker that cannot fork or dies leaves the traces to this
  process, with one line on stderr.
- :mod:`autofit.trace.attention` runs each attention kernel (``flash`` through flash-attn's own functions
  where installed, else SDPA forced to its flash backend) and labels which one a prediction rests on.

The public face is below; the modules' private helpers are for the tests.
"""

from __future__ import annotations

from autofit.trace.tensors import sdpa_flop_formulas
from autofit.trace.tracer import (
    REAL_TRACE_LIMIT_BYTES,
    SCALE_MIN_LAYERS,
    TRACE_MICRO_BATCHES,
    middle_checkpointed_layers,
    parameter_facts,
    trace_config,
    trace_micro_batches,
    trace_workload,
)

__all__ = [
    "REAL_TRACE_LIMIT_BYTES",
    "SCALE_MIN_LAYERS",
    "TRACE_MICRO_BATCHES",
    "sdpa_flop_formulas",
    "middle_checkpointed_layers",
    "parameter_facts",
    "trace_config",
    "trace_micro_batches",
    "trace_workload",
]
