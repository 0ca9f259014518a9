"""nn.Conv1d / Conv2d / Conv3d: per-sample gradients, their norms and weighted sums.

A convolution is a matrix product per output position: with ``A`` the input patches of one example
(``L`` positions x ``D = C_in/groups * prod(kernel)`` values, per group) and ``G`` its output gradient
(``L x P``, ``P = C_out/groups``), the example's weight gradient is ``G^T A`` (``P x D``) and its bias
gradient is ``G`` summed over positions. The forms are ``_convolution.ConvolutionForms``'s, shared with
``conv_transpose``; this file supplies the convolution's own weight backward and Gram form.

Padding: a non-zero ``padding_mode`` (reflect/replicate/circular) and ``padding="same"`` with an even
dilated kernel (asymmetric padding) are applied to the input first, exactly as the layer's forward
does, and the convolution then runs unpadded. Symmetric zero padding is passed through unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from grad_samplers._convolution import (
    ConvolutionForms,
    gram_is_cheaper,
    patch_squared_norms,
    patch_weight_backward,
    patch_weight_grads,
    patches_are_small,
    positions_are_few,
    windowed_gram_squared_norms,
)
from grad_samplers.registry import LayerSampler, register_layer_sampler

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_ConvLayer = nn.Conv1d | nn.Conv2d | nn.Conv3d
_PAD_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def _pad_pairs(layer: _ConvLayer) -> list[tuple[int, int]]:
    """(before, after) padding per spatial axis, as the layer's forward applies it."""
    if isinstance(layer.padding, str):
        if layer.padding == "valid":
            return [(0, 0)] * len(layer.kernel_size)
        pairs = []
        for kernel, dilation in zip(layer.kernel_size, layer.dilation):
            total = dilation * (kernel - 1)
            # Same split as torch: the extra element of an odd total goes after.
            pairs.append((total // 2, total - total // 2))
        return pairs
    return [(pad, pad) for pad in layer.padding]


def _padded_input(layer: _ConvLayer, inputs: torch.Tensor, *, explicit: bool) -> tuple[torch.Tensor, list[int]]:
    """The input and the padding to hand to an unpadded-or-symmetric convolution op.

    With ``explicit=False`` symmetric zero padding stays implicit (no copy of the input); everything
    else (other modes, asymmetric 'same', or ``explicit=True`` for window extraction) is padded here.
    """
    pairs = _pad_pairs(layer)
    symmetric = all(before == after for before, after in pairs)
    if not any(before or after for before, after in pairs):
        return inputs, [0] * len(pairs)
    if layer.padding_mode == "zeros" and symmetric and not explicit:
        return inputs, [before for before, _ in pairs]
    flat = [amount for pair in reversed(pairs) for amount in pair]  # F.pad wants the last axis first
    return F.pad(inputs, flat, mode=_PAD_MODES[layer.padding_mode]), [0] * len(pairs)


def _weight_backward(
    layer: _ConvLayer, inputs: torch.Tensor, grads: torch.Tensor, groups: int, weight_shape: Sequence[int]
) -> torch.Tensor:
    """The weight gradient of ``conv(inputs, W)`` (inputs padded as the layer pads) for output gradient
    ``grads``, with ``groups`` groups (``ConvolutionForms.weight_backward``)."""
    padded, padding = _padded_input(layer, inputs, explicit=False)
    return torch.ops.aten.convolution_backward(
        grads,
        padded,
        grads.new_empty(1).expand(weight_shape),  # the op reads only its shape
        None,
        list(layer.stride),
        padding,
        list(layer.dilation),
        False,
        [0] * len(layer.kernel_size),
        groups,
        (False, True, False),
    )[1]


def _gram_weight_norms(layer: _ConvLayer, inputs: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor | None:
    """The weight's per-example squared norms ``<A A^T, G G^T>`` over the output positions, through the
    patch matrix ``A`` of the padded input; None when materialising costs fewer FLOPs (``gram_is_cheaper``:
    the Gram form wins for few output positions and many channels)."""
    num_positions = math.prod(backprops.shape[2:])
    if not gram_is_cheaper(num_positions, layer.weight[0].numel(), layer.out_channels // layer.groups):
        return None
    padded, _ = _padded_input(layer, inputs, explicit=True)
    return windowed_gram_squared_norms(layer, padded, backprops)


def _patch_weight_grads(layer: _ConvLayer, inputs: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor | None:
    """``(B, *weight.shape)`` per-sample weight gradients ``G^T A`` through the patch matrix of the padded
    input, or None where the grouped backward is expected faster (``patches_are_small``: more output
    positions than output channels per group)."""
    num_positions = math.prod(backprops.shape[2:])
    if not patches_are_small(num_positions, layer.out_channels // layer.groups):
        return None
    padded, _ = _padded_input(layer, inputs, explicit=True)
    return patch_weight_grads(layer, padded, backprops).reshape(backprops.shape[0], *layer.weight.shape)


def _patch_weight_norms(layer: _ConvLayer, inputs: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor | None:
    """``(B,)`` per-example squared weight-gradient norms through the patch matrix where ``_patch_weight_grads``
    applies (``patches_are_small``), without forming its ``(B, *weight.shape)`` layout; else None."""
    num_positions = math.prod(backprops.shape[2:])
    if not patches_are_small(num_positions, layer.out_channels // layer.groups):
        return None
    padded, _ = _padded_input(layer, inputs, explicit=True)
    return patch_squared_norms(layer, padded, backprops)


def _patch_weight_backward(layer: _ConvLayer, inputs: torch.Tensor, grads: torch.Tensor) -> torch.Tensor | None:
    """The summed weight gradient for output gradient ``grads`` as one product over the patches where the
    output has few positions (``positions_are_few``), else None (the backend's weight backward)."""
    if not positions_are_few(math.prod(grads.shape[2:])):
        return None
    padded, _ = _padded_input(layer, inputs, explicit=True)
    return patch_weight_backward(layer, padded, grads).reshape(layer.weight.shape)


_FORMS = ConvolutionForms(
    weight_backward=_weight_backward,
    gram_weight_norms=_gram_weight_norms,
    patch_weight_grads=_patch_weight_grads,
    patch_weight_norms=_patch_weight_norms,
    patch_weight_backward=_patch_weight_backward,
)
_per_sample_weight_grads = _FORMS.per_sample_weight_grads  # (B, *weight.shape); the benchmarks time it


def conv_grad_sample(layer: _ConvLayer, activations, backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-sample gradients of a convolution's weight ``(B, C_out, C_in/groups, *k)`` and bias ``(B, C_out)``.

    Guarantee: ``out[p][i]`` is the gradient of example ``i``'s loss (``backprops[i]``) with respect to
    ``p``, for every stride, dilation, groups, padding (int, 'valid', 'same') and padding_mode.

    ======================  =================================================
    case                    result
    ======================  =================================================
    frozen weight or bias   left out of the result
    bias=False              weight only
    padding_mode != zeros   input padded the same way first (exact)
    unbatched input         ValueError (no example axis)
    ======================  =================================================
    """
    return _FORMS.grad_sample(layer, activations, backprops)


def conv_norm_sample(layer: _ConvLayer, activations, backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example squared L2 norms ``(B,)`` of the weight and bias gradients of a convolution.

    Guarantee: ``out[p][i] == ||conv_grad_sample(...)[p][i]||^2`` up to float rounding. The weight's
    norm takes the Gram form ``<A A^T, G G^T>`` (through the patch matrix ``A``) when that is cheaper in
    FLOPs (``gram_is_cheaper``: few output positions, many channels), otherwise it materialises the
    per-sample gradients of this one layer and reduces them. The bias norm is always direct (``(B, C_out)``).

    ======================  =================================================
    case                    result
    ======================  =================================================
    frozen weight or bias   left out of the result
    zero output gradient    0
    unbatched input         ValueError
    ======================  =================================================
    """
    return _FORMS.norm_sample(layer, activations, backprops)


def conv_weighted_sum(
    layer: _ConvLayer, activations, backprops: torch.Tensor, weights: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``sum_i weights[i] * g_i`` for the weight and bias: one ordinary weight backward with the output
    gradient scaled per example (no per-sample gradient is formed).

    Guarantee: equals ``sum_i weights[i] * conv_grad_sample(...)[p][i]`` up to float rounding.

    ======================  =================================================
    case                    result
    ======================  =================================================
    weights all 0           zeros
    frozen weight or bias   left out of the result
    unbatched input         ValueError
    ======================  =================================================
    """
    return _FORMS.weighted_sum(layer, activations, backprops, weights)


CONV_SAMPLER = register_layer_sampler(
    LayerSampler(grad_sample=conv_grad_sample, norm_sample=conv_norm_sample, weighted_sum=conv_weighted_sum),
    *_CONV_TYPES,
)
