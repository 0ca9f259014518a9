"""Strategy loss and optimiser against dense float64 linear algebra and known optima."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy_engine.noise import BandMFNoise
from privacy_engine.noise.strategy import (
    expected_error,
    optimize_banded_toeplitz,
    strategy_loss,
)


def dense_loss(coefficients, n, *, column_normalized=False):
    """max column norm(C)^2 * mean_i ||row_i(A C^{-1})||^2 with the n x n matrices."""
    strategy = np.zeros((n, n))
    for lag, value in enumerate(np.asarray(coefficients, dtype=np.float64)[:n]):
        strategy += value * np.eye(n, k=-lag)
    column_norms = np.linalg.norm(strategy, axis=0)
    if column_normalized:
        strategy = strategy * (column_norms.max() / column_norms)
        column_norms = np.linalg.norm(strategy, axis=0)
    workload = np.tril(np.ones((n, n)))
    product = workload @ np.linalg.inv(strategy)
    return column_norms.max() ** 2 * np.mean(np.sum(product**2, axis=1))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    bands=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
    column_normalized=st.booleans(),
)
def test_loss_equals_dense_computation(n, bands, seed, column_normalized):
    rng = np.random.default_rng(seed)
    coefficients = np.concatenate([[0.5 + rng.random()], 0.4 * rng.standard_normal(bands - 1)])
    expected = dense_loss(coefficients, n, column_normalized=column_normalized)
    actual = strategy_loss(coefficients, n, column_normalized=column_normalized)
    assert actual == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_single_band_loss_is_half_of_n_plus_one(n):
    assert strategy_loss([3.0], n) == pytest.approx((n + 1) / 2, rel=1e-12)
    coefficients = optimize_banded_toeplitz(n, 1)
    np.testing.assert_array_equal(coefficients, [1.0])


@pytest.mark.parametrize(("n", "bands", "known"), [(128, 4, 19.045234), (1024, 16, 40.231028)])
def test_optimiser_reaches_known_optimal_losses(n, bands, known):
    coefficients = optimize_banded_toeplitz(n, bands)
    assert strategy_loss(coefficients, n) == pytest.approx(known, rel=1e-5)


@pytest.mark.parametrize(("n", "bands"), [(50, 2), (200, 8), (64, 64), (300, 30)])
def test_optimiser_returns_a_normalised_local_minimum(n, bands):
    coefficients = optimize_banded_toeplitz(n, bands)
    assert coefficients.dtype == np.float64
    assert coefficients.shape == (bands,)
    assert np.linalg.norm(coefficients) == pytest.approx(1.0, rel=1e-12)
    assert coefficients[0] > 0
    best = strategy_loss(coefficients, n)
    # No random nearby strategy is better (scale is irrelevant, so perturb relative to c_0).
    rng = np.random.default_rng(n + bands)
    for _ in range(20):
        perturbed = coefficients + 1e-3 * rng.standard_normal(bands)
        assert strategy_loss(perturbed, n) >= best * (1 - 1e-12)
    # And it beats DP-SGD and the truncated square root of A it starts from.
    assert best <= (n + 1) / 2
    start = np.cumprod(np.concatenate([[1.0], (2 * np.arange(1, bands) - 1) / (2 * np.arange(1, bands))]))
    assert best <= strategy_loss(start, n)


def test_loss_is_scale_invariant_and_ignores_bands_beyond_n():
    coefficients = np.array([1.0, 0.4, 0.1, 0.05])
    assert strategy_loss(7.0 * coefficients, 30) == pytest.approx(strategy_loss(coefficients, 30), rel=1e-12)
    assert strategy_loss(coefficients, 2) == pytest.approx(dense_loss(coefficients, 2), rel=1e-12)


def test_expected_error_matches_simulated_bandmf_prefix_sum_error():
    """The loss is the error the noise mechanism actually produces: simulate BandMF noise,
    take prefix sums (what SGD's iterates accumulate), and average the squared error."""
    n, entries, noise_multiplier, max_grad_norm = 24, 20_000, 1.3, 0.5
    coefficients = optimize_banded_toeplitz(n, 4)
    mechanism = BandMFNoise(coefficients, seed=99)
    noise = np.zeros((n, entries))
    for step in range(n):
        tensors = [torch.zeros(entries, dtype=torch.float64)]
        mechanism.add_noise_(tensors, noise_multiplier, max_grad_norm)
        noise[step] = tensors[0].numpy()
    simulated = np.mean(np.cumsum(noise, axis=0) ** 2)
    predicted = expected_error(coefficients, n, noise_multiplier, max_grad_norm=max_grad_norm)
    assert predicted == pytest.approx(strategy_loss(coefficients, n) * (noise_multiplier * max_grad_norm) ** 2)
    # Relative standard error of the mean of n*M squared Gaussians is below sqrt(2/M); allow 5x.
    assert simulated == pytest.approx(predicted, rel=5 * np.sqrt(2 / entries))


def test_expected_error_edge_cases():
    assert expected_error([1.0, 0.5], 10, 0.0) == 0.0
    with pytest.raises(ValueError, match="noise_multiplier"):
        expected_error([1.0], 10, -1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        expected_error([1.0], 10, 1.0, max_grad_norm=float("inf"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0, "bands": 1}, "n must"),
        ({"n": 10, "bands": 0}, "bands"),
        ({"n": 10, "bands": 11}, "bands=11 exceeds"),
        ({"n": 10, "bands": 2, "max_iterations": 0}, "max_iterations"),
        ({"n": 10, "bands": 2, "tolerance": 0.0}, "tolerance"),
        ({"n": 2.5, "bands": 1}, "n must"),
    ],
)
def test_optimiser_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimize_banded_toeplitz(**kwargs)


@pytest.mark.parametrize("coefficients", [[], [0.0, 1.0], [1.0, np.nan], [[1.0]]])
def test_loss_rejects_bad_coefficients(coefficients):
    with pytest.raises(ValueError, match="coefficients"):
        strategy_loss(coefficients, 5)
