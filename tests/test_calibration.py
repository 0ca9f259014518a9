"""calibrate_noise_multiplier: the target is met (checked independently), tightly, like dp-accounting."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accountants import (
    CalibrationError,
    PLDAccountant,
    RDPAccountant,
    calibrate_noise_multiplier,
)
from accountants import calibration as calibration_module

FAST_GRID = 1e-3
DELTA = 1e-5
# Integer orders (and 1.5) only: dp-accounting's fractional orders are slow to evaluate, and the
# search logic under test does not depend on the order set.
FAST_ORDERS = [1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0, 128.0]


def fast_pld() -> PLDAccountant:
    return PLDAccountant(value_discretization_interval=FAST_GRID)


def reference_epsilon(
    make_dp_accountant,
    sigma,
    q,
    steps,
    *,
    num_bands=1,
    group_size=None,
    max_batch_size=None,
    delta=DELTA,
):
    """dp-accounting's epsilon for the mechanism, with the event built by hand."""
    participations = math.ceil(steps / num_bands)
    if group_size is None:
        inner = dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(sigma)
        )
    else:
        inner = dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=group_size,
            sampling_probability=q,
            truncated_batch_size=max_batch_size,
            noise_multiplier=sigma,
        )
    event = dp_accounting.SelfComposedDpEvent(inner, participations)
    return make_dp_accountant().compose(event).get_epsilon(delta)


def fast_pld_reference():
    return dp_accounting.pld.PLDAccountant(value_discretization_interval=FAST_GRID)


CASES = [
    # target epsilon, q, steps, extra mechanism arguments
    pytest.param(2.0, 0.02, 200, {}, id="dpsgd"),
    pytest.param(0.5, 0.1, 20, {}, id="dpsgd-small-eps"),
    pytest.param(6.0, 0.05, 120, {"num_bands": 4}, id="bandmf"),
    pytest.param(
        2.0,
        0.05,
        40,
        {"num_bands": 2, "group_size": 600, "max_batch_size": 32},
        id="truncated",
    ),
]


@pytest.mark.parametrize("target, q, steps, extra", CASES)
def test_sigma_meets_target_and_is_tight(target, q, steps, extra):
    sigma = calibrate_noise_multiplier(
        target, DELTA, q, steps, accountant=fast_pld(), **extra
    )
    assert reference_epsilon(fast_pld_reference, sigma, q, steps, **extra) <= target
    assert (
        reference_epsilon(fast_pld_reference, 0.99 * sigma, q, steps, **extra) > target
    )


def test_default_accountant_is_default_pld_and_target_is_met():
    sigma = calibrate_noise_multiplier(1.5, DELTA, 0.05, 30)
    assert reference_epsilon(dp_accounting.pld.PLDAccountant, sigma, 0.05, 30) <= 1.5


@pytest.mark.parametrize(
    "accountant, make_reference",
    [
        (fast_pld, fast_pld_reference),
        (
            lambda: RDPAccountant(FAST_ORDERS),
            lambda: dp_accounting.rdp.RdpAccountant(FAST_ORDERS),
        ),
    ],
    ids=["pld", "rdp"],
)
def test_agrees_with_dp_accounting_calibrate_dp_mechanism(accountant, make_reference):
    target, q, steps = 3.0, 0.04, 60
    ours = calibrate_noise_multiplier(target, DELTA, q, steps, accountant=accountant())
    theirs = dp_accounting.calibrate_dp_mechanism(
        make_reference,
        lambda sigma: dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(sigma)
            ),
            steps,
        ),
        target,
        DELTA,
    )
    assert ours == pytest.approx(theirs, rel=0.01)
    assert reference_epsilon(make_reference, ours, q, steps) <= target


@settings(max_examples=8, deadline=None)
@given(
    target=st.floats(0.3, 10.0),
    q=st.floats(0.002, 0.05),
    steps=st.integers(1, 2000),
    delta=st.sampled_from([1e-4, 1e-6]),
)
def test_rdp_sigma_meets_target_and_is_tight(target, q, steps, delta):
    def reference():
        return dp_accounting.rdp.RdpAccountant(orders=FAST_ORDERS)

    try:
        sigma = calibrate_noise_multiplier(
            target, delta, q, steps, accountant=RDPAccountant(FAST_ORDERS)
        )
    except CalibrationError as error:
        # Only a genuinely loose target may be refused: noise 0.1 must already meet it.
        assert not error.unreachable
        assert reference_epsilon(reference, 0.1, q, steps, delta=delta) <= target
        return
    assert reference_epsilon(reference, sigma, q, steps, delta=delta) <= target
    if sigma > 0.1:  # 0.1 is the bottom of the search range: a loose target is not tightened
        assert reference_epsilon(reference, 0.99 * sigma, q, steps, delta=delta) > target


