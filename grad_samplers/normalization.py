"""Normalisation layers with per-example statistics: LayerNorm, GroupNorm, InstanceNorm1d/2d/3d, RMSNorm.

Each computes ``y = x_hat * weight (+ bias)`` with ``x_hat`` normalised from one example's own values,
so an example's gradients are ``sum(G * x_hat)`` and ``sum(G)`` over every axis the affine parameters
are broadcast along. ``x_hat`` is recomputed from the saved input with the layer's own functional
(same statistics, same eps).

Norms: a per-sample gradient here has the size of one feature/channel vector, no more than one
position of the output gradient, so no cheaper form exists: the per-sample gradients of the layer are
formed and reduced (a Gram form would cost ``T^2`` per example instead of ``T * C``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.instancenorm import _InstanceNorm

from grad_samplers._common import common_dtype, scale_per_example, trainable_weight_and_bias
from grad_samplers.registry import LayerSampler, register_layer_sampler

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.RMSNorm)
_NormLayer = nn.LayerNorm | nn.GroupNorm | _InstanceNorm | nn.RMSNorm


# Ones and zeros of a LayerNorm's normalized shape, per (shape, dtype): see _identity_affine.
_IDENTITY_AFFINE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_IDENTITY_AFFINE_LIMIT = 64


def _identity_affine(shape: tuple, inputs: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(ones, zeros)`` of ``shape`` to pass as a LayerNorm's weight and bias when computing ``x_hat`` on CPU in
    float32/float64, else ``(None, None)``.

    torch's CPU kernel takes a scalar loop when the weight or the bias is absent and a vectorised one when both
    are given, computing ``(x - mean) * rstd * gamma + beta`` either way: with ``gamma = 1`` and ``beta = 0`` every
    element is the same float (``t * 1 + 0 == t`` exactly, fused or not, and ``-0.0 + 0`` is ``+0.0`` in both), at
    about half the time. ``tests/test_ghost_hf_decoder_forms.py`` checks the equality bit for bit. Other devices and
    dtypes keep the absent parameters. The cached tensors are constants, never handed to the caller's model."""
    if inputs.device.type != "cpu" or inputs.dtype not in (torch.float32, torch.float64):
        return None, None
    key = (tuple(shape), inputs.dtype)
    cached = _IDENTITY_AFFINE.get(key)
    if cached is None:
        if len(_IDENTITY_AFFINE) >= _IDENTITY_AFFINE_LIMIT:
            _IDENTITY_AFFINE.clear()
        cached = _IDENTITY_AFFINE[key] = (torch.ones(shape, dtype=inputs.dtype), torch.zeros(shape, dtype=inputs.dtype))
    return cached


def _normalized_input(layer: _NormLayer, inputs: torch.Tensor) -> torch.Tensor:
    """``x_hat``: the layer's output before its affine parameters, for a batched input."""
    if isinstance(layer, (nn.LayerNorm, nn.RMSNorm)):
        if inputs.dim() <= len(layer.normalized_shape):
            raise ValueError(
                f"{type(layer).__name__} per-sample gradients need a batch dimension in front of the normalized "
                f"shape {tuple(layer.normalized_shape)}; got input of shape {tuple(inputs.shape)}"
            )
        if isinstance(layer, nn.LayerNorm):
            unit, zero = _identity_affine(layer.normalized_shape, inputs)
            # The op F.layer_norm calls, on the same arguments (cudnn_enable does not change what the op
            # computes), without its Python wrapper; tensor subclasses still dispatch through the op.
            return torch.layer_norm(inputs, layer.normalized_shape, unit, zero, layer.eps)
        return F.rms_norm(inputs, layer.normalized_shape, None, layer.eps)
    if inputs.dim() < 2 or (isinstance(layer, _InstanceNorm) and inputs.dim() == layer._get_no_batch_dim()):
        raise ValueError(
            f"{type(layer).__name__} per-sample gradients need a batched input (batch, channels, ...); got "
            f"input of shape {tuple(inputs.shape)}"
        )
    if isinstance(layer, nn.GroupNorm):
        return F.group_norm(inputs, layer.num_groups, None, None, layer.eps)
    use_input_stats = layer.training or not layer.track_running_stats
    # Running statistics are passed only when the layer reads them; with input statistics they would be
    # updated in place, which this recomputation must not do.
    return F.instance_norm(
        inputs,
        None if use_input_stats else layer.running_mean,
        None if use_input_stats else layer.running_var,
        None,
        None,
        use_input_stats,
        0.0,
        layer.eps,
    )


