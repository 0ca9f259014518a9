"""torch.compile of a wrapped model: it runs and gives exactly the eager per-sample gradients.

Compiling costs 10-80 s on a 2-core CPU for the tiny model below, so these tests run only with
PRIVACY_ENGINE_TEST_COMPILE=1 (README "torch.compile" says what compiles and what does not).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import ATOL, RTOL, assert_matches_reference, per_example_reference
from torch import nn

from privacy_engine import GhostClippingModule, GradSampleModule, PerSampleGradientClipper

pytestmark = pytest.mark.skipif(
    os.environ.get("PRIVACY_ENGINE_TEST_COMPILE") != "1",
    reason="torch.compile takes a minute here; set PRIVACY_ENGINE_TEST_COMPILE=1 to run",
)


def _model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 3)).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0, 1])
    reference = per_example_reference(model, [x], lambda out, i: nn.functional.cross_entropy(out, labels[i : i + 1]))
    return model, x, labels, reference


def test_compiled_hooks_mode_is_exact() -> None:
    model, x, labels, reference = _model_and_batch()
    compiled = torch.compile(GradSampleModule(model))
    for _ in range(2):  # the first call compiles (and runs the first-backward check), the second reuses
        for param in model.parameters():
            param.grad, param.grad_sample = None, None
        nn.functional.cross_entropy(compiled(x), labels).backward()
        assert_matches_reference(model, reference)


def test_compiled_ghost_mode_is_exact() -> None:
    model, x, labels, reference = _model_and_batch()
    norms = torch.cat([g.flatten(1) for g in reference.values()], dim=1).norm(dim=1)
    bound = float(norms.median())
    factors = (bound / norms).clamp(max=1.0)
    clipper = PerSampleGradientClipper(list(model.parameters()), max_grad_norm=bound)
    compiled = torch.compile(GhostClippingModule(model, clipper=clipper))
    for _ in range(2):
        nn.functional.cross_entropy(compiled(x), labels).backward()
        clipper.pre_step()
        for name, param in model.named_parameters():
            expected = torch.einsum("b,b...->...", factors, reference[name])
            torch.testing.assert_close(param.grad, expected, rtol=RTOL, atol=ATOL)


class _TwoLayers(nn.Module):
    """A model class of its own: torch.compile keeps compiled code per class (on ``forward``'s code object)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _compile_plain_model_of_the_class(x: torch.Tensor, labels: torch.Tensor) -> None:
    plain = torch.compile(_TwoLayers().double())
    nn.functional.cross_entropy(plain(x), labels).backward()


@pytest.mark.slow
def test_hooks_mode_names_code_compiled_for_a_plain_model_of_the_class() -> None:
    """Compiling a plain model, then a private model of the same class in hooks mode: torch reuses the plain
    model's compiled forward, which runs without the engine's hooks. The error says so and names
    torch.compiler.reset(); after it, the compiled private model gives the eager per-sample gradients."""
    from privacy_engine import ParameterUsageError

    torch.compiler.reset()
    try:
        torch.manual_seed(0)
        x = torch.randn(5, 6, dtype=torch.float64)
        labels = torch.tensor([0, 1, 2, 0, 1])
        _compile_plain_model_of_the_class(x, labels)
        with pytest.raises(ParameterUsageError, match=r"_TwoLayers\.forward.*torch\.compiler\.reset\(\)"):
            nn.functional.cross_entropy(torch.compile(GradSampleModule(_TwoLayers().double()))(x), labels).backward()

        torch.compiler.reset()
        model = _TwoLayers().double()
        reference = per_example_reference(model, [x], lambda out, i: nn.functional.cross_entropy(out, labels[i : i + 1]))
        nn.functional.cross_entropy(torch.compile(GradSampleModule(model))(x), labels).backward()
        assert_matches_reference(model, reference)
    finally:
        torch.compiler.reset()


@pytest.mark.slow
def test_ghost_mode_after_a_plain_model_of_the_class_was_compiled_is_exact() -> None:
    """Fast clipping replaces each layer's forward on the instance, so torch's guards reject the plain model's
    compiled code: no reset needed, the norms are the per-example loop's."""
    torch.compiler.reset()
    try:
        torch.manual_seed(0)
        x = torch.randn(5, 6, dtype=torch.float64)
        labels = torch.tensor([0, 1, 2, 0, 1])
        _compile_plain_model_of_the_class(x, labels)
        model = _TwoLayers().double()
        reference = per_example_reference(model, [x], lambda out, i: nn.functional.cross_entropy(out, labels[i : i + 1]))
        private = GhostClippingModule(model, clipper=PerSampleGradientClipper(list(model.parameters()), max_grad_norm=1.0))
        nn.functional.cross_entropy(torch.compile(private)(x), labels).backward()
        norms = torch.cat([g.flatten(1) for g in reference.values()], dim=1).norm(dim=1)
        torch.testing.assert_close(private.last_per_sample_norms.flatten(), norms, rtol=RTOL, atol=ATOL)
    finally:
        torch.compiler.reset()
