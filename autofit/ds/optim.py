"""Optimizers DeepSpeed's JSON cannot give on every device, and Adam-mini (the ``adam-mini`` package).

DeepSpeed's ``"type": "Lion"`` is FusedLion, a CUDA kernel (its CPU builder raises
"This op had not been implemented on CPU backend"); on the CPU the training
script passes this Lion as a client optimizer instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from autofit.core.errors import AutofitError


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


#: ``(config attribute, module attributes)`` where :func:`adam_mini_dims` looks for the hidden size,
#: the attention heads and the key/value heads: a Hugging Face config first, then an attention module's own
_HEAD_ATTRS = (("num_attention_heads", ("n_heads", "num_heads", "num_attention_heads")),
               ("num_key_value_heads", ("n_kv_heads", "num_key_value_heads", "num_kv_heads")))


def adam_mini_dims(model: Any) -> dict[str, int]:
    """``dim``, ``n_heads`` (and ``n_kv_heads``) for Adam-mini's per-head partition of queries and keys.

    Adam-mini 1.1.1 (``adam_mini.py``) views a query or key weight as rows of ``dim * dim / n_heads``
    elements, one second-moment value per row (head). Read from a Hugging Face ``config``
    (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``), else from the first module with
    an integer head count and ``head_dim`` (``dim = n_heads x head_dim``). ``{}`` where neither is found.
    """
    config: Any = getattr(model, "config", None)  # a Hugging Face config, if any: read by duck typing
    if isinstance(getattr(config, "hidden_size", None), int) and isinstance(getattr(config, "num_attention_heads", None), int):
        dims = {"dim": config.hidden_size, "n_heads": config.num_attention_heads}
        kv = getattr(config, "num_key_value_heads", None)
        return dims | ({"n_kv_heads": kv} if isinstance(kv, int) else {})
    for module in model.modules():
        heads = next((getattr(module, a) for a in _HEAD_ATTRS[0][1] if isinstance(getattr(module, a, None), int)), None)
        head_dim = getattr(module, "head_dim", None)
        if heads and isinstance(head_dim, int):
            kv = next((getattr(module, a) for a in _HEAD_ATTRS[1][1] if isinstance(getattr(module, a, None), int)), None)
            return {"dim": heads * head_dim, "n_heads": heads} | ({"n_kv_heads": kv} if kv else {})
    return {}


def make_adam_mini(model: Any, lr: float = 1e-4, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999)) -> Any:
    """Adam-mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To Gain More"), the ``adam-mini``
    package's ``Adam_mini`` over ``model.named_parameters()`` (it partitions by parameter name), with the
    head layout of :func:`adam_mini_dims`. Without the package: an :class:`AutofitError` naming it.

    A model whose query/key weights Adam-mini would split per head but whose head layout cannot be found
    is refused here, before training: Adam-mini's default (dim 2048, 32 heads) would mis-split them.
    """

    try:
        from adam_mini import Adam_mini
    except ImportError as exc:
        raise AutofitError(f"optimizer adam_mini needs the adam-mini package (pip install -e '.[train]'): {exc}") from None
    dims = adam_mini_dims(model)
    optimizer = Adam_mini(model.named_parameters(), lr=lr, betas=betas, weight_decay=weight_decay, verbose=False, **dims)
    if not dims:
        split = [g["name"] for g in optimizer.param_groups if any(n in g["name"] for n in optimizer.wqk_names)]
        if split:
            raise AutofitError(
                f"adam_mini splits {split[0]!r} per attention head, but the model's hidden size and head count "
                "were not found (a Hugging Face config, or a module with n_heads and head_dim)"
            )
    return optimizer


def adam_mini_state_numel(build_model: Callable[[], Any]) -> int:
    """Elements of Adam-mini's states for the model ``build_model()`` makes (on the meta device): its own step
    run once under ``FakeTensorMode`` (shapes only, no memory), so the count is the package's partition itself --
    a full first moment and one second-moment value per head, neuron, or block (``adam_mini.py``)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):  # a build on fake tensors can refuse data-dependent init (a ViT's trunc_normal_)
        model = build_model()
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    with FakeTensorMode(allow_non_fake_inputs=True):
        optimizer = make_adam_mini(model)
        optimizer.step()
        return int(sum(t.numel() for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)))
