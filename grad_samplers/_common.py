"""Small helpers every layer sampler uses: which parameters are trained, results keyed by parameter,
per-example scaling, and the dtype the inputs and output gradient are combined in."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def trainable_weight_and_bias(layer: nn.Module) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """``(weight, bias)`` of ``layer``, each None when absent or frozen (``requires_grad=False``)."""
    # Registered parameters are read from ``_parameters`` directly: what ``getattr`` returns for them (a name
    # registered as a parameter cannot also be a class or instance attribute), without nn.Module.__getattr__'s
    # Python call once per sampler call. Other names (a plain attribute, a buffer) still go through getattr.
    own = layer._parameters
    weight = own["weight"] if "weight" in own else getattr(layer, "weight", None)
    bias = own["bias"] if "bias" in own else getattr(layer, "bias", None)
    return (
        weight if weight is not None and weight.requires_grad else None,
        bias if bias is not None and bias.requires_grad else None,
    )


def keyed_by_parameter(
    pairs: Iterable[tuple[nn.Parameter | None, torch.Tensor | None]],
) -> dict[nn.Parameter, torch.Tensor]:
    """``{param: value}`` for the ``(param, value)`` pairs where neither is None."""
    return {param: value for param, value in pairs if param is not None and value is not None}


def scale_per_example(tensor: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``tensor`` (batch first) with example ``i`` multiplied by ``weights[i]``: the output gradient a
    weighted-sum sampler differentiates with (every gradient is linear in it)."""
    if weights.dtype is not tensor.dtype:
        weights = weights.to(tensor.dtype)
    return tensor * weights.reshape(-1, *([1] * (tensor.dim() - 1)))


def common_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype inputs and output gradient are combined in (they differ under autocast): the widest."""
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        if tensor.dtype is not dtype:  # equal dtypes (the usual case) promote to themselves: no dispatch
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def batch_error(layer_name: str, expected: str, inputs: object) -> ValueError:
    """The error for an input without the batch dimension a per-sample gradient needs."""
    shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
    return ValueError(
        f"{layer_name} per-sample gradients need a batched input {expected}; got input of shape {shape}. "
        f"Add the batch dimension (input.unsqueeze(0) for a single example)."
    )


__all__ = ["batch_error", "common_dtype", "keyed_by_parameter", "scale_per_example", "trainable_weight_and_bias"]
