"""``privacy_engine.per_sample_gradients``: the per-sample gradients a wrapper captured, by parameter
name, equal to a float64 per-example loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privacy_engine import GradSampleModule, per_sample_gradients


def _model(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 7), nn.Tanh(), nn.LayerNorm(7), nn.Linear(7, 3)).double()


def _per_example_loop(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each example's gradient of its own loss, one backward per example (the reference)."""
    rows: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
    for x, y in zip(inputs, targets):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[None]), y[None], reduction="sum").backward()
        for name, param in model.named_parameters():
            rows[name].append(param.grad.clone())
    model.zero_grad()
    return {name: torch.stack(grads) for name, grads in rows.items()}


@pytest.mark.parametrize("seed", range(3))
def test_named_per_sample_gradients_equal_a_float64_per_example_loop(seed):
    generator = torch.Generator().manual_seed(seed)
    batch, width = (int(v) for v in torch.randint(1, 9, (2,), generator=generator))
    torch.manual_seed(seed)
    model = _model(width)
    inputs = torch.randn(batch, width, dtype=torch.float64, generator=generator)
    targets = torch.randint(0, 3, (batch,), generator=generator)
    expected = _per_example_loop(model, inputs, targets)

    wrapped = GradSampleModule(model, loss_reduction="sum")
    nn.functional.cross_entropy(wrapped(inputs), targets, reduction="sum").backward()
    found = per_sample_gradients(model)

    assert list(found) == [name for name, _ in model.named_parameters()]  # the model's own names, in order
    for name, grads in expected.items():
        assert found[name].shape == (batch, *dict(model.named_parameters())[name].shape)
        torch.testing.assert_close(found[name], grads, rtol=1e-10, atol=1e-12)


def test_frozen_parameters_and_cleared_gradients_are_left_out():
    model = _model(4)
    model[0].requires_grad_(False)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    wrapped(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
    assert sorted(per_sample_gradients(model)) == ["2.bias", "2.weight", "3.bias", "3.weight"]
    wrapped.zero_grad()
    assert per_sample_gradients(model) == {}


def test_a_model_never_run_through_a_wrapper_has_none():
    model = _model(4)
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    assert per_sample_gradients(model) == {}
