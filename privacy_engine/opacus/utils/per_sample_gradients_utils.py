"""``opacus.utils.per_sample_gradients_utils.check_per_sample_gradients_are_correct``: the engine's
per-sample gradients of a module checked against a per-example loop."""

from __future__ import annotations

import copy

import torch
from torch import nn

from privacy_engine.capture import GradSampleModule, ParameterUsageError

__all__ = ["check_per_sample_gradients_are_correct"]


def _per_example_gradients(module: nn.Module, x: torch.Tensor, batch_dim: int) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(module)
    trainable = [(name, p) for name, p in reference.named_parameters() if p.requires_grad]
    rows: dict[str, list[torch.Tensor]] = {name: [] for name, _ in trainable}
    for index in range(x.shape[batch_dim]):
        reference.zero_grad(set_to_none=True)
        reference(x.narrow(batch_dim, index, 1)).sum().backward()
        for name, param in trainable:
            rows[name].append(torch.zeros_like(param) if param.grad is None else param.grad.detach().clone())
    return {name: torch.stack(grads) for name, grads in rows.items()}


def check_per_sample_gradients_are_correct(
    x: torch.Tensor,
    module: nn.Module,
    *,
    batch_first: bool = True,
    atol: float = 10e-6,
    rtol: float = 10e-5,
    grad_sample_mode: str = "hooks",
) -> bool:
    """Whether ``GradSampleModule`` gives, for every example of ``x`` and every trainable parameter of
    ``module``, the gradient of that example's own loss (the sum of its outputs), computed by running
    each example alone through a copy of ``module``; for ``loss_reduction`` ``"sum"`` and ``"mean"``
    (``torch.allclose`` with ``atol``, ``rtol``). ``module`` itself is not changed (copies are used).
    Per-sample gradients that do not even sum to the gradient (the wrapper's first-backward check
    raises ``ParameterUsageError``) also give False.

    ``grad_sample_mode``: ``"hooks"``, ``"functorch"`` or ``"ew"`` (the same exact gradients here);
    anything else raises ``ValueError``. ``x`` must be a tensor (batch on dim 0, or dim 1 if not
    ``batch_first``).
    """
    if grad_sample_mode not in ("hooks", "functorch", "ew"):
        raise ValueError(f"grad_sample_mode must be 'hooks', 'functorch' or 'ew'; got {grad_sample_mode!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor (the input batch); got {type(x).__name__}")
    batch_dim = 0 if batch_first else 1
    expected = _per_example_gradients(module, x, batch_dim)
    for reduction in ("sum", "mean"):
        model = copy.deepcopy(module)
        wrapped = GradSampleModule(model, batch_first=batch_first, loss_reduction=reduction)
        output = wrapped(x)
        loss = output.sum() if reduction == "sum" else output.sum() / x.shape[batch_dim]
        try:
            loss.backward()
        except ParameterUsageError:
            return False  # the engine's own check found per-sample gradients that do not sum to the gradient
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            grad_sample = getattr(param, "grad_sample", None)
            if grad_sample is None or not torch.allclose(grad_sample, expected[name], atol=atol, rtol=rtol):
                return False
        wrapped.to_standard_module()
    return True
