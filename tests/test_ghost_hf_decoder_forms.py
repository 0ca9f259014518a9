"""Forms the GPT-2 benchmark's layers take under fast clipping (issue 25): LayerNorm's ``x_hat`` recomputed with a
unit weight and a zero bias (torch's vectorised CPU kernel) is the kernel's affine-free result bit for bit, and the
embedding norm form chosen for short sequences (the equal-index matmul at T = 32, E = 64, where the segment form
took 2.8x the time). Both forms of the embedding norm are checked against the per-example loop in
``tests/test_grad_samplers.py``; LayerNorm's samplers in ``tests/test_ghost_clipping.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grad_samplers import embedding as embedding_module
from grad_samplers import normalization


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalized_shape", [(1,), (7,), (16,), (64,), (65,), (3, 5)])
def test_layer_norm_x_hat_is_the_affine_free_kernel_bit_for_bit(dtype, normalized_shape):
    generator = torch.Generator().manual_seed(len(normalized_shape) * 100 + normalized_shape[0])
    layer = nn.LayerNorm(normalized_shape, eps=1e-5).to(dtype)
    # Rows of very different scales and offsets, exact zeros (x - mean == 0 for a constant row) and a -0.0.
    inputs = torch.randn(6, 5, *normalized_shape, dtype=dtype, generator=generator)
    inputs = inputs * torch.logspace(-3, 3, 5, dtype=dtype).view(1, 5, *([1] * len(normalized_shape))) + 7.0
    inputs[0, 0] = 2.5
    inputs[1, 1].view(-1)[0] = -0.0
    expected = F.layer_norm(inputs, normalized_shape, None, None, layer.eps)
    got = normalization._normalized_input(layer, inputs)
    assert torch.equal(got, expected)
    assert torch.equal(got.signbit(), expected.signbit())  # equal also as bits: the sign of every zero
    assert got.isfinite().all()


def test_layer_norm_identity_affine_only_where_the_kernel_is_known():
    """Half precision and non-CPU tensors keep the absent weight and bias (another kernel); the cached constants
    are what their names say and are not handed out per layer."""
    assert normalization._identity_affine((4,), torch.zeros(2, 4, dtype=torch.bfloat16)) == (None, None)
    assert normalization._identity_affine((4,), torch.zeros(2, 4, device="meta")) == (None, None)
    unit, zero = normalization._identity_affine((4,), torch.zeros(2, 4))
    assert torch.equal(unit, torch.ones(4)) and torch.equal(zero, torch.zeros(4))
    assert not unit.requires_grad and not zero.requires_grad
    again = normalization._identity_affine((4,), torch.zeros(3, 4))
    assert again[0] is unit and again[1] is zero


def test_short_sequences_take_the_equal_index_embedding_norm():
    """The benchmark's GPT-2 embedding (T = 32, E = 64) and shorter take the matmul form; long sequences the
    segment form (``tests/test_grad_samplers.py`` checks T = 128 too)."""
    for batch_size in (8, 64):
        for embedding_dim in (16, 64, 256, 768):
            assert embedding_module._equal_index_is_cheaper(batch_size, 32, embedding_dim)
            assert not embedding_module._equal_index_is_cheaper(batch_size, 96, embedding_dim)
