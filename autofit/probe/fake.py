"""Fake-mode probe: the real model code at full size under ``FakeTensorMode``, memory only.

No weight, activation or state is allocated: every tensor is a fake tensor that
knows its shape, dtype and storage. A :class:`LiveBytes` dispatch mode adds the
size of each new storage when an op creates it and subtracts it when Python
frees it (``weakref.finalize`` on the untyped storage), so the peak over time is
what a device would hold. DeepSpeed cannot run on fake tensors, so what it would
allocate is allocated here by :func:`run_fake` with the sizes DeepSpeed uses:

==========================  ===============================================================
working weights             P x w (w = 4 fp32, 2 bf16/fp16); ZeRO-3: P x w / N plus the
                            largest layer gathered in full
fp32 master (16-bit, or     P x 4 / N (ZeRO >= 1: one flat partition, DeepSpeed clones it
ZeRO 1/2 in fp32)           even in fp32 -- stage_1_and_2.py ``single_partition_of_fp32_groups``);
                            ZeRO-0 16-bit: P x 4 (``BF16_Optimizer``/``FP16_Optimizer``)
gradients                   ZeRO-0: autograd's P x w held until the step, and flattened into
                            one all-reduce bucket (<= 5e8 elements) after backward; 16-bit
                            ZeRO-0: plus an fp32 accumulation buffer P x 4. ZeRO >= 1: each
                            gradient copied out of autograd into the rank's P x w / N
                            partition (through a reduce bucket of min(P, 5e7) x w on N > 1
                            ranks); ZeRO 1/2: plus an fp32 flat copy P x 4 / N at the step
optimizer states (on the    adamw 8 B/elem; adamw8bit 2 B/elem + fp32 absmax per 256-block
elements it updates: P, or  per state (bitsandbytes blockwise); lion 4 B; sgd 4 B (momentum);
P / N under ZeRO >= 1)      adafactor factored rows + cols x 4 B for >= 2-D tensors (ZeRO's
                            flat 1-D partitions are not factored: 4 B/elem)
runtime ("other")           CPU: measured -- RSS that ``deepspeed.initialize`` and two steps of
                            a 64x64 layer add (gloo, DeepSpeed's shm op, thread pools), ~25 MiB;
                            CUDA: the hardware's ``context_bytes``
==========================  ===============================================================

Offloaded parts (``offload_optimizer`` / ``offload_params`` on a CUDA device) are
not on the device and are not counted; on the CPU the host is the device and
they are.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from autofit.emit import REDUCE_BUCKET_ELEMENTS

CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
#: DeepSpeed's ZeRO-0 gradient all-reduce bucket, elements (engine.py MEMORY_OPT_ALLREDUCE_SIZE)
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
#: bitsandbytes' blockwise 8-bit optimizers keep one fp32 absmax per block of this many elements
BNB_BLOCK = 256


def optimizer_state_bytes(optimizer: str, shape: tuple[int, ...]) -> int:
    """Bytes of optimizer state for one fp32 tensor of ``shape`` (sizes from each optimizer's ``step``).

    adamw: exp_avg + exp_avg_sq fp32 (torch.optim.AdamW, DeepSpeed FusedAdam) = 8 B/elem;
    adamw8bit: two uint8 states + one fp32 absmax per 256 elements each (bitsandbytes
    ``Optimizer2State``, blockwise); lion: exp_avg = 4 B; sgd: momentum_buffer = 4 B;
    adafactor: for >= 2-D, a row vector (shape[:-1]) and a column vector (shape[:-2] + shape[-1:])
    of fp32 (torch.optim.Adafactor), else a full fp32 second moment.
    """
    n = math.prod(shape)
    if optimizer == "adamw":
        return 8 * n
    if optimizer == "adamw8bit":
        return 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)
    if optimizer in ("lion", "sgd"):
        return 4 * n
    if optimizer == "adafactor":
        if len(shape) >= 2:
            return 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])
        return 4 * n
    raise ValueError(f"unknown optimizer {optimizer!r}")


class LiveBytes:
    """Live storage bytes by category over time; a ``TorchDispatchMode`` feeds it.

    A storage is counted once (views share it) at ``scale`` x its size: ZeRO-3
    weights are counted at 1/N because each rank keeps one partition.
    """

    def __init__(self) -> None:
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes = 0
        self.peak_breakdown = dict(self.live)
        self._seen: dict[int, tuple[str, int]] = {}
        self.events = 0

    def total(self) -> int:
        return sum(self.live.values())

    def observe(self, tensor: Any) -> None:
        """Count ``tensor``'s storage as an activation if it is new (an op's output; views are not new)."""
        storage = tensor.untyped_storage()
        if id(storage) not in self._seen:
            self._count(storage, "activations", 1.0)

    def add(self, tensor: Any, category: str, scale: float = 1.0) -> None:
        """Count ``tensor``'s storage under ``category`` at ``scale`` x its size, moving it if already counted."""
        storage = tensor.untyped_storage()
        old = self._seen.get(id(storage))
        if old is not None:
            self.live[old[0]] -= old[1]
            self._seen.pop(id(storage))
        self._count(storage, category, scale, finalize=old is None)
        if old is not None and self.total() >= self.peak_bytes:
            self.peak_breakdown = dict(self.live)  # the peak's bytes just changed category

    def _count(self, storage: Any, category: str, scale: float, finalize: bool = True) -> None:
        key = id(storage)
        n_bytes = int(storage.nbytes() * scale)
        if finalize:
            weakref.finalize(storage, self._free, key)
        self._seen[key] = (category, n_bytes)
        self.live[category] += n_bytes
        self._note_peak()

    def add_bytes(self, n_bytes: int, category: str) -> None:
        """A lasting allocation known only by size (buffers DeepSpeed would hold)."""
        self.live[category] += int(n_bytes)
        self._note_peak()

    def reset_peak(self) -> None:
        """Forget the peak so far (what was live stays counted)."""
        self.peak_bytes = self.total()
        self.peak_breakdown = dict(self.live)

    def _free(self, key: int) -> None:
        category, n_bytes = self._seen.pop(key)
        self.live[category] -= n_bytes

    def _note_peak(self) -> None:
        self.events += 1
        total = self.total()
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_breakdown = dict(self.live)


