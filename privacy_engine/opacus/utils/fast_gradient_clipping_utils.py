"""``opacus.utils.fast_gradient_clipping_utils``: Opacus's loss wrapper for fast gradient clipping.

Opacus clips in ghost mode with two backward passes, packaged in the loss it returns
(``DPLossFastGradientClipping(module, optimizer, criterion)(output, target)`` gives a
``DPTensorFastGradientClipping`` whose ``backward()`` runs both). Here the fast-clipping wrapper clips
inside the ordinary single backward pass, so these classes only keep Opacus's interface: the
per-example losses, arithmetic on them (``loss + other_loss``, ``2 * loss``, ``loss / k``), and
``backward()`` on their reduction (mean or sum, the wrapper's ``loss_reduction``). The released
update is the same as with ``make_private(grad_sample_mode="ghost")`` and a plain criterion.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DPLossFastGradientClipping", "DPTensorFastGradientClipping"]

_REDUCTIONS = ("mean", "sum")


class DPTensorFastGradientClipping:
    """Per-example losses (``loss_per_sample``, shape ``(batch,)``) with the module, optimizer and reduction
    they belong to; ``backward()`` back-propagates their mean (or sum)."""

    def __init__(self, module: Any, optimizer: Any, loss_per_sample: torch.Tensor, loss_reduction: str = "mean") -> None:
        if loss_reduction not in _REDUCTIONS:
            raise ValueError(f"loss_reduction must be 'mean' or 'sum'; got {loss_reduction!r}")
        self.module = module
        self.optimizer = optimizer
        self.loss_per_sample = loss_per_sample
        self.loss_reduction = loss_reduction

    def _reduced(self) -> torch.Tensor:
        return self.loss_per_sample.mean() if self.loss_reduction == "mean" else self.loss_per_sample.sum()

    def _with(self, loss_per_sample: torch.Tensor) -> DPTensorFastGradientClipping:
        return DPTensorFastGradientClipping(self.module, self.optimizer, loss_per_sample, self.loss_reduction)

    def _operand(self, other: Any) -> Any:
        if isinstance(other, DPTensorFastGradientClipping):
            if other.loss_reduction != self.loss_reduction:
                raise ValueError(f"cannot combine losses reduced by {self.loss_reduction!r} and {other.loss_reduction!r}")
            return other.loss_per_sample
        return other

    def item(self) -> float:
        """The reduced loss as a number."""
        return self._reduced().item()

    def detach(self) -> torch.Tensor:
        """The reduced loss, detached."""
        return self._reduced().detach()

    def __add__(self, other: Any) -> DPTensorFastGradientClipping:
        return self._with(self.loss_per_sample + self._operand(other))

    def __radd__(self, other: Any) -> DPTensorFastGradientClipping:
        return self._with(self._operand(other) + self.loss_per_sample)

    def __sub__(self, other: Any) -> DPTensorFastGradientClipping:
        return self._with(self.loss_per_sample - self._operand(other))

    def __rsub__(self, other: Any) -> DPTensorFastGradientClipping:
        return self._with(self._operand(other) - self.loss_per_sample)

    def __mul__(self, other: Any) -> DPTensorFastGradientClipping:
        if isinstance(other, DPTensorFastGradientClipping):
            raise TypeError("a loss times a loss is not a per-example loss; multiply by a number")
        return self._with(self.loss_per_sample * other)

    def __rmul__(self, other: Any) -> DPTensorFastGradientClipping:
        return self.__mul__(other)

    def __truediv__(self, other: Any) -> DPTensorFastGradientClipping:
        if isinstance(other, DPTensorFastGradientClipping):
            raise TypeError("a loss divided by a loss is not a per-example loss; divide by a number")
        return self._with(self.loss_per_sample / other)

    def __neg__(self) -> DPTensorFastGradientClipping:
        return self._with(-self.loss_per_sample)

    def __repr__(self) -> str:
        return f"DPTensorFastGradientClipping(loss={self.detach().item()!r}, loss_reduction={self.loss_reduction!r})"

    def backward(self) -> None:
        """Back-propagate the reduced loss (the fast-clipping wrapper clips in this one pass)."""
        self._reduced().backward()


class DPLossFastGradientClipping:
    """``criterion`` evaluated per example (its ``reduction`` set to ``"none"`` for the call), wrapped in
    ``DPTensorFastGradientClipping``. ``loss_reduction`` must equal the criterion's, the module's and
    the optimizer's (``ValueError`` otherwise: a mean loss with a sum wrapper would scale every clipped
    gradient by the batch size)."""

    def __init__(self, module: Any, optimizer: Any, criterion: Any, loss_reduction: str = "mean") -> None:
        if loss_reduction not in _REDUCTIONS:
            raise ValueError(f"loss_reduction must be 'mean' or 'sum'; got {loss_reduction!r}")
        if not hasattr(criterion, "reduction"):
            criterion.reduction = getattr(module, "loss_reduction", loss_reduction)
        found = {"criterion": criterion.reduction, "module": getattr(module, "loss_reduction", loss_reduction),
                 "optimizer": getattr(optimizer, "loss_reduction", loss_reduction)}  # fmt: skip
        different = {name: value for name, value in found.items() if value != loss_reduction}
        if different:
            raise ValueError(f"loss_reduction is {loss_reduction!r} but {different}: make them all the same")
        self.module = module
        self.optimizer = optimizer
        self.criterion = criterion
        self.loss_reduction = loss_reduction

    def __call__(self, *args: Any, shape: tuple[int, ...] | None = None, **kwargs: Any) -> DPTensorFastGradientClipping:
        """The per-example losses of ``criterion(*args, **kwargs)``. With ``shape`` ``(batch, length, ...)``
        and one loss per position, the positions of each sequence are reduced first (the privacy unit is
        the sequence; positions equal to the criterion's ``ignore_index`` are left out of a mean)."""
        previous = self.criterion.reduction
        self.criterion.reduction = "none"
        try:
            losses = self.criterion(*args, **kwargs)
        finally:
            self.criterion.reduction = previous
        if shape is not None and losses.shape[0] == shape[0] * shape[1]:
            losses = losses.view(shape[0], shape[1])
            if self.loss_reduction == "sum":
                losses = losses.sum(dim=1)
            else:
                ignore_index = getattr(self.criterion, "ignore_index", None)
                target = kwargs.get("target", args[1] if len(args) >= 2 else None)
                if ignore_index is not None and target is not None:
                    counted = (target.view(shape[0], shape[1]) != ignore_index).sum(dim=1).clamp(min=1)
                    losses = losses.sum(dim=1) / counted
                else:
                    losses = losses.mean(dim=1)
        return DPTensorFastGradientClipping(self.module, self.optimizer, losses, self.loss_reduction)
