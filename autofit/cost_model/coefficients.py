"""The cost model's tunable constants: defaults per device kind, refined by probes.

A probe measures what an analytic model cannot know (how close a kernel gets to
the datasheet FLOP/s, what the runtime itself holds); :mod:`autofit.search`
fits these from probe results as the search goes, so later predictions improve.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS, Hardware

MIB = 2**20
#: the matmul ceiling of a CUDA device none is measured for: the lowest of the presets measured
#: (H100 SXM's, :data:`autofit.core.hardware.MAMF_SOURCE`)
UNMEASURED_MATMUL_CEILING = min(p.matmul_ceiling for p in PRESETS.values() if p.matmul_ceiling)
#: achieved / datasheet memory bandwidth of a streaming kernel on an NVIDIA GPU: ~90% is the most any kernel
#: reached in NVIDIA's measurements, a read kernel on an A100 80GB SXM 88% (1.80 of 2.04 TB/s, Nsight Compute
#: agreeing; https://forums.developer.nvidia.com/t/trouble-to-reach-peak-bandwidth-of-a100/339083)
ACHIEVED_BANDWIDTH = 0.9
#: the step efficiency of a CUDA device no published run anchors: the lowest of the presets anchored (H100's,
#: :data:`autofit.core.hardware.STEP_EFFICIENCY_SOURCE`)
UNANCHORED_STEP_EFFICIENCY = min(p.step_efficiency for p in PRESETS.values() if p.step_efficiency)


#: the most achieved / datasheet FLOP/s a fitted efficiency may reach. Above 1 the datasheet undersells the
#: device: a CPU's nominal FLOP/s (:func:`autofit.machine.device.detect_cpu`) counts AVX2 FMAs, 32 fp32 FLOP a cycle,
#: where AVX-512 does twice that and AVX-512-BF16 or AMX far more in bf16. Measured on an avx512_bf16
#: CPU (the Qwen2-shaped 57 M-parameter LM, eager attention; docs/results/search.md): fp32 at ~0.9 of nominal,
#: bf16 at ~2.3.
MAX_EFFICIENCY = 16.0


@dataclass(frozen=True)
class Coefficients:
    """Calibratable constants of the time and memory formulas."""

    compute_efficiency: dict[str, float] = field(default_factory=lambda: {"fp32": 0.5, "bf16": 0.5, "fp16": 0.5, "fp8": 0.5})
    """Achieved / peak FLOP/s for each compute dtype (MFU). A CPU without native bf16 shows a tiny value."""
    micro_batch_overhead_s: float = 0.0
    """Fixed seconds per micro-batch: kernel launches, Python, dispatch."""
    step_overhead_s: float = 0.0
    """Fixed seconds per optimizer step (DeepSpeed bookkeeping, clipping, scheduling)."""
    optimizer_bytes_per_s: float = 1e12
    """Speed of the optimizer update, in bytes of parameters + states + gradients touched per second."""
    memory_bound_bytes_per_s: float = 0.0
    """Achieved memory bandwidth of the step's kernels that do no matmul (elementwise ops, norms, softmax, casts):
    their traced bytes (:attr:`~autofit.cost_model.facts.PeakPoint.memory_bound_bytes`) over it are seconds
    beside the matmuls' (a roofline). 0: not priced apart, their time is folded into ``compute_efficiency``
    (the CPU, where a small model's activations stay in cache and DRAM bandwidth does not bound them)."""
    comm_efficiency: float = 0.7
    """Achieved / nominal interconnect bandwidth for collectives."""
    offload_efficiency: float = 0.7
    """Achieved / nominal PCIe or NVMe bandwidth for offload traffic."""
    overlap_efficiency: float = 1.0
    """How much of the compute that runs beside a collective hides it: exposed communication is
    ``comm - overlap_efficiency x overlapping compute`` where DeepSpeed overlaps (:mod:`autofit.cost_model.time`).
    1.0: a second stream hides as long a collective as the compute beside it; 0: nothing hides. Fitted from
    probes (:func:`autofit.cost_model.calibrate.fit_overlap`)."""
    collective_latency_s: float = 0.0
    """Fixed seconds of one collective call beyond its bytes (launch, the ring's start-up): what makes a small
    reduce bucket slow. An assumed prior, not measured here (see :meth:`for_hardware`)."""
    runtime_overhead_bytes: int = 0
    """Memory the training runtime holds beyond tensors and beyond the model's own kernels once training runs
    (DeepSpeed's engine and communicator, the optimizer's kernels, thread pools); the CUDA context is counted
    separately from the hardware preset."""
    kernel_footprint_bytes: int = 0
    """What the model's own kernels leave resident when the model's is not measured (CPU: code pages, oneDNN
    primitives; :mod:`autofit.probe.footprint` measures the model's own, which replaces this)."""
    runtime_16bit_extra_bytes: int = 0
    """What ``kernel_footprint_bytes`` gains when the model computes in 16 bits (bf16, fp16): on the CPU their
    matmuls run through oneDNN's JIT kernels instead of MKL's, with their own primitives and code pages."""
    checkpoint_footprint_bytes: int = 0
    """What checkpointing adds to ``kernel_footprint_bytes`` where the model's checkpointed run is not measured (CPU:
    the unwinder's pages that non-reentrant checkpointing's early stop maps, :mod:`autofit.probe.footprint`)."""
    runtime_at_init_bytes: int = 0
    """The part of ``runtime_overhead_bytes`` already held while ``deepspeed.initialize`` runs (the
    communicator's buffers); the rest appears with the first forward and backward."""
    memory_scale: float = 1.0
    """Multiplicative correction of the predicted peak, fitted from probes (1.0 = uncalibrated); on CUDA it
    scales the peak less the additive runtime term (:mod:`autofit.cost_model.cuda_runtime`)."""
    outside_allocator_bytes: int | None = None
    """CUDA: device memory a rank holds outside PyTorch's caching allocator (context, NCCL's buffers, lazily
    loaded kernels), learned from probes (NVML's peak less the allocator's); None: priced
    (:func:`autofit.cost_model.cuda_runtime.priced_outside_allocator_bytes`). Unused on the CPU."""

    def __post_init__(self) -> None:
        for dtype, value in self.compute_efficiency.items():
            if not 0.0 < value <= MAX_EFFICIENCY:
                raise AutofitError(
                    f"compute_efficiency[{dtype!r}] must be within (0, {MAX_EFFICIENCY:g}], but got {value!r}"
                )
        if self.memory_scale <= 0:
            raise AutofitError(f"memory_scale must be positive, but got {self.memory_scale!r}")

    def efficiency(self, dtype: str) -> float:
        return self.compute_efficiency.get(dtype, min(self.compute_efficiency.values()))

    def with_(self, **changes: Any) -> Coefficients:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Coefficients:
        return cls(**data)

    @classmethod
    def for_hardware(cls, hardware: Hardware) -> Coefficients:
        """Starting values before any probe.

        CUDA: a roofline of the step's kernels. Matmuls run at the device's measured matmul ceiling
        (:attr:`Hardware.matmul_ceiling`, the MAMF fraction; :data:`UNMEASURED_MATMUL_CEILING` where none is
        measured), the kernels that do no matmul at :data:`ACHIEVED_BANDWIDTH` of the memory bandwidth, both
        times the share of that roofline a whole training step reaches on the device
        (:attr:`Hardware.step_efficiency`, from one published run; :data:`UNANCHORED_STEP_EFFICIENCY` where none),
        and the host's dispatch where it is slower (:mod:`autofit.cost_model.dispatch`).
        The two sides differ across generations: an H100 has 3.2x an
        A100's bf16 FLOP/s but 1.6x its bandwidth, so the same model spends a larger share of its step in
        memory-bound kernels there (the lower MFU its published runs report).
        CPU: MKL/oneDNN reach ~35% of nominal fp32 on large matmuls, everything else folded in; bf16 is given
        the same nominal value (not assumed faster or slower) until a probe measures it.
        """
        if hardware.kind == "cuda":
            step = hardware.step_efficiency or UNANCHORED_STEP_EFFICIENCY
            ceiling = step * (hardware.matmul_ceiling or UNMEASURED_MATMUL_CEILING)
            return cls(
                # fp8 keeps the earlier prior's ratio to bf16 (0.35 / 0.45): an assumption, no fp8 MAMF is sourced
                compute_efficiency={"fp32": ceiling, "bf16": ceiling, "fp16": ceiling, "fp8": ceiling * 0.35 / 0.45},
                memory_bound_bytes_per_s=step * ACHIEVED_BANDWIDTH * hardware.memory_bandwidth_bytes_per_s,
                # the host's dispatch is priced by its own model (cost_model/dispatch.py), phase by phase
                micro_batch_overhead_s=0.0,
                step_overhead_s=0.0,
                optimizer_bytes_per_s=0.7 * hardware.memory_bandwidth_bytes_per_s,
                runtime_overhead_bytes=0,
                # an assumption, not a measurement: tens of microseconds a call, the floor nccl-tests' smallest
                # messages show (NCCL's doc/PERFORMANCE.md: small sizes are latency-bound)
                collective_latency_s=30e-6,
            )
        return cls._cpu_prior(hardware)

    @classmethod
    def _cpu_prior(cls, hardware: Hardware) -> Coefficients:
        """:meth:`for_hardware` on the CPU, each value with where it comes from."""
        return cls(
            compute_efficiency={"fp32": 0.35, "bf16": 0.35, "fp16": 0.35},
            micro_batch_overhead_s=0.002,
            step_overhead_s=0.005,
            optimizer_bytes_per_s=0.25 * hardware.memory_bandwidth_bytes_per_s,
            # DeepSpeed's CPU accelerator has no streams (cpu_accelerator.py: ``Stream`` is None, ``stream()`` a
            # no-op context, ``resolves_data_dependency()`` True): gloo's collectives run in line, nothing overlaps
            overlap_efficiency=0.0,
            # the examples' rows (benchmarks/accuracy/memory_accuracy.py --quick on gpt, hf_bert, mlp; 18 rows, ZeRO 0-3,
            # fp32 and bf16): measured peak less the priced tensors less the model's measured kernel footprint
            # (beyond initialize, checkpointed where the row checkpoints: autofit.probe.footprint), 9.4-15.3 MiB but
            # one ZeRO-3 row at 5.9, median 12.3: the build's and initialize's own (9-10 MiB, runtime_at_init_bytes),
            # the step's: DeepSpeed's engine, the optimizer's kernels, allocator arenas. The footprint is taken
            # beyond initialize and checkpointed where the row checkpoints so that this constant neither carries the
            # checkpointed runs' unwinder pages nor counts the build's pages twice (docs/results/memory.md). At the
            # probe's one-page mmap threshold and settled footprint the same 18 rows are predicted -3.4% to +1.7%.
            runtime_overhead_bytes=12 * MIB,
            # where the model's own is not measured: the examples' fp32 footprints (autofit.probe.footprint:
            # gpt 19.0, hf_bert 17.0, mlp 14.2 MiB), the median ...
            kernel_footprint_bytes=17 * MIB,
            # ... and what checkpointing adds to it (the same: gpt 3.4, hf_bert 2.9, mlp 3.2 MiB), the median
            checkpoint_footprint_bytes=int(3.2 * MIB),
            # the same config in bf16 and fp32 on the three examples (gpt, mlp, hf_bert; ZeRO 0, 1, 2;
            # micro-batches 4 and 16): bf16's peak sits 4.4-8.7 MiB, median 6.0, further above its
            # prediction than fp32's does, every tensor priced alike (benchmarks/accuracy/memory_accuracy.py rows); their
            # measured footprints agree (bf16 less fp32: gpt 6.8, hf_bert 8.1, mlp 4.5 MiB)
            runtime_16bit_extra_bytes=6 * MIB,
            # resident memory once deepspeed.initialize returns (fp32, ZeRO-0) less the parameters' bytes:
            # gloo and DeepSpeed's CPU shared-memory communicator; 9.9-10.8 MiB on three models of
            # 4.8 M to 57 M parameters (ViT, GQA-LLaMA, Qwen2: independent of the model)
            runtime_at_init_bytes=10 * MIB,
        )
