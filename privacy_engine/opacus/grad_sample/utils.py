"""``opacus.grad_sample.utils``: ``register_grad_sampler``, ``register_norm_sampler`` (this engine's
sampler registry), ``get_gsm_class`` and ``wrap_model`` (the wrapper of a ``grad_sample_mode``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from grad_samplers.registry import register_grad_sampler, register_norm_sampler
from privacy_engine.opacus.grad_sample import get_gsm_class

__all__ = ["get_gsm_class", "register_grad_sampler", "register_norm_sampler", "wrap_model"]


def wrap_model(model: nn.Module, grad_sample_mode: str, batch_first: bool = True, loss_reduction: str = "mean",
               **kwargs: Any) -> nn.Module:  # fmt: skip
    """``model`` wrapped for ``grad_sample_mode`` (``"hooks"``, ``"functorch"``, ``"ew"``, ``"ghost"``,
    ``"no_op"``): ``get_gsm_class(grad_sample_mode)(model, batch_first=, loss_reduction=, **kwargs)``.

    An unknown mode raises ``ValueError`` naming the accepted ones; a model with a layer the engine
    cannot give per-sample gradients for raises the wrapper's error before the model is changed.
    """
    wrapper = get_gsm_class(grad_sample_mode)
    return wrapper(model, batch_first=batch_first, loss_reduction=loss_reduction, **kwargs)
