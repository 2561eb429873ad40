"""Optimizers DeepSpeed's JSON cannot give on every device.

DeepSpeed's ``"type": "Lion"`` is FusedLion, a CUDA kernel (its CPU builder raises
"This op had not been implemented on CPU backend"); on the CPU the training
script passes this Lion as a client optimizer instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def make_lion(params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
              weight_decay: float = 0.0) -> Any:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2).

    One state per parameter (the momentum ``m``, same dtype as the parameter):
    ``u = sign(b1*m + (1-b1)*g)``; ``p -= lr*(u + wd*p)``; ``m = b2*m + (1-b2)*g``.
    """
    import torch

    class Lion(torch.optim.Optimizer):
        def __init__(self) -> None:
            super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = closure() if closure is not None else None
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if "exp_avg" not in state:
                        state["exp_avg"] = torch.zeros_like(p)
                    m = state["exp_avg"]
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    update = m.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                    p.add_(update, alpha=-group["lr"])
                    m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
            return loss

    return Lion()
