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

from grad_samplers._common import batch_error, common_dtype, keyed_by_parameter, trainable_weight_and_bias
from grad_samplers.linear import linear_norm_sample, linear_weighted_sums
from grad_samplers.registry import LayerSampler, register_layer_sampler, registered_grad_samplers

_TRANSFORMERS_MODULE = "transformers.pytorch_utils"


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
        raise batch_error("Conv1D", "(batch, ..., in_features)", inputs)
    weight, bias = trainable_weight_and_bias(layer)
    grads, sequences = _batched_sequences(inputs, backprops)
    per_sample = {}  # filled directly: what keyed_by_parameter gives, once per call
    if weight is not None:
        per_sample[weight] = torch.bmm(sequences.transpose(1, 2), grads)
    if bias is not None:
        per_sample[bias] = grads.sum(dim=1)
    return per_sample


def _batched_sequences(inputs: torch.Tensor, backprops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G (B, positions, out), A (B, positions, in))`` in the operands' common dtype. The operands are returned
    as they are when already so (3-D, one dtype: GPT-2's projections): a ``.to`` to their own dtype and a reshape
    to their own shape would each return the same values through one more dispatch."""
    batch_size = backprops.shape[0]
    if inputs.dtype is not backprops.dtype:  # autocast: combine in the wider of the two
        dtype = common_dtype(inputs, backprops)
        inputs, backprops = inputs.to(dtype), backprops.to(dtype)
    if inputs.dim() == 3 and backprops.dim() == 3 and inputs.shape[:2] == backprops.shape[:2]:
        return backprops, inputs
    # Positions counted explicitly: reshape(batch, -1, ...) is ambiguous for an empty batch.
    positions = inputs.shape[1:-1].numel()
    grads = backprops.reshape(batch_size, positions, backprops.shape[-1])
    return grads, inputs.reshape(batch_size, positions, inputs.shape[-1])


#: Per-example squared gradient norms ``(B,)``: ``linear_norm_sample`` (the transpose does not change a
#: norm). Guarantee: ``out[p][i] == ||conv1d_grad_sample(...)[p][i]||^2`` up to float rounding.
conv1d_norm_sample = linear_norm_sample


def conv1d_weighted_sum(
    layer: nn.Module, activations, backprops: torch.Tensor, weights: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``sum_i weights[i] * g_i`` for the weight ``(in, out)`` and bias ``(out,)``: Linear's weighted sum,
    transposed. Guarantee: equals the weighted sum of ``conv1d_grad_sample`` up to float rounding."""
    weight, bias = trainable_weight_and_bias(layer)
    weight_sum, bias_sum = linear_weighted_sums(
        activations[0], backprops, weights, weight=weight is not None, bias=bias is not None
    )
    weight_sum = None if weight_sum is None else weight_sum.t().contiguous()
    return keyed_by_parameter(((weight, weight_sum), (bias, bias_sum)))


CONV1D_SAMPLER = LayerSampler(
    grad_sample=conv1d_grad_sample, norm_sample=conv1d_norm_sample, weighted_sum=conv1d_weighted_sum
)


def register_if_imported() -> bool:
    """Register ``CONV1D_SAMPLER`` for ``transformers.pytorch_utils.Conv1D`` if ``transformers`` has been
    imported (never imports it) and nobody registered a grad sampler for it (a plugin's stays). Returns
    whether ``Conv1D`` has a grad sampler now. Cheap to call repeatedly."""
    module = sys.modules.get(_TRANSFORMERS_MODULE)
    conv1d = getattr(module, "Conv1D", None)
    if not (isinstance(conv1d, type) and issubclass(conv1d, nn.Module)):
        return False
    if conv1d not in registered_grad_samplers():
        register_layer_sampler(CONV1D_SAMPLER, conv1d)
    return True


__all__ = ["CONV1D_SAMPLER", "conv1d_grad_sample", "conv1d_norm_sample", "conv1d_weighted_sum", "register_if_imported"]
