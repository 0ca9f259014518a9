"""ManualGradSampleModule: the wrapper for ``grad_sample_mode="no_op"``, where the training loop
computes the per-sample gradients itself (for example with ``torch.func.vmap(grad(...))``) and
stores them in ``param.grad_sample``; Opacus calls it ``GradSampleModuleNoOp``.

Nothing is hooked: the forward is the module's own, and ``DPOptimizer`` clips, noises and records
whatever ``grad_sample`` the loop left, exactly as it does for hook-computed ones. The step contract
(``privacy_engine.training.step_contract``) still applies once ``privacy_engine.connect_private`` connects the
wrapper to a ``DPOptimizer``: each training forward tells the bound optimizer
which batch it runs on, and the per-sample gradients set afterwards are released as that batch's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from privacy_engine.capture.common import WrappedModuleAccess, forward_with_model_signature
from privacy_engine.capture.module import GradSampleModule
from privacy_engine.capture.step_binding import mark_wrapped_parameters, unmark_wrapped_parameters
from privacy_engine.settings_checks import check_loss_reduction

__all__ = ["ManualGradSampleModule"]


class ManualGradSampleModule(WrappedModuleAccess, nn.Module):
    """Wraps ``module`` without computing anything: the loop sets ``p.grad_sample`` itself.

    Guarantee (conditional on the loop): the privacy of a step holds if, before ``step()``, every
    trainable parameter ``p`` holds ``p.grad_sample`` of shape ``(batch, *p.shape)`` whose row ``i``
    is the gradient of example ``i``'s own loss only (one row per example the sampler drew, the
    same examples in the same order for every parameter). The number of rows is checked against the
    batch of the last training forward (the step raises otherwise); what a row holds cannot be: a row
    that mixes examples breaks the guarantee silently. ``GradSampleModule`` computes these rows exactly;
    use this mode only when the loop must compute them itself.

    =================================  ============================================
    case                               result
    =================================  ============================================
    forward (any mode)                 the module's own forward, nothing captured
    loop sets no grad_sample           the step adds noise alone (like an empty batch)
    grad_sample set, no training       the optimizer refuses the step (the rows are tied
    forward on a loader batch          to no batch the private loader drew)
    grad_sample rows != examples of    ``RuntimeError`` at ``step()``, before anything is
    the last training forward's batch  clipped, released or counted
    rows scaled by 1/B (mean loss)     wrong: rows must be per-example gradients
    zero_grad()                        clears .grad and grad_sample
    state_dict()                       the module's own keys (no ``_module.``)
    load_state_dict(wrapper keys)      ``_module.`` prefix removed, then loaded
    =================================  ============================================

    Args:
        module: the model (not copied).
        batch_first, loss_reduction: recorded as the hooks wrapper records them; the loop's gradients are
            used as given (``loss_reduction`` does not rescale them).
    """

    def __init__(self, module: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean") -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ManualGradSampleModule wraps an nn.Module; got {type(module).__name__}")
        if isinstance(module, (GradSampleModule, ManualGradSampleModule)):
            raise TypeError("module is already wrapped; pass the original module")
        check_loss_reduction(loss_reduction)
        super().__init__()
        self._module = module
        self.batch_first = batch_first
        self.loss_reduction = loss_reduction
        self._consumer: Any = None  # the DPOptimizer that releases this model's steps (step contract)
        self._ticket = None  # the batch of the last training forward
        mark_wrapped_parameters(module, type(self).__name__)  # binds nothing: privacy_engine.connect_private does

    @forward_with_model_signature
    def forward(self, *args, **kwargs):
        """Run the wrapped module's own forward (nothing captured). When bound to an optimizer, in training
        mode with gradients on, also record the batch this forward runs on (``StepContract.resolve``; the
        batch size is that of the first tensor input with a batch dimension), which ``flush_grad_samples``
        hands over with the loop's ``grad_sample``. ``RuntimeError`` from ``resolve`` when the inputs are
        ambiguous (tensors of two batches, a copy equal to several draws; see ``StepContract.resolve``)."""
        output = self._module(*args, **kwargs)
        if self._consumer is not None and self.training and torch.is_grad_enabled():
            batch_dim = 0 if self.batch_first else 1
            batch_size = _batch_size(args, kwargs, batch_dim)
            if batch_size is not None:
                self._ticket = self._consumer.contract.resolve(args, kwargs, batch_size, batch_dim=batch_dim)
        return output

    # ------------------------------------------------------------------ the step contract
    def bind(self, consumer: Any) -> None:
        """Tie this model's training forwards to ``consumer`` (a ``DPOptimizer``): the wrapper's half of
        ``privacy_engine.connect_private``, which checks the pair and connects both halves (call that).
        ``ValueError`` if already bound to another optimizer."""
        if self._consumer is not None and self._consumer is not consumer:
            raise ValueError(
                "this wrapper is already connected to another DPOptimizer (privacy_engine.connect_private)"
            )
        self._consumer = consumer

    def flush_grad_samples(self) -> None:
        """Hand the per-sample gradients the loop set to the bound optimizer, as those of the batch of
        the last training forward (called by the optimizer before it clips)."""
        ticket = self._ticket
        if self._consumer is None or ticket is None:
            return
        trainable = [(name, p) for name, p in self._module.named_parameters() if p.requires_grad]
        if any(getattr(p, "grad_sample", None) is not None for _, p in trainable):
            _check_rows(trainable, ticket)
            self._ticket = None
            self._consumer.accumulate_pass(ticket)

    def to_standard_module(self) -> nn.Module:
        """The original module, with the ``grad_sample`` attributes removed."""
        self._consumer = None
        unmark_wrapped_parameters(self._module)
        for param in self._module.parameters():
            if hasattr(param, "grad_sample"):
                del param.grad_sample
        return self._module


def _check_rows(trainable: list[tuple[str, nn.Parameter]], ticket: Any) -> None:
    """Raise, before anything is clipped, unless every ``grad_sample`` the loop set has one row per
    example of the batch of the last training forward (``ticket``): a row more would be a second
    contribution of some example, clipped on its own and released beside the first."""
    rows = ticket.num_rows
    for name, param in trainable:
        grad_sample = getattr(param, "grad_sample", None)
        if grad_sample is not None and (grad_sample.dim() == 0 or grad_sample.shape[0] != rows):
            found = "a 0-dim tensor" if grad_sample.dim() == 0 else f"{grad_sample.shape[0]} rows"
            raise RuntimeError(
                f"parameter {name!r} has grad_sample with {found}, but the last training forward ran on a batch "
                f"of {rows} examples: grad_sample_mode='no_op' needs one row per example of that batch (row i the "
                f"gradient of example i's own loss). Nothing was released or counted. Compute the per-sample "
                f"gradients over exactly the batch given to the model."
            )


def _batch_size(args: tuple, kwargs: dict, batch_dim: int) -> int | None:
    """The batch size of the first tensor input with a batch dimension, or None."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > batch_dim:
            return int(value.shape[batch_dim])
    return None
