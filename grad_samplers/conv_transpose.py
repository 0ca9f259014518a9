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

import torch
import torch.nn.functional as F
from torch import nn

from grad_samplers.conv import (
    bias_squared_norms,
    check_batched_input,
    common_dtype,
    gram_is_cheaper,
    windowed_gram_squared_norms,
)
from grad_samplers.registry import (
    register_grad_sampler,
    register_norm_sampler,
    register_weighted_sum_sampler,
    scale_per_example,
)

_CONV_TRANSPOSE_TYPES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_ConvTransposeLayer = nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d


def _prepare(layer: _ConvTransposeLayer, activations, backprops: torch.Tensor):
    inputs = activations[0]
    check_batched_input(layer, inputs, len(layer.kernel_size))
    if layer.padding_mode != "zeros":  # torch rejects this in forward already; keep the sampler honest
        raise ValueError(f"{type(layer).__name__} supports only padding_mode='zeros'; got {layer.padding_mode!r}")
    dtype = common_dtype(inputs, backprops)
    return inputs.to(dtype), backprops.to(dtype)


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
    layer: _ConvTransposeLayer, inputs: torch.Tensor, grads: torch.Tensor, groups: int, weight_shape
) -> torch.Tensor:
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


def _per_sample_weight_grads(
    layer: _ConvTransposeLayer, inputs: torch.Tensor, backprops: torch.Tensor
) -> torch.Tensor:
    """``(B, C_in, C_out/groups, *k)`` through one transposed-convolution weight backward with the
    batch folded into the groups (as for ``conv``: backend kernels, no patch matrix, same FLOPs)."""
    batch_size = backprops.shape[0]
    folded_inputs = inputs.reshape(1, -1, *inputs.shape[2:])
    folded_grads = backprops.reshape(1, -1, *backprops.shape[2:])
    weight_shape = (batch_size * layer.weight.shape[0], *layer.weight.shape[1:])
    grads = _weight_backward(layer, folded_inputs, folded_grads, batch_size * layer.groups, weight_shape)
    return grads.reshape(batch_size, *layer.weight.shape)


@register_grad_sampler(*_CONV_TRANSPOSE_TYPES)
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
    unbatched input         ValueError (no example axis)
    ======================  =================================================
    """
    inputs, backprops = _prepare(layer, activations, backprops)
    per_sample: dict[nn.Parameter, torch.Tensor] = {}
    if layer.weight.requires_grad:
        per_sample[layer.weight] = _per_sample_weight_grads(layer, inputs, backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        per_sample[layer.bias] = backprops.flatten(2).sum(dim=2)
    return per_sample


@register_norm_sampler(*_CONV_TRANSPOSE_TYPES)
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
    inputs, backprops = _prepare(layer, activations, backprops)
    norms: dict[nn.Parameter, torch.Tensor] = {}
    if layer.weight.requires_grad:
        groups = layer.groups
        num_positions = math.prod(inputs.shape[2:])
        patch_size = layer.weight[0].numel()  # C_out/groups * prod(k)
        inputs_per_group = layer.in_channels // groups
        if gram_is_cheaper(num_positions, patch_size, inputs_per_group):
            pad = [amount for pad in reversed(layer.padding) for amount in (pad, pad)]
            padded = F.pad(backprops, pad) if any(pad) else backprops
            norms[layer.weight] = windowed_gram_squared_norms(layer, padded, inputs)
        else:
            # Squared in place: the per-sample gradients are a fresh temporary (a second one would double the peak).
            norms[layer.weight] = _per_sample_weight_grads(layer, inputs, backprops).flatten(1).square_().sum(dim=1)
    if layer.bias is not None and layer.bias.requires_grad:
        norms[layer.bias] = bias_squared_norms(backprops)
    return norms


@register_weighted_sum_sampler(*_CONV_TRANSPOSE_TYPES)
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
    inputs, backprops = _prepare(layer, activations, backprops)
    scaled = scale_per_example(backprops, weights)
    sums: dict[nn.Parameter, torch.Tensor] = {}
    if layer.weight.requires_grad:
        sums[layer.weight] = _weight_backward(layer, inputs, scaled, layer.groups, layer.weight.shape)
    if layer.bias is not None and layer.bias.requires_grad:
        sums[layer.bias] = scaled.transpose(0, 1).flatten(1).sum(dim=1)
    return sums
