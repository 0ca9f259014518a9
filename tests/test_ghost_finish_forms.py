"""The end-of-pass shortcuts of fast clipping are bit for bit the forms they replace: the materialised parameters'
norms taken stacked (``backward._flat_square_sum``), the flat weights handed to the rank-one stacks as they are
(``batched.RankOneLinearLayers.weighted_sums(flat=...)``), the flat clip factors without select / unsqueeze, and the
pending calls read without ``WeakSet`` iteration (``uses.GhostPasses.unconsumed``)."""

from __future__ import annotations

import gc
import types

import torch
from torch import nn

from privacy_engine.clipping import PerSampleGradientClipper
from privacy_engine.clipping.ghost import backward, batched
from privacy_engine.clipping.ghost.uses import GhostPasses, Use


def _materialised(shapes, batch_size=5, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for shape in shapes:
        param = nn.Parameter(torch.zeros(shape, dtype=dtype))
        out[param] = torch.randn(batch_size, *shape, generator=generator, dtype=dtype) * 3
    return out


def _reference(first, materialised):
    squared = {index: value for index, value in enumerate(first)}
    backward._add_materialised_squares(squared, materialised)
    values = list(squared.values())
    return torch.stack(values).sum(dim=0)


def test_stacked_norms_sum_equals_the_per_parameter_form_bit_for_bit():
    # Repeated shapes (stacked), shapes met once, a 0-dim parameter, a non-contiguous and a large gradient.
    shapes = [(4,), (4, 3), (4,), (), (3, 4), (4, 3), (4,), (200, 200), (7,)]
    materialised = _materialised(shapes)
    params = list(materialised)
    materialised[params[1]] = torch.randn(5, 3, 4).transpose(1, 2)  # non-contiguous (5, 4, 3)
    first = [torch.rand(5), torch.rand(5)]
    expected = _reference(first, materialised)
    got = backward._flat_square_sum([*first, *([None] * len(materialised))], materialised)
    assert got is not None and torch.equal(got, expected)
    # No entry before the materialised ones, float64.
    materialised = _materialised(shapes, dtype=torch.float64, seed=1)
    got = backward._flat_square_sum([None] * len(materialised), materialised)
    assert torch.equal(got, _reference([], materialised))


def test_stacked_norms_decline_what_the_stack_would_promote():
    materialised = _materialised([(4,), (4,)])
    materialised.update(_materialised([(4,)], dtype=torch.float64))
    assert backward._flat_square_sum([None] * 3, materialised) is None  # float32 and float64 norms
    materialised = _materialised([(4,), (4,)])
    assert backward._flat_square_sum([torch.rand(5, dtype=torch.float64), None, None], materialised) is None
    assert backward._flat_square_sum([None], _materialised([(4,)])) is None  # one entry: nothing to stack


def test_flat_rank_one_weights_equal_the_column_form_bit_for_bit():
    generator = torch.Generator().manual_seed(3)
    shapes = [(4, 4)] * 3 + [(3, 9), (9, 3), (5, 6)]
    layers = [nn.Linear(i, o) for i, o in shapes]
    results = []
    weights = torch.rand(7, 1, generator=generator)
    for flat in (None, weights):
        kept = batched.RankOneLinearLayers()
        squared: dict = {}
        for layer in layers:
            use = Use(path="", layer=layer, parts=((layer.weight, None), (layer.bias, None)), rank_one_linear=True)
            inputs = torch.randn(7, layer.in_features, generator=torch.Generator().manual_seed(layer.in_features))
            grads = torch.randn(7, layer.out_features, generator=torch.Generator().manual_seed(layer.out_features))
            kept.add(batched.rank_one_linear(use, (inputs,), grads), squared)
        kept.squared_norms(squared)
        group_of = dict.fromkeys(squared, 0)
        sums: dict = {}
        kept.weighted_sums(lambda column: (weights.select(1, column), None), sums, group_of, [], 0, flat)
        results.append(sums)
    assert list(results[0]) == list(results[1])
    assert all(torch.equal(results[0][p], results[1][p]) for p in results[0])


def test_flat_clip_factors_equal_the_column_form():
    params = [nn.Parameter(torch.zeros(3))]
    norms = torch.tensor([[0.5], [2.0], [float("nan")], [float("inf")], [0.0]])
    for rescale in (False, True):
        clipper = PerSampleGradientClipper(params, 1.5, rescale_to_unit_norm=rescale)
        factors = clipper.clip_factors_for_norms(norms)
        mask = torch.zeros(5, dtype=torch.bool)
        assert factors.shape == (5, 1) and torch.equal(factors, clipper.clip_factors_for_norms(norms, padding_mask=mask))


def test_unconsumed_is_the_live_pending_calls_in_order():
    passes = GhostPasses()
    layer = nn.Linear(2, 2)
    uses = [Use(path=str(i), layer=layer, parts=()) for i in range(5)]
    for use in uses:
        passes.pending.add(use)
    uses[1].consumed = True
    del uses[3]
    gc.collect()
    expected = [use for use in list(passes.pending) if not use.consumed]
    assert passes.unconsumed() == expected and len(expected) == 3


def test_materialised_sums_equal_tensordot_bit_for_bit():
    """The materialised parameters' clipped sums (``_clipped_sums``: mm on tensordot's operands, shape set in place)
    are ``tensordot``'s floats, for 1-D, 2-D, 0-dim and non-contiguous per-example gradients, flat and per-layer
    weights, and none of them is a view."""
    generator = torch.Generator().manual_seed(5)
    shapes = [(4,), (4, 3), (), (3, 2, 5), (300,), (7, 1)]
    for columns in (1, 3):
        weights = torch.rand(6, columns, generator=generator)
        materialised = _materialised(shapes, batch_size=6, seed=columns)
        params = list(materialised)
        materialised[params[1]] = torch.randn(6, 3, 4, generator=generator).transpose(1, 2)
        group_of = {param: index % columns for index, param in enumerate(params)}
        expected = {
            param: torch.tensordot(weights[:, group_of[param]], grads, dims=1) for param, grads in materialised.items()
        }

        state = types.SimpleNamespace(deferred=[], rank_one_linear=None, users=None, materialised=dict(materialised))
        plan = backward._GroupPlan(group_of=group_of, groups=(), single_column=0 if columns == 1 else None)
        sums = backward._clipped_sums(state, plan, weights, False)
        assert set(sums) == set(expected)
        for param, value in sums.items():
            assert value.shape == param.shape and torch.equal(value, expected[param])
            assert value._base is None or value.dim() == 0
