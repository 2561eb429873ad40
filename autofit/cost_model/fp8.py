"""What fp8 training (torchao's float8, :mod:`autofit.ds.fp8`) changes in memory and time.

Time: only the matmuls of the converted Linear layers run at the fp8 rate; the rest of the step
(attention, norms, the Linears torchao cannot take) runs at the bf16 rate, so
``compute = a x ((F - F8) / rate[bf16] + F8 / rate[fp8])`` with ``F8`` the traced FLOPs inside the
converted layers.

Casts: before its three matmuls a ``Float8Linear`` (tensorwise) scales and casts its input ``M x K``, its weight
``K x N`` and its output gradient ``M x N`` (torchao/float8/float8_linear.py, ``matmul_with_hp_or_float8_args``:
each cast is ``hp_tensor_to_float8_dynamic``, an amax, a scale and the cast), six casts a micro-batch, two per
tensor (one per layout the matmuls take). They are memory-bound passes, priced at the device's bandwidth
(:func:`fp8_cast_seconds`). Unfused (eager), each cast is the chain of ATen kernels torchao runs: ``abs`` (read
2, write 2 bytes an element), ``max`` (read 2), ``.to(float32)`` (read 2, write 4), ``* scale`` (read 4, write
4), ``clamp`` (read 4, write 4; torchao/float8/float8_utils.py ``to_fp8_saturated``) and ``.to(float8)`` (read
4, write 1): :data:`EAGER_CAST_BYTES` = 33 bytes an element. Under ``torch.compile`` inductor fuses them; what
is left is torchao's own roofline for the tensorwise recipe (torchao/testing/training/roofline_utils.py,
``get_tensor_memory_traffic_ovhd_s``, without fusion into the producer): the input and the output gradient
are read for the amax and read once more to write both fp8 layouts (2 + 2 + 2 x 1 = 6 bytes an element),
the weight read for the amax and cast once in forward and once in backward (2 + 2 x (2 + 1) = 8). torchao's
README says it: "enable torch.compile to generate fused kernels for float8 scaling and casting"; its issue
pytorch/ao#685 measured an fp8 FFN without compile slower than fp16. Kernel launches (about 36 a converted
Linear a micro-batch unfused) are not priced.

Memory: torchao's ``matmul_with_hp_or_float8_args`` (torchao/float8/float8_linear.py) saves the
high-precision input and weight for backward, so the saved activations are the bf16 trace's; what
fp8 adds are the casts alive while one layer runs: the weight in fp8 (1 byte per element), its
input in forward and the gradient of its output in backward (1 byte per element each). The
largest converted layer bounds them: ``in x out + tokens x (in + out)`` bytes, tokens being the
micro-batch's (0 where the workload has no tokens).
"""

from __future__ import annotations

from autofit.core.config import Config
from autofit.core.hardware import Hardware
from autofit.cost_model.facts import ModelFacts

#: bytes an element that one unfused tensorwise cast moves (module docstring: abs, max, to fp32, scale, clamp, to fp8)
EAGER_CAST_BYTES = 33
#: casts of each tensor a micro-batch, unfused: float8_linear.py casts input, weight and output gradient twice each
EAGER_CASTS_PER_TENSOR = 2
#: compiled, torchao's roofline: bytes an element of the input and the output gradient (amax read, one read
#: writing both fp8 layouts) ...
FUSED_ACTIVATION_CAST_BYTES = 6
#: ... and of the weight (amax read, cast in forward and again in backward)
FUSED_WEIGHT_CAST_BYTES = 8
#: share of the datasheet bandwidth a pointwise kernel reaches (torchao's roofline_utils.py, pct_achievable_mem_bw
#: for H100: "pointwise triton kernels with large inputs")
ACHIEVABLE_BANDWIDTH = 0.92


def fp8_flops(config: Config, facts: ModelFacts) -> float:
    """Traced FLOPs of one micro-batch inside the converted Linear layers (0 unless fp8)."""
    if config.precision != "fp8":
        return 0.0
    n_ckpt = config.checkpointed_layers(facts.n_layers)
    return facts.at_checkpointed(config.trace_dtype, config.attention, n_ckpt, config.micro_batch_size, "fp8_flops")


def fp8_cast_bytes(config: Config, facts: ModelFacts) -> int:
    """Bytes of the fp8 casts alive while the largest converted Linear runs (0 unless fp8)."""
    if config.precision != "fp8":
        return 0
    n_in, n_out = facts.fp8_largest_linear
    tokens = config.micro_batch_size * (facts.tokens_per_sample or 0)
    return n_in * n_out + tokens * (n_in + n_out)


def fp8_rows(config: Config, facts: ModelFacts) -> float:
    """Rows ``M`` each converted Linear sees in one micro-batch: the traced fp8 FLOPs without recompute over
    ``6 x sum(in x out)`` (a Linear's forward and backward are ``6 M K N`` FLOPs); the micro-batch's tokens where
    nothing was traced."""
    if facts.fp8_weight_elements <= 0:
        return 0.0
    traced = facts.at_checkpointed(config.trace_dtype, config.attention, 0, config.micro_batch_size, "fp8_flops")
    if traced > 0:
        return traced / (6 * facts.fp8_weight_elements)
    return float(config.micro_batch_size * (facts.tokens_per_sample or 1))


def fp8_cast_traffic_bytes(config: Config, facts: ModelFacts) -> float:
    """Bytes the fp8 casts of one micro-batch move (module docstring): fused under ``compile``, unfused without."""
    if config.precision != "fp8":
        return 0.0
    activations = fp8_rows(config, facts) * facts.fp8_feature_elements  # sum of M x (K + N)
    weights = float(facts.fp8_weight_elements)  # sum of K x N
    if config.compile == "on":
        return FUSED_ACTIVATION_CAST_BYTES * activations + FUSED_WEIGHT_CAST_BYTES * weights
    return EAGER_CASTS_PER_TENSOR * EAGER_CAST_BYTES * (activations + weights)


def fp8_cast_seconds(config: Config, facts: ModelFacts, hardware: Hardware) -> float:
    """Seconds of one micro-batch's fp8 casts: their bytes over the achievable memory bandwidth."""
    moved = fp8_cast_traffic_bytes(config, facts)
    if moved <= 0 or hardware.memory_bandwidth_bytes_per_s <= 0:
        return 0.0
    return moved / (hardware.memory_bandwidth_bytes_per_s * ACHIEVABLE_BANDWIDTH)
