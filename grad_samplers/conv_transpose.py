"""nn.ConvTranspose1d / 2d / 3d: per-sample gradients, their norms and weighted sums.

A transposed convolution is the adjoint of the convolution with the same weight, stride, padding,
dilation and groups: ``<conv_transpose(x, W), G> = <x, conv(G, W)>``. So its weight gradient is the
weight gradient of that ordinary convolution with the roles swapped: the output gradient ``G`` plays
the input (its patches ``A``, ``L = input positions`` rows) and the layer's input ``x`` plays the
output gradient. ``output_padding`` (or ``output_size`` passed to forward) only appends output
positions that the adjoint reads through padding, so it is read off the actual shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from grad_samplers._convolution import ConvolutionForms, gram_is_cheaper, windowed_gram_squared_norms
from grad_samplers.registry import LayerSampler, register_layer_sampler

_CONV_TRANSPOSE_TYPES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_ConvTransposeLayer = nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d


def _check_padding_mode(layer: _ConvTransposeLayer) -> None:
    if layer.padding_mode != "zeros":  # torch rejects this in forward already; keep the sampler honest
        raise ValueError(f"{type(layer).__name__} supports only padding_mode='zeros'; got {layer.padding_mode!r}")


def _effective_output_padding(layer: _ConvTransposeLayer, inputs: torch.Tensor, backprops: torch.Tensor) -> list[int]:
    """The output padding the forward really used (``output_size`` in forward overrides the attribute)."""
    padding = []
    for axis, (stride, pad, dilation, kernel) in enumerate(
        zip(layer.stride, layer.padding, layer.dilation, layer.kernel_size)
    ):
        unpadded = (inputs.shape[2 + axis] - 1) * stride - 2 * pad + dilation * (kernel - 1) + 1
        padding.append(backprops.shape[2 + axis] - unpadded)
    return padding


def _weight_backward(
    layer: _ConvTransposeLayer, inputs: torch.Tensor, grads: torch.Tensor, groups: int, weight_shape: Sequence[int]
) -> torch.Tensor:
    """The weight gradient of ``conv_transpose(inputs, W)`` for output gradient ``grads``, with ``groups``
    groups (``ConvolutionForms.weight_backward``)."""
    return torch.ops.aten.convolution_backward(
        grads,
        inputs,
        grads.new_empty(1).expand(weight_shape),  # the op reads only its shape
        None,
        list(layer.stride),
        list(layer.padding),
        list(layer.dilation),
        True,
        _effective_output_padding(layer, inputs, grads),
        groups,
        (False, True, False),
    )[1]


def _gram_weight_norms(
    layer: _ConvTransposeLayer, inputs: torch.Tensor, backprops: torch.Tensor
) -> torch.Tensor | None:
    """The weight's per-example squared norms ``<A A^T, X X^T>`` over the ``L`` input positions, with ``A``
    the patches of the (padded) output gradient and ``X`` the input; None when
    ``gram_is_cheaper(L, C_out/groups*prod(k), C_in/groups)`` says materialising costs fewer FLOPs."""
    num_positions = math.prod(inputs.shape[2:])
    if not gram_is_cheaper(num_positions, layer.weight[0].numel(), layer.in_channels // layer.groups):
        return None
    pad = [amount for pad in reversed(layer.padding) for amount in (pad, pad)]
    padded = F.pad(backprops, pad) if any(pad) else backprops
    return windowed_gram_squared_norms(layer, padded, inputs)


_FORMS = ConvolutionForms(
    weight_backward=_weight_backward, gram_weight_norms=_gram_weight_norms, check_layer=_check_padding_mode
)


def conv_transpose_grad_sample(
    layer: _ConvTransposeLayer, activations, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-sample gradients of a transposed convolution's weight ``(B, C_in, C_out/groups, *k)``
    and bias ``(B, C_out)``.

    Guarantee: ``out[p][i]`` is the gradient of example ``i``'s loss with respect to ``p``, for every
    stride, padding, output_padding (or forward ``output_size``), dilation and groups.

    ======================  =================================================
    case                    result
    ======================  =================================================
    frozen weight or bias   left out of the result
    bias=False              weight only
    padding_mode != zeros   ValueError (torch's forward rejects it too)
    unbatched input         ValueError (no example axis)
    ======================  =================================================
    """
    return _FORMS.grad_sample(layer, activations, backprops)


def conv_transpose_norm_sample(
    layer: _ConvTransposeLayer, activations, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example squared L2 norms ``(B,)`` of a transposed convolution's weight and bias gradients.

    Guarantee: ``out[p][i] == ||conv_transpose_grad_sample(...)[p][i]||^2`` up to float rounding. The
    weight takes the Gram form ``<A A^T, X X^T>`` with ``A`` the patches of the output gradient and ``X``
    the input, over the ``L`` input positions, when ``gram_is_cheaper(L, C_out/groups*prod(k),
    C_in/groups)``; otherwise this layer's per-sample gradients are materialised and reduced.

    ======================  =================================================
    case                    result
    ======================  =================================================
    frozen weight or bias   left out of the result
    zero output gradient    0
    unbatched input         ValueError
    ======================  =================================================
    """
    return _FORMS.norm_sample(layer, activations, backprops)


def conv_transpose_weighted_sum(
    layer: _ConvTransposeLayer, activations, backprops: torch.Tensor, weights: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``sum_i weights[i] * g_i``: one ordinary transposed-convolution weight backward with the output
    gradient scaled per example.

    Guarantee: equals ``sum_i weights[i] * conv_transpose_grad_sample(...)[p][i]`` up to float rounding.

    ======================  =================================================
    case                    result
    ======================  =================================================
    weights all 0           zeros
    frozen weight or bias   left out of the result
    unbatched input         ValueError
    ======================  =================================================
    """
    return _FORMS.weighted_sum(layer, activations, backprops, weights)


CONV_TRANSPOSE_SAMPLER = register_layer_sampler(
    LayerSampler(
        grad_sample=conv_transpose_grad_sample,
        norm_sample=conv_transpose_norm_sample,
        weighted_sum=conv_transpose_weighted_sum,
    ),
    *_CONV_TRANSPOSE_TYPES,
)
