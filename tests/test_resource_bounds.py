"""Settings whose memory or time grows with their value are refused up front, fast, with an error
naming the setting and its cost (issue 27, item 3)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine.engine import PrivacyEngine, limits
from privacy_engine.engine.limits import ResourceLimitError


def make_setup(num_examples: int = 40, batch_size: int = 8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = TensorDataset(torch.randn(num_examples, 6), torch.randint(0, 3, (num_examples,)))
    return model, optimizer, DataLoader(dataset, batch_size=batch_size)


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    # The first make_private of a process imports lazily (~1 s): not the cost under test.
    _make_private(noise_multiplier=1.0)


def _refused_fast(call, *names: str) -> str:
    start = time.perf_counter()
    with pytest.raises(ResourceLimitError) as info:
        call()
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    for name in names:
        assert name in message
    return message


def _make_private(**settings):
    model, optimizer, loader = make_setup()
    return PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=1.0,
                                        **settings)  # fmt: skip


def _make_private_with_epsilon(**settings):
    model, optimizer, loader = make_setup()
    settings = {"target_epsilon": 3.0, "target_delta": 1e-5, "epochs": 2, **settings}
    return PrivacyEngine().make_private_with_epsilon(module=model, optimizer=optimizer, data_loader=loader,
                                                     max_grad_norm=1.0, **settings)  # fmt: skip


def test_bandmf_total_steps_of_a_billion_is_refused_naming_steps_and_bytes():
    message = _refused_fast(
        lambda: _make_private(noise_multiplier=1.0, noise_mechanism="bandmf", total_steps=10**9),
        "total_steps=1000000000",
        "MAX_BANDMF_TOTAL_STEPS",
        "GB",
    )
    assert "80 GB" in message


def test_num_bands_over_the_limit_is_refused():
    _refused_fast(
        lambda: _make_private(noise_multiplier=1.0, noise_mechanism="bandmf", num_bands=10**6, total_steps=10**6),
        "num_bands=1000000",
        "MAX_NUM_BANDS",
    )


def test_strategy_work_over_the_limit_is_refused():
    _refused_fast(
        lambda: _make_private(noise_multiplier=1.0, noise_mechanism="bandmf", num_bands=1024, total_steps=10**6),
        "total_steps=1000000",
        "num_bands=1024",
        "MAX_STRATEGY_WORK",
    )


def test_given_coefficients_skip_the_strategy_work_limit_but_not_the_band_limit():
    with pytest.raises(ResourceLimitError, match="num_bands=2000"):
        _make_private(noise_multiplier=1.0, noise_mechanism="bandmf", bandmf_coefficients=[1.0] * 2000,
                      total_steps=10)  # fmt: skip


def test_bandmf_steps_from_epochs_are_bounded_before_any_strategy():
    _refused_fast(
        lambda: _make_private_with_epsilon(noise_mechanism="bandmf", num_bands=2, epochs=10**9),
        "epochs=1000000000",
    )


@pytest.mark.parametrize("mechanism", ["gaussian", "bandmf"])
def test_calibration_over_too_many_epochs_is_refused(mechanism):
    _refused_fast(lambda: _make_private_with_epsilon(noise_mechanism=mechanism, epochs=10**9), "epochs=1000000000",
                  "MAX_ACCOUNTED_STEPS")  # fmt: skip


def test_huge_target_epsilon_is_refused():
    _refused_fast(lambda: _make_private_with_epsilon(target_epsilon=1e6), "target_epsilon=1000000.0",
                  "MAX_TARGET_EPSILON")  # fmt: skip


def test_limits_are_read_when_checked_so_a_run_can_raise_them(monkeypatch):
    monkeypatch.setattr(limits, "MAX_TARGET_EPSILON", 1e7)
    limits.check_target_epsilon(1e6)  # no error
    monkeypatch.setattr(limits, "MAX_TARGET_EPSILON", 10.0)
    with pytest.raises(ResourceLimitError, match="target_epsilon=50.0"):
        limits.check_target_epsilon(50.0)


def test_settings_within_the_limits_still_plan():
    _make_private(noise_multiplier=1.0, noise_mechanism="bandmf", num_bands=2, total_steps=20)
    _make_private_with_epsilon(epochs=2)


def test_strategy_functions_refuse_sizes_over_their_limits_naming_the_cost():
    from privacy_engine.noise.strategy import optimize_banded_toeplitz, strategy_loss

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"n=1000000000 steps exceeds MAX_STRATEGY_STEPS.*80 GB"):
        strategy_loss([1.0, 0.5], 10**9)
    with pytest.raises(ValueError, match=r"n=1000000000 steps exceeds MAX_STRATEGY_STEPS"):
        optimize_banded_toeplitz(10**9, 4)
    with pytest.raises(ValueError, match=r"bands=1000 .*MAX_OPTIMIZATION_WORK"):
        optimize_banded_toeplitz(10**7, 1000)
    assert time.perf_counter() - start < 1.0


def test_pld_calibration_over_too_many_steps_is_refused_naming_steps():
    from accountants.calibration import calibrate_noise_multiplier

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"steps=1000000000 exceeds MAX_PLD_CALIBRATION_STEPS"):
        calibrate_noise_multiplier(3.0, 1e-5, 0.01, 10**9)
    assert time.perf_counter() - start < 1.0
