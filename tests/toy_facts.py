"""A toy model's traced facts and a toy CPU, made by hand: what the pure tests of the cost model,
its calibration, the search policy and the report share (no torch)."""

from __future__ import annotations

from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.cost_model import ActivationProfile, Coefficients, ModelFacts, PeakPoint

MIB = 2**20


def _profile(dtype: str, checkpointed: bool) -> ActivationProfile:
    elem = 4 if dtype == "fp32" else 2
    act = 3 * MIB * elem // 4 if checkpointed else 8 * MIB * elem // 4
    flops = 4e9 if checkpointed else 3e9
    points = tuple(
        PeakPoint(
            micro_batch_size=n,
            peak_with_grads_bytes=n * act + 4 * MIB,
            peak_without_grads_bytes=n * act,
            activation_bytes=n * act,
            grad_bytes=4 * MIB,
            flops=int(n * flops),
        )
        for n in (1, 2, 4)
    )
    return ActivationProfile(dtype=dtype, attention="sdpa", checkpointed=checkpointed, points=points)


FACTS = ModelFacts(
    name="toy",
    n_params=1_000_000,
    n_trainable_params=1_000_000,
    n_layers=4,
    layer_params=(240_000,) * 4,
    largest_module_params=65_536,
    largest_param_numel=65_536,
    n_small_params=10_000,
    factored_state_numel=20_000,
    n_param_tensors=20,
    n_persistent_params=0,
    buffer_bytes=0,
    tokens_per_sample=None,
    profiles={ActivationProfile.key(d, "sdpa", c): _profile(d, c) for d in ("fp32", "bf16") for c in (False, True)},
)
CPU = Hardware(
    name="cpu",
    kind="cpu",
    memory_bytes=1024 * MIB,
    peak_flops={"fp32": 1e11, "bf16": 1e11, "fp16": 1e11},
    memory_bandwidth_bytes_per_s=20e9,
    intra_node_bytes_per_s=5e9,
    pcie_bytes_per_s=20e9,
    host_memory_bytes=2**34,
)
PRIOR = Coefficients.for_hardware(CPU)
CONFIGS = [
    Config(micro_batch_size=m, grad_accum_steps=16 // m, precision=p, checkpoint_ratio=r)
    for m in (1, 2, 4, 8)
    for p in ("fp32", "bf16")
    for r in (0.0, 1.0)
]
