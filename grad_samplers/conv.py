"""nn.Conv1d / Conv2d / Conv3d: per-sample gradients, their norms and weighted sums.

A convolution is a matrix product per output position: with ``A`` the input patches of one example
(``L`` positions x ``D = C_in/groups * prod(kernel)`` values, per group) and ``G`` its output gradient
(``L x P``, ``P = C_out/groups``), the example's weight gradient is ``G^T A`` (``P x D``) and its bias
gradient is ``G`` summed over positions.

Padding: a non-zero ``padding_mode`` (reflect/replicate/circular) and ``padding="same"`` with an even
dilated kernel (asymmetric padding) are applied to the input first, exactly as the layer's forward
does, and the convolution then runs unpadded. Symmetric zero padding is passed through unchanged.

The helpers ``sliding_windows`` and ``gram_is_cheaper`` are shared with ``conv_transpose``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from grad_samplers.registry import (
    register_grad_sampler,
    register_norm_sampler,
    register_weighted_sum_sampler,
    scale_per_example,
)

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_ConvLayer = nn.Conv1d | nn.Conv2d | nn.Conv3d
_PAD_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


# ---------------------------------------------------------------------------------------- shared helpers
def check_batched_input(layer: nn.Module, inputs: torch.Tensor, spatial_dims: int) -> None:
    """Raise if ``inputs`` is not ``(batch, channels, *spatial)``: an unbatched call has no example axis."""
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != spatial_dims + 2:
        shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        raise ValueError(
            f"{type(layer).__name__} per-sample gradients need a batched input of shape (batch, channels, "
            f"{spatial_dims} spatial dims); got input of shape {shape}. Add the batch dimension "
            f"(input.unsqueeze(0) for a single example)."
        )


def common_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype both inputs and output gradient are computed in (they differ under autocast)."""
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def sliding_windows(
    padded: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    num_positions: Sequence[int],
) -> torch.Tensor:
    """``(B, C, *S)`` (already padded) -> ``(B, C, *num_positions, *kernel_size)``: the value under each
    kernel tap at each output position. A strided view, no copy; positions past ``num_positions`` are
    cut off (a transposed convolution's adjoint can have one more than it uses)."""
    windows = padded
    spatial_dims = len(kernel_size)
    for axis in range(spatial_dims):
        span = dilation[axis] * (kernel_size[axis] - 1) + 1
        # Each unfold appends its window axis at the end, so the spatial axes keep positions 2..2+n-1.
        windows = windows.unfold(2 + axis, span, stride[axis])
    taps = tuple(slice(None, None, step) for step in dilation)
    positions = tuple(slice(0, count) for count in num_positions)
    return windows[(slice(None), slice(None), *positions, *taps)]


