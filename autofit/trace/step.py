"""One traced step: a fresh model and batch under fake (or real) tensors, its forward, loss and backward with the
live bytes counted as they are allocated and freed (:class:`LiveBytes`), its FLOPs and per-segment peaks
(:func:`trace_step`). :mod:`autofit.trace.tracer` runs it at each micro-batch, precision, kernel and layout."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from autofit.core.errors import AutofitError, is_control, user_code_error
from autofit.core.units import seconds_from_env
from autofit.cost_model.facts import PeakPoint
from autofit.ds.apply import apply_checkpointing
from autofit.trace.attention import SDPA_FLASH, flash_alike_calls, flash_attn_installed, flash_trace_plan, kernel_context
from autofit.trace.layers import SegmentMarks
from autofit.trace.masks import causal_mask_as_eager
from autofit.trace.scaling import part_peaks
from autofit.trace.sdpa import sdpa_as_dispatched
from autofit.trace.structure import fp8_linear_flops
from autofit.trace.tensors import (
    InlineFlops,
    batch_tensors,
    cast_batch,
    first_line,
    flop_counter,
    kernel_workspace_bytes,
    makes_tensors,
    to_dtype,
)
from autofit.trace.traffic import Traffic, storage_key
from autofit.workload.types import Workload

#: environment variable: the most seconds one trace step may run (a positive number; unset or empty:
#: :data:`TRACE_STEP_S`). A step past it ends the trace with :class:`TraceTooSlow`
TRACE_STEP_ENV = "AUTOFIT_TRACE_STEP_S"
#: the default limit of one trace step: a 70B model's cut steps take seconds; a state-space model's reference
#: scan (transformers' ``MambaMixer.slow_forward``, a Python loop over the sequence in every layer) takes minutes
TRACE_STEP_S = 180.0


#: seconds of tracing after which each step says on stderr what it traces (a fast trace says nothing)
PROGRESS_AFTER_S = 10.0
#: when the current trace began and when it last said so (:func:`trace_started`, :func:`say_progress`)
_PROGRESS = {"started": 0.0, "said": 0.0}


def trace_started() -> None:
    """A trace begins: the clock of :func:`say_progress`."""
    _PROGRESS["started"] = _PROGRESS["said"] = time.perf_counter()


def say_progress(name: str | None, what: str) -> None:
    """One line on stderr, at most every :data:`PROGRESS_AFTER_S`, once the trace has run that long."""
    now = time.perf_counter()
    if _PROGRESS["started"] and now - _PROGRESS["said"] >= PROGRESS_AFTER_S:
        _PROGRESS["said"] = now
        print(f"autofit: tracing {name or 'the model'}: {now - _PROGRESS['started']:.0f} s so far, now {what} "
              f"(each step at most {trace_step_limit_s():g} s, {TRACE_STEP_ENV})", file=sys.stderr, flush=True)


class NeedsRealTensors(Exception):
    """The model does something fake tensors cannot (a data-dependent shape, a stricter meta kernel)."""


class BuildFailed(AutofitError):
    """The model could not be built for the trace: the same error would recur at any depth, so nothing is retried."""


class NoKernelRuns(AutofitError):
    """None of the attention kernels asked for builds and runs the model (:func:`autofit.trace.tracer.runnable_kernels`)."""


class TraceTooSlow(AutofitError):
    """A trace step ran past :func:`trace_step_limit_s`."""


def trace_step_limit_s() -> float:
    """:data:`TRACE_STEP_ENV` in seconds, else :data:`TRACE_STEP_S` (:func:`autofit.core.units.seconds_from_env`)."""
    return seconds_from_env(TRACE_STEP_ENV, TRACE_STEP_S)


@contextlib.contextmanager
def fake_mode(mode: str) -> Iterator[Any]:
    if mode == "real":
        yield None
        return

    from torch._subclasses.fake_tensor import FakeTensorMode

    # a kernel that fails on fake tensors is retried on real ones; torch's own log of it is noise here
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            yield fake
    finally:
        log.setLevel(level)


@dataclass
class LiveBytes:
    """Running count of the bytes held by storages created since tracking began."""

    live: int = 0
    grads: int = 0
    deadline: float = float("inf")
    """``time.perf_counter()`` past which the step is too slow (:class:`TraceTooSlow`)."""
    name: str | None = None
    """The traced model's name, for :class:`TraceTooSlow`."""
    peak_with_grads: int = 0
    peak_without_grads: int = 0
    tracked: set[int] = field(default_factory=set)
    traffic: Traffic = field(default_factory=Traffic)
    """Bytes the step's non-matmul kernels move, eager and fused (:mod:`autofit.trace.traffic`)."""
    marks: SegmentMarks | None = None
    """Where the step is (cut traces only): peaks are kept per segment too."""
    segment_peaks: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    def add(self, key: int, n_bytes: int) -> None:
        self.live += n_bytes
        self.note()

    def remove(self, key: int, n_bytes: int) -> None:
        self.tracked.discard(key)
        self.traffic.forget(key)
        self.live -= n_bytes

    def note(self, workspace: int = 0) -> None:
        """A moment of the step: the live bytes, plus ``workspace`` the running kernel holds beside them."""
        live = self.live + workspace
        self.peak_with_grads = max(self.peak_with_grads, live)
        self.peak_without_grads = max(self.peak_without_grads, live - self.grads)
        if self.marks is not None:
            key = self.marks.segment()
            with_grads, without_grads = self.segment_peaks.get(key, (0, 0))
            self.segment_peaks[key] = (max(with_grads, live), max(without_grads, live - self.grads))


