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
