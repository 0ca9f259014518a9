"""The fast-clipping gate (``clipping/ghost/gate.py``): its parameters are inputs of every gate, so a backward
restricted to a parameter clips what it reaches as hooks mode does; an input that needs a gradient (a user's
leaf) gives the same clipped sums, norms and input gradient as one that does not, and both equal the float64
per-example loop. The per-call shortcuts keep refusing what they refused."""

from __future__ import annotations

import pytest
import torch
from conftest import per_example_reference
from torch import nn

from privacy_engine import ParameterUsageError
from privacy_engine.clipping import PerSampleGradientClipper
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.clipping.ghost.uses import Use, shared_parameters
from privacy_engine.clipping.rule import clip_factors

MAX_GRAD_NORM = 0.3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()


def _ghost_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    wrapped = GhostClippingModule(model, loss_reduction="sum")
    clipper = PerSampleGradientClipper(list(model.parameters()), MAX_GRAD_NORM)
    wrapped.attach_clipper(clipper)
    ((wrapped(x) - y) ** 2).sum().backward()
    clipper.pre_step()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, wrapped.last_per_sample_norms


@pytest.mark.parametrize("reached", ["2.weight", "0.weight"])
def test_backward_restricted_to_a_parameter_clips_what_it_reaches_as_hooks_mode_does(reached):
    """``loss.backward(inputs=[param])`` reaches the gate of ``param``'s layer (the parameters are inputs of every
    gate): that pass's clipped sums are hooks mode's, never an empty release."""
    from privacy_engine import GradSampleModule

    torch.manual_seed(2)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    released = {}
    for mode in ("ghost", "hooks"):
        model = _model()
        clipper = PerSampleGradientClipper(list(model.parameters()), MAX_GRAD_NORM)
        if mode == "ghost":
            wrapped = GhostClippingModule(model, clipper=clipper, loss_reduction="sum")
        else:
            wrapped = GradSampleModule(model)
        target = dict(model.named_parameters())[reached]
        ((wrapped(x) - y) ** 2).sum().backward(inputs=[target])
        if mode == "hooks":
            clipper.clip_and_accumulate()
        clipper.pre_step()
        released[mode] = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    assert released["ghost"][reached] is not None and released["ghost"][reached].abs().sum() > 0
    for name, hooks_grad in released["hooks"].items():
        ghost_grad = released["ghost"][name]
        if hooks_grad is None or ghost_grad is None:
            assert (hooks_grad is None or not hooks_grad.any()) and (ghost_grad is None or not ghost_grad.any()), name
        else:
            torch.testing.assert_close(ghost_grad, hooks_grad, rtol=1e-12, atol=1e-15)


def test_an_input_that_needs_a_gradient_changes_no_result():
    torch.manual_seed(1)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    sums, norms = _ghost_step(_model(), x, y)
    leaf = x.clone().requires_grad_(True)
    sums_leaf, norms_leaf = _ghost_step(_model(), leaf, y)
    for name in sums:
        assert torch.equal(sums[name], sums_leaf[name]), name
    assert torch.equal(norms, norms_leaf)
    # The input's own gradient is the ordinary (unclipped) one.
    plain_leaf = x.clone().requires_grad_(True)
    ((_model()(plain_leaf) - y) ** 2).sum().backward()
    torch.testing.assert_close(leaf.grad, plain_leaf.grad, rtol=1e-12, atol=0)
    # And both equal the per-example loop.
    per_sample = per_example_reference(_model(), (x,), lambda out, i: ((out - y[i : i + 1]) ** 2).sum())
    loop_norms = torch.sqrt(sum(g.flatten(1).square().sum(dim=1) for g in per_sample.values()))
    factors = clip_factors(loop_norms, MAX_GRAD_NORM)
    torch.testing.assert_close(norms_leaf.flatten(), loop_norms, rtol=1e-10, atol=0)
    for name, grads in per_sample.items():
        torch.testing.assert_close(sums_leaf[name], torch.tensordot(factors, grads, dims=1), rtol=1e-10, atol=1e-14)


class _ReadsWeightOutside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3)

    def forward(self, x):
        # A read of the second layer's weight outside its forward must reach the weight's hook and be refused.
        return self.second(self.first(x)) + x @ self.second.weight


def test_a_parameter_read_outside_its_layer_is_refused():
    model = _ReadsWeightOutside()
    wrapped = GhostClippingModule(model, clipper=PerSampleGradientClipper(list(model.parameters()), 1.0))
    with pytest.raises(ParameterUsageError, match="'second.weight'"):
        wrapped(torch.randn(2, 3)).sum().backward()
    assert model.second.weight.grad is None


def test_a_parameter_frozen_between_steps_is_not_gated_at_the_next_forward():
    model = _model()
    clipper = PerSampleGradientClipper(list(model.parameters()), MAX_GRAD_NORM)
    wrapped = GhostClippingModule(model, clipper=clipper)
    x = torch.randn(4, 3, dtype=torch.float64)
    wrapped(x).sum().backward()
    model[2].weight.requires_grad_(False)
    out = wrapped(x)
    uses = [use for use in wrapped._pending if not use.consumed and use.layer is model[2]]
    assert [tuple(p.shape) for use in uses for p, _ in use.parts] == [(4,)]  # the bias alone
    out.sum().backward()


def test_shared_parameters_by_identity():
    layer = nn.Linear(4, 3)
    weight, bias = layer.weight, layer.bias

    def use(*parts):
        return Use(path="", layer=layer, parts=parts)

    assert shared_parameters([use((weight, None), (bias, None))]) == set()
    assert shared_parameters([use((weight, None)), use((weight, None), (bias, None))]) == {weight}
    assert shared_parameters([use((weight, slice(0, 2))), use((weight, slice(2, 3)))]) == set()
    assert shared_parameters([use((weight, slice(0, 2))), use((weight, slice(1, 3)))]) == {weight}
    assert shared_parameters([use((weight, slice(0, 2))), use((bias, None)), use((weight, None))]) == {weight}
