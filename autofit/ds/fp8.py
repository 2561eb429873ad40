"""fp8 training as autofit runs it: torchao's float8 (``torchao.float8.convert_to_float8_training``).

Each ``nn.Linear`` whose dimensions ``torch._scaled_mm`` accepts (both multiples of 16) becomes a
``Float8Linear``: its matmuls run in fp8 with dynamic per-tensor scales (the ``tensorwise`` recipe),
everything else (attention, norms, the optimizer) stays bf16 under DeepSpeed's ``bf16`` section.
This module is pure (no torch): the trace, the cost model and :mod:`autofit.ds.apply` share its rule.
"""

from __future__ import annotations

#: torchao's float8 recipe each fp8 candidate runs (``Float8LinearConfig.from_recipe_name``): dynamic
#: per-tensor scales, torchao's default
FP8_RECIPE = "tensorwise"
#: ``torch._scaled_mm`` needs both matrix dimensions divisible by 16
FP8_DIM_MULTIPLE = 16


def convertible_linear(in_features: int, out_features: int) -> bool:
    """Whether a Linear of these dimensions is converted to fp8 (the filter given to torchao)."""
    return in_features % FP8_DIM_MULTIPLE == 0 and out_features % FP8_DIM_MULTIPLE == 0
