"""Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2's projections): a linear map with its weight
stored transposed, ``y = x @ weight + bias`` with ``weight`` of shape ``(in_features, out_features)``.

An example's weight gradient is ``A^T G`` (``A`` its inputs, positions x in; ``G`` its output gradient,
positions x out), the transpose of ``nn.Linear``'s ``G^T A``: the norms are the same numbers (a norm does not
see the transpose) and the weighted sum is the transpose of Linear's.

Registered only when ``transformers`` is already imported (``register_if_imported``): importing it costs
about a second, and a model holding a ``Conv1D`` has imported it anyway.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from grad_samplers.linear import linear_squared_norms, linear_weighted_sums
from grad_samplers.registry import (
    register_grad_sampler,
    register_norm_sampler,
    register_weighted_sum_sampler,
    registered_grad_samplers,
)

_TRANSFORMERS_MODULE = "transformers.pytorch_utils"


def _trainable(layer: nn.Module) -> tuple[bool, bool]:
    return layer.weight.requires_grad, layer.bias is not None and layer.bias.requires_grad


def conv1d_grad_sample(layer: nn.Module, activations, backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-sample gradients of a HF ``Conv1D``: weight ``(B, in, out)``, bias ``(B, out)``.

    Guarantee: ``out[p][i]`` is the gradient of example ``i``'s loss with respect to ``p``, for inputs
    of any rank >= 2 (every dimension between the batch and the features is a position).

    ======================  ======================================
    case                    result
    ======================  ======================================
    frozen weight / bias    left out of the result
    2-D input               one position per example (outer product)
    input of rank < 2       ValueError (no example axis)
    ======================  ======================================
    """
    inputs = activations[0]
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        raise ValueError(
            f"Conv1D per-sample gradients need a batched input (batch, ..., in_features); got "
            f"{tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__}"
        )
    train_weight, train_bias = _trainable(layer)
    batch_size = backprops.shape[0]
    dtype = torch.promote_types(inputs.dtype, backprops.dtype)
    grads = backprops.to(dtype).reshape(batch_size, -1, backprops.shape[-1]) if batch_size else backprops.to(dtype)
    per_sample: dict[nn.Parameter, torch.Tensor] = {}
    if train_weight:
        positions = inputs.shape[1:-1].numel()
        sequences = inputs.to(dtype).reshape(batch_size, positions, inputs.shape[-1])
        grads = grads.reshape(batch_size, positions, backprops.shape[-1])
        per_sample[layer.weight] = torch.bmm(sequences.transpose(1, 2), grads)
    if train_bias:
        per_sample[layer.bias] = grads.reshape(batch_size, -1, backprops.shape[-1]).sum(dim=1)
    return per_sample


def conv1d_norm_sample(layer: nn.Module, activations, backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example squared gradient norms ``(B,)`` (``linear_squared_norms``: the transpose does not change
    a norm). Guarantee: ``out[p][i] == ||conv1d_grad_sample(...)[p][i]||^2`` up to float rounding."""
    train_weight, train_bias = _trainable(layer)
    weight_norms, bias_norms = linear_squared_norms(activations[0], backprops, weight=train_weight, bias=train_bias)
    norms: dict[nn.Parameter, torch.Tensor] = {}
    if weight_norms is not None:
        norms[layer.weight] = weight_norms
    if bias_norms is not None:
        norms[layer.bias] = bias_norms
    return norms


def conv1d_weighted_sum(
    layer: nn.Module, activations, backprops: torch.Tensor, weights: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``sum_i weights[i] * g_i`` for the weight ``(in, out)`` and bias ``(out,)``: Linear's weighted sum,
    transposed. Guarantee: equals the weighted sum of ``conv1d_grad_sample`` up to float rounding."""
    train_weight, train_bias = _trainable(layer)
    weight_sum, bias_sum = linear_weighted_sums(activations[0], backprops, weights, weight=train_weight, bias=train_bias)
    sums: dict[nn.Parameter, torch.Tensor] = {}
    if weight_sum is not None:
        sums[layer.weight] = weight_sum.t().contiguous()
    if bias_sum is not None:
        sums[layer.bias] = bias_sum
    return sums


def register_if_imported() -> bool:
    """Register the three samplers for ``transformers.pytorch_utils.Conv1D`` if ``transformers`` has been
    imported (never imports it) and nobody registered a grad sampler for it (a plugin's stays). Returns
    whether ``Conv1D`` has a grad sampler now. Cheap to call repeatedly."""
    module = sys.modules.get(_TRANSFORMERS_MODULE)
    conv1d = getattr(module, "Conv1D", None)
    if not (isinstance(conv1d, type) and issubclass(conv1d, nn.Module)):
        return False
    if conv1d not in registered_grad_samplers():
        register_grad_sampler(conv1d)(conv1d_grad_sample)
        register_norm_sampler(conv1d)(conv1d_norm_sample)
        register_weighted_sum_sampler(conv1d)(conv1d_weighted_sum)
    return True


__all__ = ["conv1d_grad_sample", "conv1d_norm_sample", "conv1d_weighted_sum", "register_if_imported"]
