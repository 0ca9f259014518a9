"""The step's Python made cheaper (issue 25, round 3) refuses and computes exactly what it did before.

* ``NoiseMechanism._validated_noise_scale`` returns two positive finite floats' product at once: the value the
  settings' checks return, and everything else still goes through (and is refused by) those checks;
* ``noise.mechanism._divide_`` multiplies float32 / float64 CPU tensors by the exact reciprocal of a power of two
  (the bits of the division) and keeps the 0-dim divisor tensor of the last divisor;
* ``DPOptimizer.step`` and ``NoiseMechanism.add_noise_`` set grad mode off and restore it as ``torch.no_grad()`` does.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from privacy_engine.noise import GaussianNoise
from privacy_engine.noise.mechanism import NoiseMechanism, _divide_, _divisor_tensor
from privacy_engine.settings_checks import check_max_grad_norm, check_noise_multiplier, check_noise_std
from privacy_engine.training.optimizer import DPOptimizer


def test_the_fast_noise_scale_is_the_checked_one_and_refusals_still_raise() -> None:
    for sigma in (1e-300, 0.3, 1.0, 7.25, 1e150):
        for bound in (1e-300, 0.5, 1.0, 3.0, 1e150):
            reference = check_noise_std(check_noise_multiplier(sigma), check_max_grad_norm(bound))
            assert NoiseMechanism._validated_noise_scale(sigma, bound) == reference
    assert NoiseMechanism._validated_noise_scale(0.0, math.inf) == 0.0
    assert NoiseMechanism._validated_noise_scale(2, 3) == 6.0
    for sigma, bound in ((1.0, math.inf), (math.nan, 1.0), (1.0, math.nan), (-1.0, 1.0), (1.0, -1.0)):
        with pytest.raises(ValueError):
            NoiseMechanism._validated_noise_scale(sigma, bound)
    with pytest.raises(TypeError):
        NoiseMechanism._validated_noise_scale(True, 1.0)


def test_divide_by_a_power_of_two_gives_the_bits_of_the_division_in_every_dtype() -> None:
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        tensors = [torch.randn(n, generator=generator).mul(1e3).to(dtype) for n in (1, 5, 33)]
        tensors.append(torch.tensor([math.nan, math.inf, -0.0, 1e-45, 3e38], dtype=torch.float32).to(dtype))
        for divisor in (8.0, 256.0, 0.5, 2.0**-60, 2.0**60, 6.0):
            ours, reference = [t.clone() for t in tensors], [t.clone() for t in tensors]
            _divide_(ours, divisor)
            torch._foreach_div_(reference, divisor)
            for a, b in zip(ours, reference):
                assert a.dtype == b.dtype and a.view(torch.uint8).equal(b.view(torch.uint8)), (dtype, divisor)


def test_the_divisor_tensor_is_kept_for_an_equal_divisor_only() -> None:
    first = _divisor_tensor(100.5)
    assert _divisor_tensor(100.5) is first and first.dtype == torch.float64 and first.item() == 100.5
    other = _divisor_tensor(3.0)
    assert other is not first and other.item() == 3.0
    assert _divisor_tensor(3) is not other and _divisor_tensor(3).item() == 3.0  # an int is not kept


@pytest.mark.parametrize("grad", [True, False])
def test_add_noise_restores_the_grad_mode_it_found(grad: bool) -> None:
    mechanism = GaussianNoise(seed=0)
    tensors = [torch.zeros(3), torch.zeros(2, 2)]
    modes: list[bool] = []
    for divide_by in (4.0, None):
        with torch.set_grad_enabled(grad):
            mechanism.add_noise_(tensors, 1.0, 1.0, divide_by=divide_by,
                                 on_commit=lambda: modes.append(torch.is_grad_enabled()))  # fmt: skip
            assert torch.is_grad_enabled() is grad
    assert modes == [False, False]  # the commit ran without grad, as under torch.no_grad()
    with torch.set_grad_enabled(grad), pytest.raises(ZeroDivisionError):
        mechanism.add_noise_(tensors, 1.0, 1.0, on_commit=lambda: 1 / 0)
    assert torch.is_grad_enabled()  # (outside the block again)
    assert mechanism.step == 2  # the failed step was undone


def test_step_runs_without_grad_and_restores_grad_mode() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=4)  # fmt: skip
    seen: list[bool] = []
    optimizer.attach_step_hook(lambda _: seen.append(torch.is_grad_enabled()))
    for param in model.parameters():
        param.grad_sample = torch.randn(4, *param.shape)
    assert torch.is_grad_enabled()
    optimizer.step()
    assert torch.is_grad_enabled() and seen == [False] and optimizer.steps_taken == 1
