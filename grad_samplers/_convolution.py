"""What ``conv`` and ``conv_transpose`` share: the three sampler forms of a (transposed) convolution, built
on the few operations in which the two differ (``ConvolutionForms``), and the Gram-form helpers.

A convolution is a matrix product per output position: with ``A`` the input patches of one example
(``L`` positions x ``D = C_in/groups * prod(kernel)`` values, per group) and ``G`` its output gradient
(``L x P``, ``P = C_out/groups``), the example's weight gradient is ``G^T A`` (``P x D``) and its bias
gradient is ``G`` summed over positions. A transposed convolution is the same with the roles of input
and output gradient swapped (see ``conv_transpose``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from grad_samplers._common import (
    batch_error,
    common_dtype,
    keyed_by_parameter,
    scale_per_example,
    trainable_weight_and_bias,
)

Tensors = tuple[torch.Tensor, torch.Tensor]


def check_batched_input(layer: nn.Module, inputs: torch.Tensor, spatial_dims: int) -> None:
    """Raise if ``inputs`` is not ``(batch, channels, *spatial)``: an unbatched call has no example axis."""
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != spatial_dims + 2:
        raise batch_error(type(layer).__name__, f"of shape (batch, channels, {spatial_dims} spatial dims)", inputs)


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


def patch_matrices(layer: nn.Module, windowed: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
    """``(B, groups, L, C/groups * prod(K))`` contiguous patch matrices of ``windowed`` (already padded) for
    ``layer``'s kernel, stride and dilation, the first ``positions`` output positions per axis."""
    windows = sliding_windows(windowed, layer.kernel_size, layer.stride, layer.dilation, positions)
    return grouped_patches(windows, layer.groups, len(layer.kernel_size))


def unfold_is_faster(layer: nn.Module, positions: Sequence[int]) -> bool:
    """Whether the Gram form is faster on ``patch_columns`` (``F.unfold``, read transposed) than on
    ``patch_matrices`` (a strided copy): 2-D kernels of more than one tap at 16 or more output positions.

    Measured (CPU, 1 thread, batch 32, thread CPU time, the Gram norms of resnet18's layers): 3x3 kernels at
    16 and 64 positions 1.4-1.6x faster (64 positions, 128 channels: 8.5 vs 13.3 ms); at 1 and 4 positions,
    and 1x1 kernels at any, the strided copy is as fast or faster.
    """
    return len(layer.kernel_size) == 2 and math.prod(layer.kernel_size) > 1 and math.prod(positions) >= 16