def _dispatch_mode(tracker: LiveBytes) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _Track(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for item in tree_flatten(out)[0]:
                if isinstance(item, torch.Tensor):
                    tracker.observe(item)
            return out

    return _Track()


@contextmanager
def fake_device(tracker: LiveBytes) -> Iterator[Any]:
    """Fake tensors everywhere inside, every new storage counted by ``tracker``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode, _dispatch_mode(tracker):
        yield mode


def run_fake(spec: dict[str, Any], phases: dict[str, float]) -> dict[str, Any]:
    """Simulate one rank of ``spec``'s config on ``world_size`` ranks; returns the worker's result fields."""
    t0 = time.time()
    import torch

    from autofit.apply import apply_to_model
    from autofit.config import WORKING_BYTES, Config
    from autofit.workload import load_workload

    config = Config.from_dict(spec["config"])
    workload = load_workload(spec["entry"])
    phases["imports_s"] = time.time() - t0
    n_ranks = int(spec["world_size"])
    cuda = spec["kind"] == "cuda"
    zero = config.zero_stage
    w = WORKING_BYTES[config.precision]
    half = w == 2
    dtype = torch.bfloat16 if config.precision in ("bf16", "fp8") else torch.float16
    off_opt = cuda and config.offload_optimizer != "none"
    off_par = cuda and config.offload_params != "none" and zero == 3
    shard = n_ranks if zero >= 1 else 1

    t0 = time.time()
    runtime_bytes = spec.get("context_bytes", 0) if cuda else cpu_runtime_bytes(config)
    phases["runtime_s"] = time.time() - t0

    tracker = LiveBytes()
    tracker.add_bytes(runtime_bytes, "other")
    t0 = time.time()
    with fake_device(tracker):
        model = workload.build_model(attention=config.attention)
        layers = workload.repeated_layers(model)
        n_ckpt = apply_to_model(model, spec["deepspeed"], layers)
        params = [p for p in model.parameters() if p.requires_grad]
        n_params = sum(p.numel() for p in params)
        phases["model_build_s"] = time.time() - t0
        t0 = time.time()

        # deepspeed.initialize casts the module on the host, then moves it to the device
        if half:
            for p in model.parameters():
                p.data = p.data.to(dtype)
        if cuda:
            tracker.reset_peak()  # the fp32 model was built in host memory, not on the GPU
        # fp32 master weights, copied from the (cast) working weights
        if (half or zero in (1, 2)) and not off_opt:
            master = torch.empty(math.ceil(n_params / shard), dtype=torch.float32)
            tracker.add(master, "optimizer")
        weight_scale = (0.0 if off_par else 1.0 / n_ranks) if zero == 3 else 1.0
        for p in model.parameters():
            tracker.add(p, "params", weight_scale)
        if zero == 3 and not off_par:
            # one layer gathered in full at a time (DeepSpeed's fetch; prefetch ignored)
            largest = max((sum(q.numel() for q in layer.parameters()) for layer in layers), default=0)
            tracker.add_bytes(largest * w * (1 - 1 / n_ranks), "params")

        if not off_opt:
            if zero >= 1:
                state = optimizer_state_bytes(config.optimizer, (math.ceil(n_params / shard),))
            else:
                state = sum(optimizer_state_bytes(config.optimizer, tuple(p.shape)) for p in params)
            tracker.add_bytes(state, "optimizer")
            if half and zero == 0:
                tracker.add_bytes(4 * n_params, "grads")  # BF16_Optimizer's fp32 gradient accumulation
        if zero >= 1:
            # ZeRO 1/2 (stage_1_and_2.py) and 3 copy each gradient out of autograd as it is produced:
            # into the rank's partition and, on more than one rank, through a reduce bucket first
            tracker.add_bytes(math.ceil(n_params / n_ranks) * w, "grads")
            if n_ranks > 1:
                tracker.add_bytes(min(n_params, REDUCE_BUCKET_ELEMENTS) * w, "other")
            for p in params:
                p.register_post_accumulate_grad_hook(_drop_grad)
        else:
            for p in params:
                p.register_post_accumulate_grad_hook(lambda q: tracker.add(q.grad, "grads"))
        phases["initialize_s"] = time.time() - t0

        t0 = time.time()
        batch = _cast_batch(workload.batch(config.micro_batch_size), dtype if half else None)
        # two micro-batches show what accumulation adds (gradients held through the next forward)
        for _ in range(min(config.grad_accum_steps, 2)):
            loss = workload.compute_loss(model, batch)
            loss.backward()
            del loss
        if zero == 0:
            # DeepSpeed's data-parallel all-reduce flattens the gradients into buckets of up to
            # 5e8 elements, even on one rank (engine.py allreduce_bucket, MEMORY_OPT_ALLREDUCE_SIZE)
            bucket = torch.empty(min(n_params, ALLREDUCE_BUCKET_ELEMENTS), dtype=dtype if half else torch.float32)
            tracker.add(bucket, "other")
            del bucket
        if zero in (1, 2) and not off_opt:
            # at the step the partition is flattened into an fp32 gradient for the master update
            # (stage_1_and_2.py ``single_grad_partition``), a copy even in fp32
            flat = torch.empty(math.ceil(n_params / n_ranks), dtype=torch.float32)
            tracker.add(flat, "grads")
            del flat
        phases["steps_s"] = time.time() - t0
    peak = tracker.peak_bytes
    return {
        "status": "ok",
        "peak_bytes": peak,
        "per_rank_peak_bytes": [peak] * n_ranks,
        "breakdown": tracker.peak_breakdown,
        "n_params": n_params,
        "n_checkpointed": n_ckpt,
        "tokens_per_sample": workload.tokens_per_sample,
        "step_time_s": 0.0,
        "message": f"fake mode: memory only, simulated in {phases['steps_s'] + phases['initialize_s']:.1f} s",
    }


def cpu_runtime_bytes(config: Any) -> int:
    """RSS that DeepSpeed's runtime adds on the CPU whatever the model (gloo, its shm op, thread
    pools), measured: ``deepspeed.initialize`` and two steps of a 64x64 linear layer with the
    config's JSON, minus the RSS after imports. About 20-30 MiB."""
    import deepspeed
    import torch

    try:  # the real probe's baseline includes it
        import bitsandbytes  # noqa: F401
    except ImportError:
        pass
    from autofit.emit import deepspeed_config
    from autofit.probe import memory

    baseline = memory.rss_bytes()
    memory.reset_peak()
    model = torch.nn.Linear(64, 64)
    ds = deepspeed_config(config.with_(micro_batch_size=1, grad_accum_steps=1, precision="fp32", optimizer="adamw"))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    for _ in range(2):
        engine.backward(engine(torch.randn(1, 64)).sum())
        engine.step()
    used = memory.hwm_bytes() - baseline
    del engine, model
    return used


def _drop_grad(param: Any) -> None:
    """ZeRO 2/3: the gradient is reduced into the rank's partition and freed."""
    param.grad = None


def _cast_batch(batch: Any, dtype: Any | None) -> Any:
    from autofit.probe.worker import to_device

    return to_device(batch, "cpu", dtype)
