"""The clip-factor rule's fast form (``clipping.rule.clip_factors``: NaN/-Inf made +Inf, then C * 1/max(norm, C)
in place) against the rule's edge-case table written out as the formula it had (``C / clamp(norm, C)``, zero where
the norm is not finite): the same floats, signs of zero included; the end-of-pass finiteness test
(``_may_hold_non_finite``); and the cached clipping-group plan of fast clipping (``BackwardPass._group_plan``)
refusing a parameter unfrozen after a pass was planned, and rebuilt for a newly attached clipper."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from privacy_engine.clipping import PerSampleGradientClipper, parameter_groups
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.clipping.ghost import backward as ghost_backward
from privacy_engine.clipping.rule import clip_factors

EDGE_NORMS = [0.0, -0.0, 1e-38, 0.3, 0.5, 1.0, 2.0, 3.0, 7.0, 1e30, 3e38, math.nan, math.inf, -math.inf, -1.0]


def _reference(norms: torch.Tensor, bound: float, rescale: bool, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """The table of ``clip_factors``'s docstring as one formula (what the rule computed before its fast form)."""
    if bound == 0:
        factors = torch.zeros_like(norms)
    elif math.isinf(bound):
        factors = torch.ones_like(norms)
    else:
        factors = bound / torch.clamp(norms, min=bound)
        if rescale:
            factors = factors / bound
    factors = torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))
    return factors if padding_mask is None else factors.masked_fill(padding_mask, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("bound", [0.0, 0.1, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("rescale", [False, True])
def test_factors_are_the_tables_floats(dtype, bound, rescale):
    if rescale and (bound == 0 or math.isinf(bound)):
        with pytest.raises(ValueError):
            clip_factors(torch.ones(2), bound, rescale_to_unit_norm=True)
        return
    generator = torch.Generator().manual_seed(0)
    random = torch.rand(200, generator=generator) * 10.0 ** torch.randint(-4, 5, (200,), generator=generator)
    norms = torch.cat([torch.tensor(EDGE_NORMS), random]).to(dtype)
    mask = torch.rand(norms.shape[0], generator=generator) > 0.8
    given = norms.clone()
    for padding_mask in (None, mask):
        expected = _reference(norms, bound, rescale, padding_mask)
        factors = clip_factors(norms, bound, rescale_to_unit_norm=rescale, padding_mask=padding_mask)
        assert factors.dtype == expected.dtype
        assert torch.equal(factors, expected)  # NaN would fail: every non-finite norm must give 0
        assert torch.equal(torch.signbit(factors), torch.signbit(expected))
    assert torch.equal(norms.nan_to_num(), given.nan_to_num())  # computed in place, but not in the caller's norms


def test_integer_norms_give_the_default_float_dtype():
    norms = torch.tensor([0, 1, 2, 5])
    assert torch.equal(clip_factors(norms, 2.0), 2.0 / torch.clamp(norms, min=2.0))


def test_non_finite_test_sees_every_nan_and_inf():
    may_hold = ghost_backward._may_hold_non_finite
    assert not may_hold(torch.tensor([[0.0], [1.0], [3e38]]))
    for bad in (math.nan, math.inf, -math.inf):
        assert may_hold(torch.tensor([[0.5], [bad], [2.0]]))
    # A sum that overflows with finite norms only zeroes rows needlessly (conservative).
    assert may_hold(torch.tensor([[3e38], [3e38]]))


def _pass(wrapped: GhostClippingModule, clipper: PerSampleGradientClipper, inputs: torch.Tensor) -> torch.Tensor:
    wrapped(inputs).square().sum().backward()
    clipper.pre_step()
    return wrapped.last_per_sample_norms


def test_cached_group_plan_still_refuses_a_parameter_unfrozen_later_and_follows_a_new_clipper():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    clipper = PerSampleGradientClipper(params, 1.0)
    wrapped = GhostClippingModule(model, clipper=clipper)
    inputs = torch.randn(5, 3)
    flat = _pass(wrapped, clipper, inputs)
    assert flat.shape == (5, 1)
    assert torch.equal(_pass(wrapped, clipper, inputs), flat)  # the second pass takes the cached plan
    # A parameter unfrozen after the plan was made is refused as before (another parameter set: a new plan).
    model[0].bias.requires_grad_(True)
    with pytest.raises(ValueError, match="not held by the clipper"):
        wrapped(inputs).square().sum().backward()
    model[0].bias.requires_grad_(False)
    # A new clipper with other groups: its own plan (one column per layer), the same norms as a fresh wrapper's.
    per_layer = PerSampleGradientClipper(params, 1.0, clipping="per_layer", groups=parameter_groups(model, params))
    wrapped.attach_clipper(per_layer)
    norms = _pass(wrapped, per_layer, inputs)
    assert norms.shape == (5, per_layer.num_groups) and per_layer.num_groups > 1
    copied = copy.deepcopy(model)
    copied_params = [p for p in copied.parameters() if p.requires_grad]
    fresh_clipper = PerSampleGradientClipper(
        copied_params, 1.0, clipping="per_layer", groups=parameter_groups(copied, copied_params)
    )
    assert torch.equal(_pass(GhostClippingModule(copied, clipper=fresh_clipper), fresh_clipper, inputs), norms)
    assert torch.allclose(norms.square().sum(1).sqrt(), flat[:, 0])