def patch_columns(layer: nn.Module, windowed: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
    """``(B, groups, C/groups * prod(K), L)``: ``patch_matrices`` transposed (one column per output position).

    Two spatial dims go through ``F.unfold`` (the backend's im2col), which lays the columns out this way:
    1.5-2x faster than ``patch_matrices`` on resnet18's 3x3 layers of 4x4 to 16x16 outputs (CPU), slower on
    1x1 kernels and single positions. Other dims: ``patch_matrices`` transposed (a view).
    """
    if len(layer.kernel_size) != 2 or windowed.dim() != 4:
        return patch_matrices(layer, windowed, positions).transpose(-1, -2)
    batch_size, channels = windowed.shape[:2]
    columns = F.unfold(windowed, layer.kernel_size, dilation=layer.dilation, stride=layer.stride)
    available = [
        (size - dilation * (kernel - 1) - 1) // stride + 1
        for size, kernel, stride, dilation in zip(windowed.shape[2:], layer.kernel_size, layer.stride, layer.dilation)
    ]
    if list(available) != list(positions):
        # Cut off the positions past ``positions`` (a transposed convolution's adjoint can have one more).
        columns = columns.view(batch_size, -1, *available)[:, :, : positions[0], : positions[1]]
    groups = layer.groups
    return columns.reshape(batch_size, groups, channels // groups * math.prod(layer.kernel_size), -1)


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


def patches_are_small(num_positions: int, outputs_per_group: int) -> bool:
    """Whether per-sample weight gradients are cheaper as ``G^T A`` through the patch matrix ``A`` than as
    one convolution backward with the batch folded into the groups.

    The patch matrix holds ``L*D`` values per example and group, the gradients it yields ``P*D``: when
    ``L <= P`` building it costs at most the memory of the result it produces. The grouped backward
    runs ``B*groups`` small convolutions whose cost per output value grows as ``L`` shrinks. Measured
    (``benchmarks/bench_resnet18.py --layers``, CPU, 1 thread, resnet18 at 64x64, batch 32, loaded machine):
    with ``L <= P`` the patch form is 2-3.5x faster at 4 and 16 positions (256-512 outputs, the layers that
    dominate) and even with the grouped backward at 64 positions (128 outputs); with ``L > P`` the grouped
    backward is 2.8x faster at 256 positions (64 outputs) and even at 1024 (the stem), where the patch
    matrix would be 4-16 times the result. Both forms are exact to float rounding.
    """
    return num_positions <= outputs_per_group


def positions_are_few(num_positions: int) -> bool:
    """Whether a convolution's weight gradient (one batch, summed) is faster as one matrix product over
    every example's patches (``patch_weight_backward``) than through the backend's convolution backward:
    for a single output position.

    The backend's weight backward is slow where the output has one position and most kernel taps fall on
    padding: resnet18's last stage at 32x32 input (3x3 kernels, 512 outputs, batch 32, CPU, 1 thread,
    thread CPU time in a training step) took 25 ms for its five layers that way and 11 ms as products.
    At 4 positions the two were even (11-12 ms for the stage before), at 16 and 64 positions the backend
    is 1.6-2.5x faster than the product (measured on the layers alone).
    """
    return num_positions <= 1


def patch_weight_grads(layer: nn.Module, windowed: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``(B, groups * P, D)`` per-sample weight gradients ``G_b^T A_b`` of a (transposed) convolution: the
    kernel windows of ``windowed`` (already padded) against ``other`` ``(B, groups * P, *positions)``, one
    window per position of ``other``, as one batched matrix product (the roles as in
    ``windowed_gram_squared_norms``). Rows follow ``other``'s channels, columns ``(channel, *taps)``."""
    batch_size, groups = other.shape[0], layer.groups
    positions = other.shape[2:]
    patches = patch_matrices(layer, windowed, positions)
    grads = other.reshape(batch_size, groups, other.shape[1] // groups, math.prod(positions))
    return torch.matmul(grads, patches).reshape(batch_size, other.shape[1], -1)


def patch_squared_norms(layer: nn.Module, windowed: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``(B,)`` squared Frobenius norms of the per-sample weight gradients ``patch_weight_grads`` gives, summed
    over groups, formed as ``A_b^T G_b`` (``(C/groups * prod(K)) x P`` per example and group): the patch
    columns are used as the backend lays them out, so no transposed copy of them is made."""
    batch_size, groups = other.shape[0], layer.groups
    positions = other.shape[2:]
    columns = patch_columns(layer, windowed, positions)
    grads = other.reshape(batch_size, groups, other.shape[1] // groups, math.prod(positions)).transpose(-1, -2)
    return torch.matmul(columns, grads).flatten(1).square_().sum(dim=1)


def patch_weight_backward(layer: nn.Module, windowed: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``(groups * P, C/groups * prod(K))``: the weight gradient ``sum_b G_b^T A_b`` of a convolution of
    ``windowed`` (already padded) whose output gradient is ``other`` ``(B, groups * P, *positions)``, as one
    matrix product per group over the positions of every example (see ``positions_are_few``)."""
    batch_size, groups = other.shape[0], layer.groups
    positions = other.shape[2:]
    num_positions = math.prod(positions)
    patches = patch_matrices(layer, windowed, positions)  # (B, g, L, D)
    rows = patches.transpose(0, 1).reshape(groups, batch_size * num_positions, patches.shape[3])
    grads = other.reshape(batch_size, groups, other.shape[1] // groups, num_positions)
    grads = grads.permute(1, 2, 0, 3).reshape(groups, other.shape[1] // groups, batch_size * num_positions)
    return torch.matmul(grads, rows).reshape(other.shape[1], -1)


def gram_squared_norms(patches: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``||grads_b^T patches_b||_F^2`` summed over groups, for ``patches (B, g, L, D)``, ``grads (B, g, L, P)``,
    via ``<patches patches^T, grads grads^T>`` (no ``P x D`` matrix per example)."""
    patch_gram = torch.matmul(patches, patches.transpose(-1, -2))
    grad_gram = torch.matmul(grads, grads.transpose(-1, -2))
    return (patch_gram * grad_gram).sum(dim=(1, 2, 3))


def windowed_gram_squared_norms(layer: nn.Module, windowed: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per-example squared norms of a (transposed) convolution's weight gradient in the Gram form:
    the kernel windows of ``windowed`` (already padded) against ``other`` ``(B, C, *positions)``, one
    window per position of ``other``. A convolution windows its input against the output gradient; a
    transposed convolution windows the output gradient against its input (the same maths, roles swapped).
    """
    batch_size, groups = other.shape[0], layer.groups
    positions = other.shape[2:]
    if unfold_is_faster(layer, positions):
        patches = patch_columns(layer, windowed, positions).transpose(-1, -2)  # a view: the product reads it
    else:
        patches = patch_matrices(layer, windowed, positions)
    grads = other.reshape(batch_size, groups, other.shape[1] // groups, math.prod(positions)).transpose(-1, -2)
    return gram_squared_norms(patches, grads)


def bias_squared_norms(backprops: torch.Tensor) -> torch.Tensor:
    """Per-example squared norms of a convolution's bias gradient (the output gradient summed over positions)."""
    return backprops.flatten(2).sum(dim=2).pow(2).sum(dim=1)


def _no_check(layer: nn.Module) -> None:
    """The default ``ConvolutionForms.check_layer``: every configuration of the layer is supported."""


def _no_patch_form(layer: nn.Module, inputs: torch.Tensor, backprops: torch.Tensor) -> None:
    """The default ``ConvolutionForms.patch_weight_grads``: always the grouped backward."""


@dataclass(frozen=True, kw_only=True)
class ConvolutionForms:
    """The operations in which a convolution and a transposed convolution differ; the sampler forms
    (``grad_sample``, ``norm_sample``, ``weighted_sum``) are built on them the same way for both.

    - ``weight_backward(layer, inputs, output_grads, groups, weight_shape)``: the weight gradient of one
      call of the layer's operation on these (padded as the layer pads) with ``groups`` groups; with the
      batch folded into the channels and ``groups = B * layer.groups`` it yields every example's gradient.
    - ``gram_weight_norms(layer, inputs, backprops)``: per-example squared weight-gradient norms in the
      Gram form, or None where materialising is cheaper (``gram_is_cheaper``).
    - ``check_layer(layer)``: raise for a configuration the forms do not support.
    - ``patch_weight_grads(layer, inputs, backprops)``: the per-sample weight gradients ``(B, *weight.shape)``
      through the patch matrix where that is cheaper (``patches_are_small``), else None (the grouped
      backward is used).
    - ``patch_weight_norms(layer, inputs, backprops)``: the per-example squared weight-gradient norms
      through the patch matrix where ``patch_weight_grads`` applies (without its copy), else None.
    - ``patch_weight_backward(layer, inputs, output_grads)``: the summed weight gradient as one matrix
      product over the patches where that is faster (``positions_are_few``), else None (``weight_backward``).
    """

    weight_backward: Callable[[nn.Module, torch.Tensor, torch.Tensor, int, Sequence[int]], torch.Tensor]
    gram_weight_norms: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor | None]
    check_layer: Callable[[nn.Module], None] = _no_check
    patch_weight_grads: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor | None] = _no_patch_form
    patch_weight_norms: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor | None] = _no_patch_form
    patch_weight_backward: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor | None] = _no_patch_form

    def prepare(self, layer: nn.Module, activations, backprops: torch.Tensor) -> Tensors:
        """The checked batched input and the output gradient, in their common dtype."""
        inputs = activations[0]
        check_batched_input(layer, inputs, len(layer.kernel_size))
        self.check_layer(layer)
        dtype = common_dtype(inputs, backprops)
        return inputs.to(dtype), backprops.to(dtype)

    def per_sample_weight_grads(self, layer: nn.Module, inputs: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
        """``(B, *weight.shape)``: through the patch matrix where it is no larger than the result
        (``patch_weight_grads``), otherwise one weight backward with the batch folded into the groups.

        Folded, examples become groups (``B*groups`` of them), so each example's weight gradient comes out
        as its own block of a ``(B*weight.shape[0], *weight.shape[1:])`` result. This runs on the backend's
        convolution kernels and never builds the ``prod(k)``-times larger patch matrix that unfold +
        matmul needs; the FLOPs are the same, but the backend runs ``B*groups`` small products, slow when
        there are few output positions (the deep layers of a CNN), where the patch form is used instead.
        """
        by_patches = self.patch_weight_grads(layer, inputs, backprops)
        if by_patches is not None:
            return by_patches
        batch_size = backprops.shape[0]
        folded_inputs = inputs.reshape(1, -1, *inputs.shape[2:])
        folded_grads = backprops.reshape(1, -1, *backprops.shape[2:])
        weight_shape = (batch_size * layer.weight.shape[0], *layer.weight.shape[1:])
        grads = self.weight_backward(layer, folded_inputs, folded_grads, batch_size * layer.groups, weight_shape)
        return grads.reshape(batch_size, *layer.weight.shape)

    def grad_sample(self, layer: nn.Module, activations, backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        """Exact per-sample weight and bias gradients (trainable ones only)."""
        inputs, backprops = self.prepare(layer, activations, backprops)
        weight, bias = trainable_weight_and_bias(layer)
        weight_grads = None if weight is None else self.per_sample_weight_grads(layer, inputs, backprops)
        bias_grads = None if bias is None else backprops.flatten(2).sum(dim=2)
        return keyed_by_parameter(((weight, weight_grads), (bias, bias_grads)))

    def norm_sample(self, layer: nn.Module, activations, backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        """Per-example squared weight and bias gradient norms: the weight's in the Gram form where that is
        cheaper, otherwise from this layer's per-sample gradients (formed and reduced: through the patches
        where ``patch_weight_norms`` applies); the bias's direct."""
        inputs, backprops = self.prepare(layer, activations, backprops)
        weight, bias = trainable_weight_and_bias(layer)
        weight_norms = bias_norms = None
        if weight is not None:
            weight_norms = self.gram_weight_norms(layer, inputs, backprops)
            if weight_norms is None:
                weight_norms = self.patch_weight_norms(layer, inputs, backprops)
            if weight_norms is None:
                # Squared in place: the per-sample gradients are a fresh temporary (a second one would
                # double the peak).
                weight_norms = self.per_sample_weight_grads(layer, inputs, backprops).flatten(1).square_().sum(dim=1)
        if bias is not None:
            bias_norms = bias_squared_norms(backprops)
        return keyed_by_parameter(((weight, weight_norms), (bias, bias_norms)))

    def weighted_sum(
        self, layer: nn.Module, activations, backprops: torch.Tensor, weights: torch.Tensor
    ) -> dict[nn.Parameter, torch.Tensor]:
        """``sum_i weights[i] * g_i``: one weight backward with the output gradient scaled per example (no
        per-sample gradient is formed): one product over the patches where ``patch_weight_backward``
        applies, the backend's otherwise."""
        inputs, backprops = self.prepare(layer, activations, backprops)
        weight, bias = trainable_weight_and_bias(layer)
        scaled = scale_per_example(backprops, weights)
        weight_sum = bias_sum = None
        if weight is not None:
            weight_sum = self.patch_weight_backward(layer, inputs, scaled)
            if weight_sum is None:
                weight_sum = self.weight_backward(layer, inputs, scaled, layer.groups, layer.weight.shape)
        if bias is not None:
            bias_sum = scaled.transpose(0, 1).flatten(1).sum(dim=1)
        return keyed_by_parameter(((weight, weight_sum), (bias, bias_sum)))


__all__ = [
    "ConvolutionForms",
    "bias_squared_norms",
    "check_batched_input",
    "gram_is_cheaper",
    "gram_squared_norms",
    "grouped_patches",
    "patch_columns",
    "patch_matrices",
    "patch_squared_norms",
    "patch_weight_backward",
    "patch_weight_grads",
    "patches_are_small",
    "positions_are_few",
    "sliding_windows",
    "unfold_is_faster",
    "windowed_gram_squared_norms",
]