def test_bandmf_sigma_equals_dpsgd_sigma_for_ceil_steps_over_bands():
    bandmf = calibrate_noise_multiplier(
        2.0, DELTA, 0.05, 50, num_bands=4, accountant=fast_pld()
    )
    dpsgd = calibrate_noise_multiplier(2.0, DELTA, 0.05, 13, accountant=fast_pld())
    assert bandmf == dpsgd


def test_full_batch_tiny_epsilon():
    sigma = calibrate_noise_multiplier(0.01, DELTA, 1.0, 10)
    assert reference_epsilon(dp_accounting.pld.PLDAccountant, sigma, 1.0, 10) <= 0.01
    # Full-batch Gaussian: dp-accounting's exact Gaussian composition is a lower bound.
    assert dp_accounting.get_epsilon_gaussian(sigma / math.sqrt(10), DELTA) <= 0.01


def test_result_is_verified_even_when_the_search_heuristics_mislead(monkeypatch):
    # A grid far too coarse for this event (epsilon off by tens of %) and a bad first guess.
    monkeypatch.setattr(calibration_module, "_coarse_grids", lambda *args: [0.05])
    monkeypatch.setattr(calibration_module, "_initial_guess", lambda *args: 50.0)
    sigma = calibrate_noise_multiplier(1.0, DELTA, 0.02, 100, accountant=fast_pld())
    assert reference_epsilon(fast_pld_reference, sigma, 0.02, 100) <= 1.0
    assert reference_epsilon(fast_pld_reference, 0.99 * sigma, 0.02, 100) > 1.0


@pytest.mark.parametrize("kwargs", [{"steps": 0}, {"sample_rate": 0.0}])
def test_nothing_sampled_needs_no_noise(kwargs):
    arguments = {
        "target_epsilon": 1.0,
        "target_delta": DELTA,
        "sample_rate": 0.1,
        "steps": 10,
        **kwargs,
    }
    assert calibrate_noise_multiplier(**arguments) == 0.0


def test_unreachable_target_is_a_bracket_failure():
    with pytest.raises(CalibrationError, match="unreachable.*bracket failure") as info:
        calibrate_noise_multiplier(1e-9, DELTA, 1.0, 100)
    assert isinstance(info.value, ValueError) and info.value.unreachable


def test_too_loose_target_returns_the_bottom_of_the_range_verified():
    sigma = calibrate_noise_multiplier(1000.0, DELTA, 0.01, 10, accountant=fast_pld())
    assert sigma == 0.1
    reference = fast_pld_reference()
    reference.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(sigma)), 10
        )
    )
    assert reference.get_epsilon(DELTA) <= 1000.0


def test_rdp_with_truncation_names_pld():
    with pytest.raises(NotImplementedError, match="PLDAccountant"):
        calibrate_noise_multiplier(
            1.0, DELTA, 0.01, 10, accountant="rdp", group_size=1000, max_batch_size=20
        )


def test_accountant_with_history_is_refused():
    accountant = fast_pld()
    accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match="accountant must be empty"):
        calibrate_noise_multiplier(1.0, DELTA, 0.01, 10, accountant=accountant)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"target_epsilon": 0.0}, ValueError, "target_epsilon"),
        ({"target_epsilon": math.inf}, ValueError, "target_epsilon"),
        ({"target_delta": 0.0}, ValueError, "target_delta"),
        ({"target_delta": 1.5}, ValueError, "target_delta"),
        ({"sample_rate": 1.5}, ValueError, "sample_rate"),
        ({"steps": -3}, ValueError, "steps"),
        ({"steps": 3.5}, TypeError, "steps"),
        ({"num_bands": 0}, ValueError, "num_bands"),
        ({"group_size": 100}, ValueError, "max_batch_size"),
        ({"tolerance": 0.0}, ValueError, "tolerance"),
        ({"accountant": "gdp"}, ValueError, "accountant"),
        ({"accountant": 3}, TypeError, "accountant"),
    ],
)
def test_bad_input_raises_naming_the_argument(kwargs, error, name):
    arguments = {
        "target_epsilon": 1.0,
        "target_delta": DELTA,
        "sample_rate": 0.01,
        "steps": 10,
        **kwargs,
    }
    with pytest.raises(error, match=name):
        calibrate_noise_multiplier(**arguments)