def make_tracker(counter: LiveBytes, flops: InlineFlops | None = None) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveMemoryMode(TorchDispatchMode):
        """Counts every storage an op creates until that storage is freed, and the FLOPs of each op (``flops``, where
        given)."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if time.perf_counter() > counter.deadline and makes_tensors(func):
                raise TraceTooSlow(f"a trace step of {counter.name} ran past {trace_step_limit_s():g} s "
                                   f"({TRACE_STEP_ENV}): the model runs a slow loop on these tensors "
                                   "(a state-space model's reference scan, without mamba-ssm and causal-conv1d); "
                                   f"trace a shorter --seq-len, install its fused kernels, or raise {TRACE_STEP_ENV}")
            out = flops.run(func, args, kwargs or {}) if flops is not None else func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._track(tensor)
            counter.note(kernel_workspace_bytes(func, args, out))
            counter.traffic.record(func, args, kwargs, out)
            return out

        def _track(self, tensor: Any) -> None:
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in counter.tracked:
                return
            n_bytes = storage.nbytes()
            counter.tracked.add(key)
            counter.add(key, n_bytes)
            weakref.finalize(storage, counter.remove, key, n_bytes)

    return LiveMemoryMode()


def trace_step(workload: Workload, n: int, dtype_name: str, attention: str, ckpt: tuple[float, str], mode: str,
               segments: dict[tuple[str, int], tuple[int, int]] | None = None, sdpa_dispatch: str = "cpu") -> PeakPoint:
    """Forward + backward of one micro-batch of ``n`` samples; live bytes exclude parameters.
    ``ckpt``: ``(checkpoint ratio, granularity)``, applied as :func:`autofit.ds.apply.apply_checkpointing` does;
    ``segments``: filled with the peaks of each segment of the step (:class:`SegmentMarks`); ``sdpa_dispatch``: the
    target's SDPA dispatch (:func:`autofit.trace.sdpa.sdpa_as_dispatched`)."""
    import torch

    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    limit_s = trace_step_limit_s()
    say_progress(workload.name, f"{dtype_name} {attention} micro-batch {n}" + (" checkpointed" if ckpt[0] else ""))
    try:
        with fake_mode(mode):
            model = to_dtype(built(workload, attention), dtype)
            model.train()
            layers = workload.repeated_layers(model)
            if ckpt[0]:
                apply_checkpointing(model, layers, ckpt[0], ckpt[1], workload.attention_of)
            batch = cast_batch(workload.batch(n), dtype)
            # layer marks wherever there are layers: the head's and the layers' peaks are per segment, and the marks
            # collect a checkpointed recompute's reference cycles as each layer ends (autofit/trace/layers.py)
            counter: LiveBytes = LiveBytes(deadline=time.perf_counter() + limit_s, name=workload.name)
            counter.marks = SegmentMarks(layers, lambda: counter.note()) if layers else None
            ignore_existing(counter, [*model.parameters(), *model.buffers(), *batch_tensors(batch)])
            params = [p for p in model.parameters() if p.requires_grad]
            hooks = [p.register_post_accumulate_grad_hook(grad_hook(counter)) for p in params]
            flops = flop_counter()
            marking = counter.marks.tracking() if counter.marks else contextlib.nullcontext()
            with flops, make_tracker(counter, flops), marking, sdpa_as_dispatched(sdpa_dispatch), \
                    causal_mask_as_eager(batch):
                loss = workload.compute_loss(model, batch)
                activation_bytes_at_loss = counter.live
                if counter.marks:
                    counter.marks.start_backward()
                counter.traffic.start_backward()
                loss.backward()
            for hook in hooks:
                hook.remove()
            fp8_flops = fp8_linear_flops(model, flops.get_flop_counts())
            del loss, model, batch, params
            if segments is not None:
                segments.update(counter.segment_peaks)
            parts = part_peaks(counter.segment_peaks, len(layers))
    except AutofitError:  # the build, or a step too slow: the same at any depth and on real tensors
        raise
    except BaseException as exc:
        if is_control(exc):
            raise
        raise _step_failure(exc, f"tracing {workload.name} ({dtype_name}, {attention})", mode) from exc
    return PeakPoint(
        micro_batch_size=n,
        peak_with_grads_bytes=counter.peak_with_grads,
        peak_without_grads_bytes=counter.peak_without_grads,
        activation_bytes=activation_bytes_at_loss,
        grad_bytes=counter.grads,
        flops=int(flops.get_total_flops()),
        fp8_flops=fp8_flops,
        **counter.traffic.totals(),
        **parts,
    )