def _per_example_sum(layer: _NormLayer, values: torch.Tensor) -> torch.Tensor:
    """Sum ``(B, ...)`` over every axis the layer's affine parameters are broadcast along: ``(B, *param.shape)``."""
    batch_size = values.shape[0]
    if isinstance(layer, (nn.LayerNorm, nn.RMSNorm)):
        if values.dim() == len(layer.normalized_shape) + 2:  # one position axis already: the reshape is a no-op
            return values.sum(dim=1)
        return values.reshape(batch_size, -1, *layer.normalized_shape).sum(dim=1)
    return values.reshape(batch_size, values.shape[1], -1).sum(dim=2)


def _inputs_and_grads(activations, backprops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = activations[0]
    if inputs.dtype is backprops.dtype:  # the usual case: both .to calls would return their argument
        return inputs, backprops
    dtype = common_dtype(inputs, backprops)
    return inputs.to(dtype), backprops.to(dtype)


def normalization_grad_sample(
    layer: _NormLayer, activations, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-sample gradients of the affine weight and bias, each ``(B, *param.shape)``.

    Guarantee: ``out[p][i]`` is the gradient of example ``i``'s loss with respect to ``p``; the
    normalisation statistics are example ``i``'s own (these layers never mix examples).

    ==============================  =================================================
    case                            result
    ==============================  =================================================
    no affine / frozen parameter    left out of the result
    LayerNorm(bias=False), RMSNorm  weight only
    InstanceNorm in eval with       uses running statistics, as the forward does
    track_running_stats
    unbatched input                 ValueError (no example axis)
    ==============================  =================================================
    """
    return _affine_per_example(layer, activations, backprops, magnitudes=False)


def _affine_per_example(layer: _NormLayer, activations, backprops: torch.Tensor, *, magnitudes: bool) -> dict:
    """``sum(G * x_hat)`` (weight) and ``sum(G)`` (bias) per example; ``magnitudes``: of ``|G|`` and ``|x_hat|``."""
    weight, bias = trainable_weight_and_bias(layer)
    inputs, backprops = _inputs_and_grads(activations, backprops)
    grads = backprops.abs() if magnitudes else backprops
    # Filled directly (what keyed_by_parameter gives: an entry per trainable parameter), once per call of every norm.
    sums = {}
    if weight is not None:
        normalized = _normalized_input(layer, inputs)
        sums[weight] = _per_example_sum(layer, grads * (normalized.abs() if magnitudes else normalized))
    if bias is not None:
        sums[bias] = _per_example_sum(layer, grads)
    return sums


def normalization_norm_sample(
    layer: _NormLayer, activations, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example squared L2 norms ``(B,)`` of the affine weight and bias gradients.

    Guarantee: ``out[p][i] == ||normalization_grad_sample(...)[p][i]||^2``. The per-sample gradients are
    ``(B, C)``-sized, no larger than the output gradient, so they are formed and reduced.
    Same cases as ``normalization_grad_sample``.
    """
    per_sample = normalization_grad_sample(layer, activations, backprops)
    return {param: grads.flatten(1).pow(2).sum(dim=1) for param, grads in per_sample.items()}


def normalization_weighted_sum(
    layer: _NormLayer, activations, backprops: torch.Tensor, weights: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``sum_i weights[i] * g_i`` for the affine weight and bias: the ordinary gradient with each example's
    output gradient scaled by its weight.

    Guarantee: equals ``sum_i weights[i] * normalization_grad_sample(...)[p][i]`` up to float rounding.
    Same cases as ``normalization_grad_sample``.
    """
    # The per-sample gradients are (B, C)-sized, no larger than the output gradient: summing them with
    # their weights costs what the ordinary gradient costs.
    scaled = scale_per_example(backprops.to(common_dtype(activations[0], backprops)), weights)
    per_sample = normalization_grad_sample(layer, activations, scaled)
    return {param: grads.sum(dim=0) for param, grads in per_sample.items()}


def normalization_term_scale(
    layer: _NormLayer, activations, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Each example's L2 norm ``(B,)`` of ``sum |G * x_hat|`` (weight) and ``sum |G|`` (bias): the size of the
    terms a per-sample gradient adds up, for the first-backward check's rounding tolerance (a loss whose
    output gradient is constant over a normalised axis makes ``sum G * x_hat`` cancel to rounding)."""
    sums = _affine_per_example(layer, activations, backprops, magnitudes=True)
    return {param: terms.flatten(1).norm(dim=1) for param, terms in sums.items()}


NORMALIZATION_SAMPLER = register_layer_sampler(
    LayerSampler(
        grad_sample=normalization_grad_sample,
        norm_sample=normalization_norm_sample,
        weighted_sum=normalization_weighted_sum,
        term_scale=normalization_term_scale,
    ),
    *_NORM_TYPES,
)
