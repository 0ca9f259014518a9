"""nn.Linear: the weight's per-sample gradient is the outer product of output gradient and input,
summed over any dimensions between the batch and the features."""

from __future__ import annotations

import math

import torch
from torch import nn

from grad_samplers._common import batch_error, common_dtype, keyed_by_parameter, trainable_weight_and_bias
from grad_samplers._memory import empty_per_sample
from grad_samplers.registry import LayerSampler, register_layer_sampler

# The direct form materialises G^T A for a block of examples at a time; this caps the block (elements).
_DIRECT_FORM_BLOCK_ELEMENTS = 1 << 22


def linear_grad_sample(layer: nn.Linear, activations, backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-sample gradients of ``layer.weight`` ``(B, out, in)`` and ``layer.bias`` ``(B, out)``.

    Guarantee: ``out[p][i]`` is the gradient of example ``i``'s loss with respect to ``p``, for inputs of
    any rank >= 2 (every dimension between the batch and the features is a position, summed over).

    ======================  ======================================
    case                    result
    ======================  ======================================
    frozen weight / bias    left out of the result
    2-D input               one position per example (outer product)
    empty batch             ``(0, *param.shape)``
    ======================  ======================================
    """
    inputs = activations[0]
    batch_size = backprops.shape[0]
    per_sample: dict[nn.Parameter, torch.Tensor] = {}
    dtype = common_dtype(inputs, backprops)
    if layer.weight.requires_grad:
        # The (batch, out, in) result is written once, straight into its final (huge-page backed)
        # buffer: at MLP sizes the cost is memory traffic and page faults, not arithmetic.
        weight_grads = empty_per_sample((batch_size, *layer.weight.shape), dtype=dtype, device=backprops.device)
        if inputs.dim() == 2:
            # One position per example: a broadcast multiply (one product per entry) writes the
            # outer products faster than bmm with an inner dimension of 1, and rounds identically.
            torch.mul(backprops.unsqueeze(2), inputs.unsqueeze(1), out=weight_grads)
        else:
            # Positions counted explicitly: reshape(batch, -1, ...) is ambiguous for an empty batch.
            positions = inputs.shape[1:-1].numel()
            grads = backprops.to(dtype).reshape(batch_size, positions, backprops.shape[-1])
            sequences = inputs.to(dtype).reshape(batch_size, positions, inputs.shape[-1])
            torch.bmm(grads.transpose(1, 2), sequences, out=weight_grads)
        per_sample[layer.weight] = weight_grads
    if layer.bias is not None and layer.bias.requires_grad:
        if backprops.dim() == 2:
            per_sample[layer.bias] = backprops
        else:
            per_sample[layer.bias] = backprops.flatten(1, -2).sum(dim=1)
    return per_sample


# ---------------------------------------------------------------------------------------------------------
# Fast clipping: per-example squared norms and per-example-weighted sums without per-sample gradients.
# An example's weight gradient is G^T A, with A its inputs (positions x in_features) and G its output
# gradient (positions x out_features); its bias gradient is G summed over positions.
def linear_weight_norm_form(num_positions: int, in_features: int, out_features: int) -> str:
    """How ``linear_squared_norms`` computes an example's squared weight-gradient norm, by cost.

    ============  ===============================================  ===================================
    form          formula                                          multiply-adds per example
    ============  ===============================================  ===================================
    "rank_one"    one position: ``||G||^2 * ||A||^2``               ``in + out``
    "gram"        ``<A A^T, G G^T>``                                ``positions^2 * (in + out)``
    "direct"      ``||G^T A||^2`` (materialised, a block at a time) ``positions * in * out``
    ============  ===============================================  ===================================

    The Gram form is chosen when it needs fewer multiply-adds than the direct form.
    """
    if num_positions <= 1:
        return "rank_one"
    if num_positions * (in_features + out_features) < in_features * out_features:
        return "gram"
    return "direct"


def _linear_operands(inputs: torch.Tensor, backprops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch, positions, in)`` inputs and ``(batch, positions, out)`` gradients in a common dtype."""
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        raise batch_error("Linear", "(batch, ..., in_features)", inputs)
    if inputs.dtype != backprops.dtype:  # autocast: compute in the wider of the two
        dtype = common_dtype(inputs, backprops)
        inputs, backprops = inputs.to(dtype), backprops.to(dtype)
    if inputs.dim() == 3 and backprops.dim() == 3 and inputs.shape[:2] == backprops.shape[:2]:
        return inputs, backprops  # already (batch, positions, features): the reshapes would return the same
    batch_size, num_positions = backprops.shape[0], math.prod(backprops.shape[1:-1])
    sequences = inputs.reshape(batch_size, num_positions, inputs.shape[-1])
    grads = backprops.reshape(batch_size, num_positions, backprops.shape[-1])
    return sequences, grads


def linear_squared_norms(
    inputs: torch.Tensor, backprops: torch.Tensor, *, weight: bool = True, bias: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-example squared L2 norms ``(batch,)`` of a linear map's weight and bias gradients.

    Guarantee: equal (up to float rounding) to ``||linear_grad_sample(...)[p][i]||^2`` for the weight
    and the bias, for inputs of any rank >= 2 (positions are every dimension between batch and
    features), without forming a ``(batch, out, in)`` tensor except in blocks of
    ``_DIRECT_FORM_BLOCK_ELEMENTS`` when the direct form is the cheapest (``linear_weight_norm_form``).

    ===========================  =====================================
    case                         result
    ===========================  =====================================
    ``weight=False``/``bias``    that entry is None
    zero output gradient         0
    NaN/Inf in inputs or grads   NaN/Inf for that example (not hidden)
    input of rank < 2            ValueError
    ===========================  =====================================
    """
    sequences, grads = _linear_operands(inputs, backprops)
    batch_size, num_positions, in_features = sequences.shape
    out_features = grads.shape[-1]
    weight_norms = bias_norms = None
    # One position: weight and bias gradients are G and G (x) A, so ||G||^2 serves both. vector_norm
    # reduces without a squared temporary.
    grad_squares = None
    if num_positions == 1:
        grad_squares = torch.linalg.vector_norm(grads.reshape(batch_size, out_features), dim=1).square()
    if weight:
        form = linear_weight_norm_form(num_positions, in_features, out_features)
        if form == "rank_one":
            input_squares = torch.linalg.vector_norm(sequences.reshape(batch_size, in_features), dim=1).square()
            weight_norms = grad_squares * input_squares
        elif form == "gram":
            input_gram = torch.bmm(sequences, sequences.transpose(1, 2))
            grad_gram = torch.bmm(grads, grads.transpose(1, 2))
            weight_norms = (input_gram * grad_gram).sum(dim=(1, 2))
        else:
            block = max(1, _DIRECT_FORM_BLOCK_ELEMENTS // max(1, in_features * out_features))
            if 0 < batch_size <= block:
                # One block (the usual case): the same products, without two slices and cat's copy of one block.
                weight_norms = torch.bmm(grads.transpose(1, 2), sequences).square().sum(dim=(1, 2))
            else:
                weight_norms = torch.cat(
                    [
                        torch.bmm(grads[start : start + block].transpose(1, 2), sequences[start : start + block])
                        .square()
                        .sum(dim=(1, 2))
                        for start in range(0, batch_size, block)
                    ]
                    or [grads.new_zeros(0)]
                )
    if bias:
        bias_norms = grad_squares if grad_squares is not None else torch.linalg.vector_norm(grads.sum(dim=1), dim=1).square()
    return weight_norms, bias_norms


def linear_gradient_factors(inputs: torch.Tensor, backprops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Example ``i``'s weight gradient ``G_i^T A_i`` as a sum over its positions, ``sum_t G_i[t] A_i[t]^T``.

    Returns ``(G (B, positions, out), A (B, positions, in))``, views of the operands in their own dtypes (every
    dimension between batch and features is a position; nothing copied, as fast clipping keeps them until the end
    of its pass). Guarantee: ``G[i].T @ A[i]`` is ``linear_grad_sample(...)[weight][i]`` up to float rounding;
    what fast clipping's tied-weight form (``clipping.ghost.tied``) pairs with another use of the same weight.
    ``ValueError`` for an input of rank < 2.
    """
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        raise batch_error("Linear", "(batch, ..., in_features)", inputs)
    if inputs.dim() == 3 and backprops.dim() == 3 and inputs.shape[:2] == backprops.shape[:2]:
        return backprops, inputs  # already (batch, positions, features): the reshapes would return the same
    batch_size, num_positions = backprops.shape[0], math.prod(backprops.shape[1:-1])
    grads = backprops.reshape(batch_size, num_positions, backprops.shape[-1])
    return grads, inputs.reshape(batch_size, num_positions, inputs.shape[-1])


def linear_weighted_sums(
    inputs: torch.Tensor, backprops: torch.Tensor, weights: torch.Tensor, *, weight: bool = True, bias: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``sum_i weights[i] * g_i`` for a linear map's weight ``(out, in)`` and bias ``(out,)``.

    Guarantee: equal (up to float rounding) to the weighted sum of ``linear_grad_sample``'s per-sample
    gradients; computed as one ordinary weight-gradient product with each example's rows scaled.

    ===========================  =====================================
    case                         result
    ===========================  =====================================
    all weights 0 (finite data)  zeros
    weight 0, NaN in its rows    NaN (zero the rows first to drop them)
    ``weight=False``/``bias``    that entry is None
    ===========================  =====================================
    """
    sequences, grads = _linear_operands(inputs, backprops)
    in_features, out_features = sequences.shape[-1], grads.shape[-1]
    per_example = (weights if weights.dtype == grads.dtype else weights.to(grads.dtype)).view(-1, 1, 1)
    # Scale whichever operand is narrower: fewer multiplications, same product.
    if out_features <= in_features or not weight:
        grads = grads * per_example
    else:
        sequences = sequences * per_example
    bias_from_flat = bias and (out_features <= in_features or not weight)
    flat_grads = grads.reshape(-1, out_features) if bias_from_flat else None
    weight_sum = None
    if weight:
        transposed = flat_grads.t() if flat_grads is not None else _transposed_flat_grads(grads)
        weight_sum = transposed.mm(sequences.reshape(-1, in_features))
    bias_sum = None
    if bias:
        if bias_from_flat:
            bias_sum = flat_grads.sum(dim=0)
        else:  # the gradients were left unscaled: weight each example's summed rows
            bias_sum = torch.mv(grads.sum(dim=1).t(), per_example.view(-1))
    return weight_sum, bias_sum


def _transposed_flat_grads(grads: torch.Tensor) -> torch.Tensor:
    """``G^T`` ``(out, batch * positions)`` of ``grads`` ``(batch, positions, out)``, the left operand of the weight
    sum's product, copied the cheaper way when it must be copied.

    ``grads.reshape(-1, out).t()`` is a view when ``G`` is laid out row by row. A language model's head gets its
    output gradient with the positions innermost (the loss took the logits transposed, ``(batch, vocabulary,
    positions)``: GPT-2's next-token loss): that reshape copies with the vocabulary innermost, reading one
    element per stride, and ``(out, batch * positions)`` built from the positions' contiguous runs is the same
    matrix for a quarter of the copy's time (and a row-major operand the product takes faster). ``mm`` gives the
    same floats for either layout of the same matrix (``tests/test_grad_sampler_layouts.py`` checks it bit for bit);
    only the layout of the copy changes. Taken on CPU in float32/float64 only (BLAS, where that was checked):
    other backends may pick another kernel, with another summation order, for the other layout."""
    batch_size, num_positions, out_features = grads.shape
    if (
        num_positions > 1
        and out_features > 1
        and grads.stride(1) == 1
        and grads.stride(2) != 1
        and grads.dtype in _BLAS_DTYPES
        and grads.device.type == "cpu"
    ):
        return grads.permute(2, 0, 1).reshape(out_features, batch_size * num_positions)
    return grads.reshape(-1, out_features).t()


_BLAS_DTYPES = frozenset((torch.float32, torch.float64))


def linear_norm_sample(layer: nn.Module, activations, backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example squared gradient norms of a linear map's ``weight`` and ``bias`` (trainable ones only);
    see ``linear_squared_norms`` for the guarantee and the choice of form. A norm does not see how the
    weight is laid out, so this serves ``nn.Linear`` and the transposed HF ``Conv1D`` alike."""
    weight, bias = trainable_weight_and_bias(layer)
    norms = linear_squared_norms(activations[0], backprops, weight=weight is not None, bias=bias is not None)
    return keyed_by_parameter(zip((weight, bias), norms))


def linear_weighted_sum(
    layer: nn.Linear, activations, backprops: torch.Tensor, weights: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``sum_i weights[i] * g_i`` for ``layer.weight`` and ``layer.bias`` (trainable ones only); see
    ``linear_weighted_sums``."""
    weight, bias = trainable_weight_and_bias(layer)
    sums = linear_weighted_sums(activations[0], backprops, weights, weight=weight is not None, bias=bias is not None)
    return keyed_by_parameter(zip((weight, bias), sums))


LINEAR_SAMPLER = register_layer_sampler(
    LayerSampler(grad_sample=linear_grad_sample, norm_sample=linear_norm_sample, weighted_sum=linear_weighted_sum),
    nn.Linear,
)
