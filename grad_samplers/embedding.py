"""nn.Embedding and nn.EmbeddingBag: per-sample gradients, their norms and weighted sums.

An example's embedding gradient is sparse: row ``v`` receives the sum of the output gradients at the
positions where the example looked ``v`` up (an EmbeddingBag scales each entry by its coefficient:
1, 1/bag size for ``mode="mean"``, or its ``per_sample_weight``). Entries equal to ``padding_idx``
contribute nothing, as in the layer's own backward.

Rejected with a ValueError (they would need rules this file does not implement):

- ``scale_grad_by_freq=True``: the gradient is divided by each index's frequency in the *whole batch*,
  so an example's gradient depends on the other examples, which breaks the per-example sensitivity
  bound that clipping is meant to give.
- ``EmbeddingBag(mode="max")``: its gradient goes to the arg-max row of each output coordinate, which
  this file would have to recompute from the weights with exactly the forward's tie-breaking; not
  implemented (use 'sum' or 'mean').
"""

from __future__ import annotations

import math

import torch
from torch import nn

from grad_samplers._common import scale_per_example
from grad_samplers._memory import zeros_per_sample
from grad_samplers.registry import LayerSampler, register_layer_sampler

# What one element-step of the segment form (sort, gather, scatter-add: memory-bound, plus ~10 small ops of
# fixed cost) costs relative to one multiply-add of the equal-index form's batched matmul (runs near peak).
# Calibrated on CPU (1 thread, float32, torch 2.13, AMD EPYC; session 9, thread time, interleaved medians): the
# measured crossover is T ~ 64-70 for E = 64 at B = 8 (T ~ 55 at B = 64) and T ~ 60 for E = 256-768; at T = 32
# the equal-index form is 1.4-2.8x faster, at T = 128 the segment form 2x, at T = 256 3-8x. (Was 10, which put
# the crossover near T = 30: the GPT-2 benchmark's embedding, T = 32, E = 64, took the segment form at 2.8x the
# time.) 16 puts it near T ~ 48-55 for every E.
_MEMORY_BOUND_STEP_COST = 16


def _reject_scale_grad_by_freq(layer: nn.Module) -> None:
    if layer.scale_grad_by_freq:
        raise ValueError(
            f"{type(layer).__name__}(scale_grad_by_freq=True) divides gradients by batch-wide index counts, so "
            f"one example's gradient depends on the others and per-example clipping would not bound its "
            f"influence. Construct it with scale_grad_by_freq=False."
        )


