"""Noise mechanisms against dense float64 linear algebra and Gaussian statistics."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy_engine.noise import BandMFNoise, GaussianNoise

SHAPES = [(3, 2), (4,), (1, 1, 2)]  # 12 entries in all


def zeros(shapes=SHAPES, dtype=torch.float64):
    return [torch.zeros(shape, dtype=dtype) for shape in shapes]


def flat(tensors):
    return torch.cat([t.reshape(-1).double() for t in tensors])


def run_steps(mechanism, steps, noise_multiplier=1.0, max_grad_norm=1.0, shapes=SHAPES, dtype=torch.float64):
    """Noise of each step as rows of a (steps, total_numel) float64 array."""
    rows = []
    for _ in range(steps):
        tensors = zeros(shapes, dtype)
        mechanism.add_noise_(tensors, noise_multiplier, max_grad_norm)
        rows.append(flat(tensors).numpy())
    return np.stack(rows)


def toeplitz_strategy(coefficients, n):
    strategy = np.zeros((n, n))
    for lag, value in enumerate(coefficients[:n]):
        strategy += value * np.eye(n, k=-lag)
    return strategy


def random_coefficients(rng, bands):
    return np.concatenate([[0.5 + rng.random()], 0.6 * rng.standard_normal(bands - 1)])


def gaussian_draws(seed, steps, std, shapes=SHAPES):
    """Z with iid N(0, std^2) rows, drawn with the same seed: GaussianNoise at sigma*C = std."""
    return run_steps(GaussianNoise(seed=seed), steps, 1.0, std, shapes=shapes)


@settings(max_examples=20, deadline=None)
@given(
    bands=st.integers(1, 6),
    steps=st.integers(1, 10),
    shapes=st.lists(st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_bandmf_stream_equals_dense_inverse_strategy_times_z(bands, steps, shapes, seed):
    rng = np.random.default_rng(seed)
    coefficients = random_coefficients(rng, bands)
    noise_multiplier, max_grad_norm = 0.7, 1.3
    mechanism = BandMFNoise(coefficients, seed=seed)
    streamed = run_steps(mechanism, steps, noise_multiplier, max_grad_norm, shapes=shapes)
    std = noise_multiplier * max_grad_norm * np.linalg.norm(coefficients)
    z = gaussian_draws(seed, steps, std, shapes)
    dense = np.linalg.solve(toeplitz_strategy(coefficients, steps), z)
    np.testing.assert_allclose(streamed, dense, rtol=1e-9, atol=1e-9)
    assert mechanism.step == steps


@pytest.mark.parametrize(("bands", "steps"), [(3, 10), (4, 3), (1, 5)])
def test_column_normalized_stream_equals_dense_normalized_strategy(bands, steps):
    rng = np.random.default_rng(bands)
    coefficients = random_coefficients(rng, bands)
    mechanism = BandMFNoise(coefficients, seed=7, column_normalize_for_steps=steps)
    streamed = run_steps(mechanism, steps)
    strategy = toeplitz_strategy(coefficients, steps)
    sensitivity = np.linalg.norm(coefficients)
    # Every column rescaled to norm ||c||: sensitivity unchanged, tail columns boosted.
    normalized = strategy * (sensitivity / np.linalg.norm(strategy, axis=0))
    assert np.linalg.norm(normalized, axis=0).max() == pytest.approx(sensitivity)
    z = gaussian_draws(7, steps, sensitivity)
    np.testing.assert_allclose(streamed, np.linalg.solve(normalized, z), rtol=1e-10, atol=1e-10)
    with pytest.raises(RuntimeError, match="column_normalize_for_steps"):
        mechanism.add_noise_(zeros(), 1.0, 1.0)
    assert mechanism.step == steps


def test_bandmf_empirical_covariance_matches_inverse_strategy_gram():
    coefficients = np.array([1.0, 0.6, -0.3])
    steps, entries = 6, 40_000
    noise_multiplier, max_grad_norm = 1.5, 0.8
    mechanism = BandMFNoise(coefficients, seed=2024)
    noise = run_steps(mechanism, steps, noise_multiplier, max_grad_norm, shapes=[(entries,)])
    empirical = noise @ noise.T / entries
    inverse = np.linalg.inv(toeplitz_strategy(coefficients, steps))
    s = noise_multiplier * max_grad_norm * np.linalg.norm(coefficients)
    expected = s**2 * inverse @ inverse.T
    # Std of a sample covariance entry: sqrt((S_ii S_jj + S_ij^2) / M); allow 5 of them.
    tolerance = 5 * np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / entries)
    assert np.all(np.abs(empirical - expected) <= tolerance)
    assert np.abs(noise.mean(axis=1)).max() < 5 * np.sqrt(np.diag(expected).max() / entries)


def test_single_band_reproduces_gaussian_noise_exactly():
    shapes_dtypes = [((5, 3), torch.float32), ((7,), torch.float32), ((2, 2), torch.float64)]
    gaussian, banded = GaussianNoise(seed=11), BandMFNoise([1.0], seed=11)
    for _ in range(4):
        a = [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes_dtypes]
        b = [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes_dtypes]
        gaussian.add_noise_(a, 0.9, 2.0)
        banded.add_noise_(b, 0.9, 2.0)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
            assert x.abs().sum() > 0


def test_noise_scale_does_not_depend_on_coefficient_scale():
    coefficients = np.array([1.0, 0.5, 0.25])
    a = run_steps(BandMFNoise(coefficients, seed=3), 6)
    b = run_steps(BandMFNoise(4.0 * coefficients, seed=3), 6)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_gaussian_noise_has_std_sigma_times_clip_norm_and_is_independent_across_steps():
    noise_multiplier, max_grad_norm, entries = 1.7, 0.6, 100_000
    noise = run_steps(GaussianNoise(seed=5), 2, noise_multiplier, max_grad_norm, shapes=[(entries,)])
    std = noise_multiplier * max_grad_norm
    # Sample std has relative standard error 1/sqrt(2M) ~ 0.0022; allow 5 of them.
    assert noise.std(axis=1) == pytest.approx([std, std], rel=5 / math.sqrt(2 * entries))
    assert abs(noise.mean()) < 5 * std / math.sqrt(2 * entries)
    assert abs(np.corrcoef(noise)[0, 1]) < 5 / math.sqrt(entries)


def test_gaussian_noise_std_helper():
    assert GaussianNoise(seed=0).noise_std(1.2, 3.0) == pytest.approx(3.6)
    assert BandMFNoise([3.0, 4.0], seed=0).noise_std(1.2, 3.0) == pytest.approx(3.6 * 5.0)


@pytest.mark.parametrize("mechanism_factory", [lambda: GaussianNoise(seed=9), lambda: BandMFNoise([1.0, 0.4, 0.2, 0.1], seed=9)])
@pytest.mark.parametrize("load_before_first_step", [True, False])
def test_resume_from_state_dict_reproduces_the_noise_sequence(mechanism_factory, load_before_first_step):
    reference = mechanism_factory()
    full = run_steps(reference, 9, shapes=[(3, 4), (5,)], dtype=torch.float32)

    interrupted = mechanism_factory()
    first = run_steps(interrupted, 4, shapes=[(3, 4), (5,)], dtype=torch.float32)
    buffer = io.BytesIO()
    torch.save(interrupted.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)

    resumed = mechanism_factory()
    resumed._seed = 12345  # the seed must come from the state, not the constructor
    if not load_before_first_step:
        run_steps(resumed, 2, shapes=[(3, 4), (5,)], dtype=torch.float32)
    resumed.load_state_dict(state)
    assert resumed.step == 4
    rest = run_steps(resumed, 5, shapes=[(3, 4), (5,)], dtype=torch.float32)
    np.testing.assert_array_equal(np.concatenate([first, rest]), full)


def test_state_dict_before_first_step_carries_the_seed():
    original = BandMFNoise([1.0, 0.5], seed=21)
    copy_ = BandMFNoise([1.0, 0.5], seed=22)
    copy_.load_state_dict(original.state_dict())
    np.testing.assert_array_equal(run_steps(original, 3), run_steps(copy_, 3))


def test_load_state_dict_rejects_other_coefficients_or_mechanism():
    state = BandMFNoise([1.0, 0.5], seed=1).state_dict()
    with pytest.raises(ValueError, match="coefficients"):
        BandMFNoise([1.0, 0.6], seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="BandMFNoise"):
        GaussianNoise(seed=1).load_state_dict(state)


def test_load_state_dict_rejects_other_shapes_before_changing_anything():
    saved = BandMFNoise([1.0, 0.5], seed=1)
    run_steps(saved, 2)
    resumed = BandMFNoise([1.0, 0.5], seed=1)
    resumed.load_state_dict(copy.deepcopy(saved.state_dict()))
    with pytest.raises(ValueError, match="shapes"):
        resumed.add_noise_([torch.zeros(12, dtype=torch.float64)], 1.0, 1.0)
    assert resumed.step == 2


def test_same_seed_same_noise_other_seed_other_noise():
    a = run_steps(BandMFNoise([1.0, 0.3], seed=1), 3)
    b = run_steps(BandMFNoise([1.0, 0.3], seed=1), 3)
    c = run_steps(BandMFNoise([1.0, 0.3], seed=2), 3)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_secure_mode_refuses_a_seed():
    with pytest.raises(ValueError, match="seed"):
        GaussianNoise(seed=0, secure_mode=True)
    with pytest.raises(ValueError, match="seed"):
        BandMFNoise([1.0, 0.5], seed=0, secure_mode=True)


def test_secure_mode_noise_is_fresh_and_has_the_right_std():
    entries = 50_000
    a = run_steps(GaussianNoise(secure_mode=True), 1, 1.0, 2.0, shapes=[(entries,)])
    b = run_steps(GaussianNoise(secure_mode=True), 1, 1.0, 2.0, shapes=[(entries,)])
    assert not np.allclose(a, b)
    assert a.std() == pytest.approx(2.0, rel=5 / math.sqrt(2 * entries))


@pytest.mark.parametrize(
    "coefficients",
    [[], [[1.0, 0.5]], [0.0, 0.5], [-1.0, 0.5], [1.0, float("nan")], [float("inf")], ["a"]],
)
def test_bad_coefficients_raise_naming_coefficients(coefficients):
    with pytest.raises(ValueError, match="coefficients"):
        BandMFNoise(coefficients)


@pytest.mark.parametrize("mechanism", [GaussianNoise(seed=0), BandMFNoise([1.0, 0.5], seed=0)])
def test_noise_multiplier_zero_adds_nothing_and_advances(mechanism):
    tensors = [torch.ones(3)]
    mechanism.add_noise_(tensors, 0.0, 1.0)
    mechanism.add_noise_(tensors, 0.0, float("inf"))
    assert torch.equal(tensors[0], torch.ones(3))
    assert mechanism.step == 2


@pytest.mark.parametrize(
    ("noise_multiplier", "max_grad_norm", "match"),
    [(-1.0, 1.0, "noise_multiplier"), (float("nan"), 1.0, "noise_multiplier"),
     (1.0, -1.0, "max_grad_norm"), (1.0, float("nan"), "max_grad_norm"), (1.0, float("inf"), "max_grad_norm")],
)
def test_invalid_noise_parameters_raise_and_change_nothing(noise_multiplier, max_grad_norm, match):
    mechanism = BandMFNoise([1.0, 0.5], seed=0)
    tensors = [torch.ones(3)]
    with pytest.raises(ValueError, match=match):
        mechanism.add_noise_(tensors, noise_multiplier, max_grad_norm)
    assert torch.equal(tensors[0], torch.ones(3))
    assert mechanism.step == 0


def test_changing_tensor_shapes_raises_and_changes_nothing():
    mechanism = GaussianNoise(seed=0)
    mechanism.add_noise_([torch.zeros(3), torch.zeros(2)], 1.0, 1.0)
    tensors = [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        mechanism.add_noise_(tensors, 1.0, 1.0)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in tensors)
    assert mechanism.step == 1


def test_bandmf_refuses_a_change_of_noise_scale():
    mechanism = BandMFNoise([1.0, 0.5], seed=0)
    mechanism.add_noise_([torch.zeros(3)], 1.0, 1.0)
    with pytest.raises(ValueError, match="same noise_multiplier"):
        mechanism.add_noise_([torch.zeros(3)], 2.0, 1.0)
    assert mechanism.step == 1


def test_empty_or_non_float_tensors_raise():
    with pytest.raises(ValueError, match="empty"):
        GaussianNoise(seed=0).add_noise_([], 1.0, 1.0)
    with pytest.raises(ValueError, match="floating"):
        GaussianNoise(seed=0).add_noise_([torch.zeros(3, dtype=torch.long)], 1.0, 1.0)


def test_half_precision_tensors_get_the_float32_noise_rounded():
    shapes_dtypes = [((4, 3), torch.bfloat16), ((5,), torch.float32)]
    low = [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes_dtypes]
    full = [torch.zeros(shape, dtype=torch.float32) for shape, _ in shapes_dtypes]
    BandMFNoise([1.0, 0.5], seed=4).add_noise_(low, 1.0, 1.0)
    BandMFNoise([1.0, 0.5], seed=4).add_noise_(full, 1.0, 1.0)
    assert low[0].dtype == torch.bfloat16
    assert torch.equal(low[0], full[0].to(torch.bfloat16))
    assert torch.equal(low[1], full[1])


def test_noise_is_added_to_existing_values_of_leaf_parameters():
    parameter = torch.nn.Parameter(torch.full((6,), 2.0, dtype=torch.float64))
    reference = torch.full((6,), 2.0, dtype=torch.float64)
    GaussianNoise(seed=8).add_noise_([parameter], 1.0, 1.0)
    noise_only = [torch.zeros(6, dtype=torch.float64)]
    GaussianNoise(seed=8).add_noise_(noise_only, 1.0, 1.0)
    torch.testing.assert_close(parameter.detach(), reference + noise_only[0], rtol=0, atol=0)


@pytest.mark.cuda
def test_bandmf_on_cuda_matches_dense_reference():
    coefficients = np.array([1.0, 0.5, -0.2])
    mechanism = BandMFNoise(coefficients, seed=1)
    rows = []
    for _ in range(6):
        tensors = [torch.zeros(5, dtype=torch.float64, device="cuda")]
        mechanism.add_noise_(tensors, 1.0, 1.0)
        rows.append(tensors[0].cpu().numpy())
    z = []
    gaussian = GaussianNoise(seed=1)
    for _ in range(6):
        tensors = [torch.zeros(5, dtype=torch.float64, device="cuda")]
        gaussian.add_noise_(tensors, 1.0, np.linalg.norm(coefficients))
        z.append(tensors[0].cpu().numpy())
    dense = np.linalg.solve(toeplitz_strategy(coefficients, 6), np.stack(z))
    np.testing.assert_allclose(np.stack(rows), dense, rtol=1e-10, atol=1e-10)
