"""What fp8 training (torchao's float8, :mod:`autofit.fp8`) changes in memory and time.

Time: only the matmuls of the converted Linear layers run at the fp8 rate; the rest of the step
(attention, norms, the Linears torchao cannot take) runs at the bf16 rate, so
``compute = a x ((F - F8) / rate[bf16] + F8 / rate[fp8])`` with ``F8`` the traced FLOPs inside the
converted layers.

Memory: torchao's ``matmul_with_hp_or_float8_args`` (torchao/float8/float8_linear.py) saves the
high-precision input and weight for backward, so the saved activations are the bf16 trace's; what
fp8 adds are the casts alive while one layer runs: the weight in fp8 (1 byte per element), its
input in forward and the gradient of its output in backward (1 byte per element each). The
largest converted layer bounds them: ``in x out + tokens x (in + out)`` bytes, tokens being the
micro-batch's (0 where the workload has no tokens).
"""

from __future__ import annotations

from autofit.config import Config
from autofit.cost_model.facts import ModelFacts


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