def built(workload: Workload, attention: str) -> Any:
    """The workload's model built with ``attention``; a failure is :class:`BuildFailed`, one line, but for one that
    fake tensors cause (a data-dependent value read while building, as a ViT's position ids): that build is retried on
    real tensors (:class:`NeedsRealTensors`)."""
    try:
        return workload.build_model(attention=attention)
    except AutofitError:
        raise
    except Exception as exc:
        if _of_fake_tensors(exc):
            raise NeedsRealTensors(f"{type(exc).__name__}: {first_line(exc)}") from exc
        raise BuildFailed(f"building {workload.name} with attention={attention} failed: {type(exc).__name__}: "
                          f"{first_line(exc)}") from exc


def sdpa_labels(workload: Workload) -> set[str]:
    """How SDPA runs this model's calls where no fused kernel takes them (:data:`autofit.trace.sdpa.MATH_BROADCAST`):
    one forward of one sample on fake tensors, without gradients; nothing where it cannot run there."""
    import torch

    seen: set[str] = set()
    with contextlib.suppress(Exception), fake_mode("fake"), torch.no_grad(), sdpa_as_dispatched("cuda", seen):
        model = to_dtype(workload.build_model(attention="sdpa"), torch.bfloat16)
        workload.compute_loss(model, cast_batch(workload.batch(1), torch.bfloat16))
    return seen


def flash_traces_as_sdpa(workload: Workload, dtype_name: str, dispatch: str = "cpu") -> bool:
    """Whether tracing ``flash`` would run the very steps tracing ``sdpa`` runs, so that its profiles are ``sdpa``'s:
    SDPA's flash backend stands in for flash-attn on the model built for ``sdpa``
    (:func:`autofit.trace.attention.flash_trace_plan`), and in one forward of one sample on fake tensors in
    ``dtype_name`` every SDPA call is one the stand-in runs as SDPA's own choice does
    (:func:`autofit.trace.attention.flash_alike_calls`). False where any call is not, where none is seen, or where the
    forward fails: then ``flash`` is traced itself."""
    import torch

    if flash_trace_plan(flash_attn_installed(), workload.flash_stand_in) != [("sdpa", SDPA_FLASH)]:
        return False
    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    alike: list[bool] = []
    try:
        with fake_mode("fake"), torch.no_grad(), flash_alike_calls(alike), sdpa_as_dispatched(dispatch):
            model = to_dtype(workload.build_model(attention="sdpa"), dtype)
            model.train()
            workload.compute_loss(model, cast_batch(workload.batch(1), dtype))
    except Exception:
        return False
    return bool(alike) and all(alike)


def kernel_failure(workload: Workload, kernel: str, dispatch: str = "cpu") -> str | None:
    """Why the model cannot be built or run with attention ``kernel`` as the trace runs it (one forward of one sample
    on fake tensors, in bf16, without gradients; ``flash`` by any way of its trace plan,
    :func:`autofit.trace.attention.flash_trace_plan`), in one line; None where it runs, or where what failed is
    the fake tensors' own (the trace then runs it on real ones)."""
    import torch

    plan = flash_trace_plan(flash_attn_installed(), workload.flash_stand_in) if kernel == "flash" else [(kernel, "")]
    why = None
    for built_as, label in plan:
        try:
            with fake_mode("fake"), torch.no_grad(), kernel_context(label), sdpa_as_dispatched(dispatch):
                model = to_dtype(workload.build_model(attention=built_as), torch.bfloat16)
                workload.compute_loss(model, cast_batch(workload.batch(1), torch.bfloat16))
            return None
        except Exception as exc:
            if _of_fake_tensors(exc):
                return None
            why = why or f"{type(exc).__name__}: {first_line(exc)}"
    return why


def ignore_existing(counter: LiveBytes, tensors: list[Any]) -> None:
    """Storages that exist before the step (parameters, buffers, the batch) and their views are not counted."""
    for tensor in tensors:
        counter.tracked.add(tensor.untyped_storage()._cdata)


def grad_hook(counter: LiveBytes) -> Any:
    def hook(param: Any) -> None:
        grad = param.grad
        if grad is not None:
            counter.grads += grad.untyped_storage().nbytes()
            counter.traffic.keep(storage_key(grad))  # the optimizer reads it
            counter.note()

    return hook


def _step_failure(exc: BaseException, what: str, mode: str) -> Exception:
    """What a failed step raises: the workload's own exit or BaseException as one error line, never retried; on fake
    tensors a retry on real ones (data-dependent shapes, or kernels whose fake versions are stricter); else one line."""
    if not isinstance(exc, Exception):  # sys.exit, a BaseException subclass
        return user_code_error(what, exc)
    if mode == "fake":
        return NeedsRealTensors(f"{type(exc).__name__}: {first_line(exc)}")
    return AutofitError(f"{what} failed: {type(exc).__name__}: {exc}")


def _of_fake_tensors(exc: BaseException) -> bool:
    """Whether ``exc`` is fake tensors' own (torch/_subclasses/fake_tensor.py, torch/fx/experimental/symbolic_shapes.py:
    a data-dependent output or shape), not the model's."""
    return type(exc).__module__.startswith(("torch._subclasses", "torch.fx.experimental"))