def grouped_patches(windows: torch.Tensor, groups: int, spatial_dims: int) -> torch.Tensor:
    """``(B, C, *O, *K)`` windows -> ``(B, groups, L, C/groups * prod(K))`` patch matrices (one copy)."""
    batch_size, channels = windows.shape[:2]
    positions = windows.shape[2 : 2 + spatial_dims]
    kernel = windows.shape[2 + spatial_dims :]
    grouped = windows.reshape(batch_size, groups, channels // groups, *positions, *kernel)
    # (B, g, c, *O, *K) -> (B, g, *O, c, *K): positions become rows, (channel, taps) the columns.
    order = [0, 1, *range(3, 3 + spatial_dims), 2, *range(3 + spatial_dims, 3 + 2 * spatial_dims)]
    return grouped.permute(order).reshape(batch_size, groups, -1, (channels // groups) * kernel.numel())


def gram_is_cheaper(num_positions: int, patch_size: int, outputs_per_group: int) -> bool:
    """Whether the Gram form of the per-example squared norm beats materialising ``G^T A``.

    Per example and group, materialising costs ``L*D*P`` multiply-adds and ``D*P`` memory; the Gram
    form ``<A A^T, G G^T>`` costs ``L^2*(D+P)`` multiply-adds and ``L^2`` memory. So the Gram form wins
    on FLOPs exactly when ``L*(D+P) < D*P``; then ``L < D*P/(D+P) <= sqrt(D*P)/2``, so ``L^2 < D*P/4``
    and it also wins on memory (and its patch matrix, ``L*D``, is smaller than ``D*P`` since ``L < P``).
    Long sequences / large images with few channels go the materialising way.

    Measured (``benchmarks/bench_norm_forms.py``, CPU): the FLOP rule picks the faster form except near
    the boundary, where the two are within measurement noise of each other or the materialising form is
    up to 40% faster (the benchmark CNN's second convolution: 25 positions, D=256, P=32). There the
    materialising form needs the batch's per-sample gradients (and the convolution's work buffers) at
    once, which raised that CNN's peak step memory from 1.04x to 1.84x a non-private step, so the FLOP
    rule stays.
    """
    return num_positions * (patch_size + outputs_per_group) < patch_size * outputs_per_group


def gram_squared_norms(patches: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``||grads_b^T patches_b||_F^2`` summed over groups, for ``patches (B, g, L, D)``, ``grads (B, g, L, P)``,
    via ``<patches patches^T, grads grads^T>`` (no ``P x D`` matrix per example)."""
    patch_gram = torch.matmul(patches, patches.transpose(-1, -2))
    grad_gram = torch.matmul(grads, grads.transpose(-1, -2))
    return (patch_gram * grad_gram).sum(dim=(1, 2, 3))


# ---------------------------------------------------------------------------------------- conv specifics
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


def _prepare(layer: _ConvLayer, activations, backprops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = activations[0]
    spatial_dims = len(layer.kernel_size)
    check_batched_input(layer, inputs, spatial_dims)
    dtype = common_dtype(inputs, backprops)
    return inputs.to(dtype), backprops.to(dtype)


def _per_sample_weight_grads(layer: _ConvLayer, inputs: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """``(B, *weight.shape)``: one convolution-weight backward with the batch folded into the groups.

    Examples become groups (``B*groups`` of them), so each example's weight gradient comes out as its
    own block of a ``(B*C_out, C_in/groups, *k)`` result. This runs on the backend's convolution
    kernels and never builds the ``prod(k)``-times larger patch matrix that unfold + matmul needs;
    the FLOPs are the same.
    """
    batch_size = backprops.shape[0]
    padded, padding = _padded_input(layer, inputs, explicit=False)
    folded_inputs = padded.reshape(1, -1, *padded.shape[2:])
    folded_grads = backprops.reshape(1, -1, *backprops.shape[2:])
    weight_shape = (batch_size * layer.weight.shape[0], *layer.weight.shape[1:])
    shape_only = folded_grads.new_empty(1).expand(weight_shape)  # the op reads only its shape
    spatial_dims = len(layer.kernel_size)
    grads = torch.ops.aten.convolution_backward(
        folded_grads,
        folded_inputs,
        shape_only,
        None,
        list(layer.stride),
        padding,
        list(layer.dilation),
        False,
        [0] * spatial_dims,
        batch_size * layer.groups,
        (False, True, False),
    )[1]
    return grads.reshape(batch_size, *layer.weight.shape)


@register_grad_sampler(*_CONV_TYPES)
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
    inputs, backprops = _prepare(layer, activations, backprops)
    per_sample: dict[nn.Parameter, torch.Tensor] = {}
    if layer.weight.requires_grad:
        per_sample[layer.weight] = _per_sample_weight_grads(layer, inputs, backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        per_sample[layer.bias] = backprops.flatten(2).sum(dim=2)
    return per_sample


@register_norm_sampler(*_CONV_TYPES)
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
    inputs, backprops = _prepare(layer, activations, backprops)
    norms: dict[nn.Parameter, torch.Tensor] = {}
    if layer.weight.requires_grad:
        groups = layer.groups
        num_positions = math.prod(backprops.shape[2:])
        patch_size = layer.weight[0].numel()
        outputs_per_group = layer.out_channels // groups
        if gram_is_cheaper(num_positions, patch_size, outputs_per_group):
            padded, _ = _padded_input(layer, inputs, explicit=True)
            norms[layer.weight] = windowed_gram_squared_norms(layer, padded, backprops)
        else:
            # Squared in place: the per-sample gradients are a fresh temporary (a second one would double the peak).
            norms[layer.weight] = _per_sample_weight_grads(layer, inputs, backprops).flatten(1).square_().sum(dim=1)
    if layer.bias is not None and layer.bias.requires_grad:
        norms[layer.bias] = bias_squared_norms(backprops)
    return norms


def windowed_gram_squared_norms(layer: nn.Module, windowed: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per-example squared norms of a (transposed) convolution's weight gradient in the Gram form:
    the kernel windows of ``windowed`` (already padded) against ``other`` ``(B, C, *positions)``, one
    window per position of ``other``. A convolution windows its input against the output gradient; a
    transposed convolution windows the output gradient against its input (the same maths, roles swapped).
    """
    batch_size, groups = other.shape[0], layer.groups
    positions = other.shape[2:]
    windows = sliding_windows(windowed, layer.kernel_size, layer.stride, layer.dilation, positions)
    patches = grouped_patches(windows, groups, len(layer.kernel_size))
    grads = other.reshape(batch_size, groups, other.shape[1] // groups, math.prod(positions)).transpose(-1, -2)
    return gram_squared_norms(patches, grads)


def bias_squared_norms(backprops: torch.Tensor) -> torch.Tensor:
    """Per-example squared norms of a convolution's bias gradient (the output gradient summed over positions)."""
    return backprops.flatten(2).sum(dim=2).pow(2).sum(dim=1)


@register_weighted_sum_sampler(*_CONV_TYPES)
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
    inputs, backprops = _prepare(layer, activations, backprops)
    scaled = scale_per_example(backprops, weights)
    sums: dict[nn.Parameter, torch.Tensor] = {}
    if layer.weight.requires_grad:
        padded, padding = _padded_input(layer, inputs, explicit=False)
        spatial_dims = len(layer.kernel_size)
        sums[layer.weight] = torch.ops.aten.convolution_backward(
            scaled,
            padded,
            scaled.new_empty(1).expand(layer.weight.shape),
            None,
            list(layer.stride),
            padding,
            list(layer.dilation),
            False,
            [0] * spatial_dims,
            layer.groups,
            (False, True, False),
        )[1]
    if layer.bias is not None and layer.bias.requires_grad:
        sums[layer.bias] = scaled.transpose(0, 1).flatten(1).sum(dim=1)
    return sums