def _segment_sums(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum ``values`` over equal ``keys`` (1-D, length N): returns ``(sums, key_of_sum)``, both of length N.

    Sorting groups equal keys; ``cumsum`` of "key changed" numbers the groups. The result has N slots
    (the most groups there can be) so that no data-dependent size is needed: no host sync on GPU.
    Unused slots hold a zero sum and key 0.
    """
    sorted_keys, order = torch.sort(keys)
    starts = torch.ones_like(sorted_keys, dtype=torch.bool)
    starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
    group = torch.cumsum(starts, dim=0) - 1
    sums = values.new_zeros(values.shape).index_add_(0, group, values[order])
    key_of_sum = torch.zeros_like(sorted_keys).scatter_(0, group, sorted_keys)
    return sums, key_of_sum


# ---------------------------------------------------------------------------------------- nn.Embedding
def _embedding_lookups(
    layer: nn.Embedding, activations, backprops: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices (B, T), output gradients (B, T, E))`` with padding positions' gradients zeroed."""
    _reject_scale_grad_by_freq(layer)
    indices = activations[0]
    batch_size = backprops.shape[0]
    if indices.dim() == 0:
        raise ValueError(
            "nn.Embedding per-sample gradients need indices with a batch dimension; got a scalar index"
        )
    # Each step only when it changes something (a reshape to the tensor's own shape and .long() of int64 indices
    # return the same values through one more dispatch each).
    if indices.dim() != 2 or indices.shape[0] != batch_size:
        indices = indices.reshape(batch_size, -1)
    if indices.dtype is not torch.int64:
        indices = indices.long()  # int32 indices are allowed by the layer, not by scatter
    if backprops.dim() == 3 and backprops.shape[2] == layer.embedding_dim:
        grads = backprops
    else:
        grads = backprops.reshape(batch_size, -1, layer.embedding_dim)
    if layer.padding_idx is not None:
        grads = grads * (indices != layer.padding_idx).unsqueeze(-1).to(grads.dtype)
    return indices, grads


def embedding_gradient_factors(
    layer: nn.Embedding, activations, backprops: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Example ``i``'s table gradient as a sum over its lookups: ``sum_t onehot(indices[i, t]) grads[i, t]^T``.

    Returns ``(indices (B, T) long, grads (B, T, embedding_dim))``. Guarantee: scattering ``grads[i]`` to the rows
    ``indices[i]`` gives ``embedding_grad_sample(...)[weight][i]`` exactly (the same tensors it scatters); what
    fast clipping's tied-weight form (``clipping.ghost.tied``) pairs with another use of the same table.

    ========================  =================================================
    case                      result
    ========================  =================================================
    index == padding_idx      its gradient row is zero
    scale_grad_by_freq=True   ValueError (gradient depends on other examples)
    ========================  =================================================
    """
    return _embedding_lookups(layer, activations, backprops)


def embedding_grad_sample(
    layer: nn.Embedding, activations, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-sample gradients ``(B, num_embeddings, embedding_dim)`` of an embedding table.

    Guarantee: ``out[weight][i]`` is the gradient of example ``i``'s loss with respect to the table:
    the sum of example ``i``'s output gradients scattered to the rows it looked up.

    ========================  =================================================
    case                      result
    ========================  =================================================
    index == padding_idx      contributes nothing (row stays zero)
    index repeated            its gradients are summed
    frozen weight             empty result
    scale_grad_by_freq=True   ValueError (gradient depends on other examples)
    ========================  =================================================
    """
    weight = layer.weight  # read once (nn.Module.__getattr__ is a Python call)
    if not weight.requires_grad:
        return {}
    indices, grads = _embedding_lookups(layer, activations, backprops)
    batch_size, num_lookups = indices.shape
    # Huge pages: zero-filling a fresh (batch, vocabulary, dim) buffer page by page dominates this step.
    shape = (batch_size, layer.num_embeddings, layer.embedding_dim)
    per_sample = zeros_per_sample(shape, dtype=grads.dtype, device=grads.device)
    per_sample.scatter_add_(1, indices.unsqueeze(-1).expand(batch_size, num_lookups, layer.embedding_dim), grads)
    return {weight: per_sample}


def _equal_index_squared_norms(indices: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``sum_{t,t'} [idx_t == idx_t'] <G_t, G_t'>`` per example: ``T x T`` work and memory."""
    same_index = indices.unsqueeze(2) == indices.unsqueeze(1)
    inner = torch.bmm(grads, grads.transpose(1, 2))
    # In place, the flags promoted by the multiply itself: each product is ``inner * 1.0`` or ``inner * 0.0`` as
    # with the flags converted first (a NaN/Inf inner product still makes NaN), without the conversion's op and the
    # two temporaries. (Writing the flags as floats with ``torch.eq(..., out=)`` measured no faster in a step.)
    return inner.mul_(same_index).sum(dim=(1, 2))


def _segment_squared_norms(indices: torch.Tensor, grads: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """Sum the gradients of equal (example, index) pairs, then square: ``T x E`` work plus one sort."""
    batch_size, num_lookups = indices.shape
    keys = (torch.arange(batch_size, device=indices.device).unsqueeze(1) * num_embeddings + indices).reshape(-1)
    row_sums, key_of_sum = _segment_sums(keys, grads.reshape(batch_size * num_lookups, -1))
    return grads.new_zeros(batch_size).index_add_(0, key_of_sum // num_embeddings, row_sums.pow(2).sum(dim=1))


def _equal_index_is_cheaper(batch_size: int, num_lookups: int, embedding_dim: int) -> bool:
    """Which exact norm form costs less for ``T`` lookups of width ``E`` per example.

    The equal-index form is one batched matmul, ``T^2 (E+1)`` multiply-adds and a ``T x T`` buffer per
    example; the segment form does ``~3 T E`` memory-bound element steps plus a sort of ``B T`` keys and
    copies ``G`` twice (``2 T E``). Weighting the memory-bound steps (``_MEMORY_BOUND_STEP_COST``) puts the
    crossover near ``T ~ 50`` for any ``E``: short inputs take the matmul (then its ``T^2`` buffer is also
    no larger than the segment form's ``2 T E`` copies for ``E >= 32``, under twice them for ``E >= 16``),
    long sequences the ``O(T)`` form. Both forms are exact (they differ only in float rounding). Neither
    materialises the ``V x E`` gradient.
    """
    equal_index_cost = num_lookups * num_lookups * (embedding_dim + 1)
    sort_steps = max(1.0, math.log2(max(2, batch_size * num_lookups)))
    segment_cost = _MEMORY_BOUND_STEP_COST * num_lookups * (3 * embedding_dim + sort_steps)
    return equal_index_cost <= segment_cost


def embedding_norm_sample(
    layer: nn.Embedding, activations, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example squared L2 norms ``(B,)`` of the embedding gradient, without the ``B x V x E`` tensor.

    Guarantee: ``out[weight][i] == ||embedding_grad_sample(...)[weight][i]||^2`` up to float rounding.
    Form: the equal-index form ``sum_{t,t'} [idx_t == idx_t'] <G_t, G_t'>`` for short inputs, the
    sort-and-segment-sum form otherwise (``_equal_index_is_cheaper``).

    ========================  =================================================
    case                      result
    ========================  =================================================
    index == padding_idx      contributes 0
    index repeated            gradients summed before squaring
    frozen weight             empty result
    scale_grad_by_freq=True   ValueError
    ========================  =================================================
    """
    weight = layer.weight  # read once (nn.Module.__getattr__ is a Python call)
    if not weight.requires_grad:
        return {}
    indices, grads = _embedding_lookups(layer, activations, backprops)
    batch_size, num_lookups = indices.shape
    if _equal_index_is_cheaper(batch_size, num_lookups, layer.embedding_dim):
        return {weight: _equal_index_squared_norms(indices, grads)}
    return {weight: _segment_squared_norms(indices, grads, layer.num_embeddings)}


def embedding_weighted_sum(
    layer: nn.Embedding, activations, backprops: torch.Tensor, weights: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``sum_i weights[i] * g_i`` ``(num_embeddings, embedding_dim)``: the ordinary embedding backward
    with each example's output gradient scaled by its weight.

    Guarantee: equals ``sum_i weights[i] * embedding_grad_sample(...)[weight][i]`` up to float rounding;
    the ``padding_idx`` row is zero.

    ========================  =================================================
    case                      result
    ========================  =================================================
    weights all 0             zeros
    frozen weight             empty result
    scale_grad_by_freq=True   ValueError
    ========================  =================================================
    """
    weight = layer.weight  # read once (nn.Module.__getattr__ is a Python call)
    if not weight.requires_grad:
        return {}
    indices, grads = _embedding_lookups(layer, activations, backprops)
    scaled = scale_per_example(grads, weights)
    total = scaled.new_zeros(layer.num_embeddings, layer.embedding_dim)
    total.index_add_(0, indices.reshape(-1), scaled.reshape(-1, layer.embedding_dim))
    return {weight: total}


# ---------------------------------------------------------------------------------------- nn.EmbeddingBag
def _bag_entries(
    layer: nn.EmbeddingBag, activations, num_bags: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every looked-up entry: ``(bag, index, coefficient)``, each of length N.

    The bag's output is ``sum_entries coefficient * weight[index]``, so its gradient puts
    ``coefficient * G_bag`` on row ``index``. Padding entries get coefficient 0 and do not count in a
    mean's bag size, as in torch.
    """
    _reject_scale_grad_by_freq(layer)
    if layer.mode not in ("sum", "mean"):
        raise ValueError(
            f"nn.EmbeddingBag(mode={layer.mode!r}) has no per-sample gradient rule; construct it with "
            f"mode='sum' or mode='mean'"
        )
    indices = activations[0]
    offsets = activations[1] if len(activations) > 1 else None
    per_sample_weights = activations[2] if len(activations) > 2 else None
    device = indices.device
    if indices.dim() == 2:
        if indices.shape[0] != num_bags:
            raise ValueError(f"EmbeddingBag: 2-D input has {indices.shape[0]} bags but its output has {num_bags}")
        bag = torch.arange(num_bags, device=device).repeat_interleave(indices.shape[1])
    elif indices.dim() == 1:
        if offsets is None:
            raise ValueError("EmbeddingBag: a 1-D input needs offsets (where each bag starts)")
        starts = offsets[:-1] if layer.include_last_offset else offsets
        if starts.numel() != num_bags:
            raise ValueError(f"EmbeddingBag: offsets describe {starts.numel()} bags but the output has {num_bags}")
        if layer.include_last_offset and offsets.numel() > 0 and int(offsets[-1]) != indices.numel():
            # torch's CPU kernel then silently puts the trailing entries into the last bag; refuse rather
            # than guess which entries the backend used.
            raise ValueError(
                f"EmbeddingBag(include_last_offset=True): the last offset ({int(offsets[-1])}) must equal "
                f"the number of indices ({indices.numel()})"
            )
        positions = torch.arange(indices.numel(), device=device)
        bag = torch.searchsorted(starts.to(positions.dtype), positions, right=True) - 1
    else:
        raise ValueError(f"EmbeddingBag input must be 1-D (with offsets) or 2-D; got shape {tuple(indices.shape)}")
    indices = indices.reshape(-1).long()
    if per_sample_weights is not None:
        coefficient = per_sample_weights.reshape(-1).to(dtype)
    else:
        coefficient = torch.ones(indices.numel(), dtype=dtype, device=device)
    if layer.padding_idx is not None:
        counted = (indices != layer.padding_idx).to(dtype)
        coefficient = coefficient * counted
    else:
        counted = torch.ones(indices.numel(), dtype=dtype, device=device)
    if layer.mode == "mean":
        bag_size = torch.zeros(num_bags, dtype=dtype, device=device).index_add_(0, bag, counted)
        coefficient = coefficient / bag_size.clamp(min=1)[bag]
    return bag, indices, coefficient


def embedding_bag_grad_sample(
    layer: nn.EmbeddingBag, activations, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-bag gradients ``(num_bags, num_embeddings, embedding_dim)`` of an EmbeddingBag table
    (one example = one bag = one row of the output).

    Guarantee: ``out[weight][b]`` is the gradient of bag ``b``'s loss with respect to the table, for
    modes 'sum' and 'mean', 1-D input with offsets (``include_last_offset`` either way) or 2-D input,
    ``per_sample_weights`` and ``padding_idx``.

    ============================  =================================================
    case                          result
    ============================  =================================================
    empty bag / all padding       zero gradient
    index == padding_idx          contributes nothing, not counted in a mean
    frozen weight                 empty result
    mode='max'                    ValueError
    scale_grad_by_freq=True       ValueError
    include_last_offset, last     ValueError
    offset != number of indices
    ============================  =================================================
    """
    if not layer.weight.requires_grad:
        return {}
    num_bags, embedding_dim = backprops.shape
    bag, indices, coefficient = _bag_entries(layer, activations, num_bags, backprops.dtype)
    per_sample = backprops.new_zeros(num_bags * layer.num_embeddings, embedding_dim)
    per_sample.index_add_(0, bag * layer.num_embeddings + indices, coefficient.unsqueeze(1) * backprops[bag])
    return {layer.weight: per_sample.view(num_bags, layer.num_embeddings, embedding_dim)}


def embedding_bag_norm_sample(
    layer: nn.EmbeddingBag, activations, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-bag squared L2 norms ``(num_bags,)`` of the table gradient, without the ``B x V x E`` tensor.

    A bag's gradient is the rank-one ``a_b G_b^T`` (``a_b[v]`` = summed coefficients of the bag's
    entries equal to ``v``), so its squared norm is ``||a_b||^2 ||G_b||^2``; ``a_b`` is formed by a
    sort-and-segment-sum over the N entries (scalars only; an equal-index form would cost ``T^2`` per
    bag and is awkward for ragged bags).

    Guarantee: ``out[weight][b] == ||embedding_bag_grad_sample(...)[weight][b]||^2`` up to rounding;
    same cases as ``embedding_bag_grad_sample``.
    """
    if not layer.weight.requires_grad:
        return {}
    num_bags = backprops.shape[0]
    bag, indices, coefficient = _bag_entries(layer, activations, num_bags, backprops.dtype)
    summed, key_of_sum = _segment_sums(bag * layer.num_embeddings + indices, coefficient)
    coefficient_norms = backprops.new_zeros(num_bags).index_add_(0, key_of_sum // layer.num_embeddings, summed.pow(2))
    return {layer.weight: coefficient_norms * backprops.pow(2).sum(dim=1)}


def embedding_bag_weighted_sum(
    layer: nn.EmbeddingBag, activations, backprops: torch.Tensor, weights: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``sum_b weights[b] * g_b`` ``(num_embeddings, embedding_dim)``: the ordinary EmbeddingBag backward
    with each bag's output gradient scaled by its weight.

    Guarantee: equals ``sum_b weights[b] * embedding_bag_grad_sample(...)[weight][b]`` up to rounding;
    same cases as ``embedding_bag_grad_sample``.
    """
    if not layer.weight.requires_grad:
        return {}
    num_bags, embedding_dim = backprops.shape
    bag, indices, coefficient = _bag_entries(layer, activations, num_bags, backprops.dtype)
    scaled = backprops * weights.to(backprops.dtype).unsqueeze(1)
    total = backprops.new_zeros(layer.num_embeddings, embedding_dim)
    total.index_add_(0, indices, coefficient.unsqueeze(1) * scaled[bag])
    return {layer.weight: total}


EMBEDDING_SAMPLER = register_layer_sampler(
    LayerSampler(
        grad_sample=embedding_grad_sample, norm_sample=embedding_norm_sample, weighted_sum=embedding_weighted_sum
    ),
    nn.Embedding,
)
EMBEDDING_BAG_SAMPLER = register_layer_sampler(
    LayerSampler(
        grad_sample=embedding_bag_grad_sample,
        norm_sample=embedding_bag_norm_sample,
        weighted_sum=embedding_bag_weighted_sum,
    ),
    nn.EmbeddingBag,
)
