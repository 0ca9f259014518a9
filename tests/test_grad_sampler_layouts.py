"""Bit-for-bit checks of the cheaper forms the samplers take for the layouts GPT-2 hands them (a language model
head's output gradient with the positions innermost; the embedding's equal-token mask): each must give the same
floats as the form it replaces."""

from __future__ import annotations

import pytest
import torch

from grad_samplers.embedding import _equal_index_squared_norms
from grad_samplers.linear import linear_weighted_sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("batch", "positions", "out_features", "in_features"), [(8, 32, 1024, 64), (3, 7, 50, 9), (1, 5, 6, 2)]
)
def test_weighted_sum_of_a_positions_innermost_gradient_matches_the_row_major_one(
    batch, positions, out_features, in_features, dtype
):
    """G laid out (batch, out, positions) (a head whose loss took the logits transposed) takes the (out, batch *
    positions) copy: the same weighted sum, bit for bit, as the row-major G (whose flattening is a view)."""
    generator = torch.Generator().manual_seed(0)
    grads = torch.randn(batch, out_features, positions, generator=generator, dtype=dtype).transpose(1, 2)
    inputs = torch.randn(batch, positions, in_features, generator=generator, dtype=dtype)
    weights = torch.rand(batch, generator=generator, dtype=dtype)
    assert grads.stride(1) == 1
    expected = linear_weighted_sums(inputs, grads.contiguous(), weights, bias=False)[0]
    actual = linear_weighted_sums(inputs, grads, weights, bias=False)[0]
    assert torch.equal(actual, expected)


def test_equal_index_norms_match_the_bool_mask_form_bit_for_bit():
    """The bool mask multiplied in place gives the products of the mask converted to floats first, NaN included
    (a NaN gradient must still show in its example's norm)."""
    generator = torch.Generator().manual_seed(1)
    indices = torch.randint(0, 5, (4, 9), generator=generator)
    grads = torch.randn(4, 9, 3, generator=generator)
    grads[2, 3, 1] = float("nan")
    inner = torch.bmm(grads, grads.transpose(1, 2))
    expected = (inner * (indices.unsqueeze(2) == indices.unsqueeze(1)).to(inner.dtype)).sum(dim=(1, 2))
    actual = _equal_index_squared_norms(indices, grads)
    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.nan_to_num(), expected.nan_to_num())
