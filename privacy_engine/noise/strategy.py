"""Banded Toeplitz strategies for BandMF: their error, and the optimiser that picks them.

The workload is the prefix-sum matrix ``A`` (``n x n``, lower-triangular all-ones): SGD's
iterates are prefix sums of the noisy gradients. A strategy is a ``b``-banded lower-triangular
Toeplitz matrix ``C`` with ``C[i, j] = c[i - j]`` for ``0 <= i - j < b``; BandMF adds the noise
``C^{-1} Z`` (see ``privacy_engine.noise.BandMFNoise``), so the noise in iterate ``i`` is
``row_i(A C^{-1}) Z``. The loss

    loss(c) = ||c||_2^2 * (1/n) * sum_i ||row_i(A C^{-1})||_2^2

is the mean (over steps) expected squared error per coordinate, in units of
``(noise_multiplier * max_grad_norm)^2``, since ``Z`` has std ``noise_multiplier *
max_grad_norm * ||c||_2``. It is invariant to the scale of ``c``.

Computation in O(n b): ``C^{-1}`` is lower-triangular Toeplitz with first column ``d`` (the
impulse response of the recursion ``d_k = (delta_k - sum_{j>=1} c_j d_{k-j}) / c_0``), and
``A C^{-1}`` is Toeplitz with first column ``e = cumsum(d)`` (the step response), so row ``i``
has squared norm ``sum_{k<=i} e_k^2`` and ``(1/n) sum_i ||row_i||^2 = (1/n) sum_k (n-k) e_k^2``.
Both recursions run as IIR filters (``scipy.signal.lfilter``), and the gradient comes from the
adjoint recursion (a filter run backwards in time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from scipy.optimize import minimize
from scipy.signal import lfilter

from privacy_engine.settings_checks import check_max_grad_norm, check_noise_multiplier, check_noise_std

__all__ = ["expected_error", "optimize_banded_toeplitz", "strategy_loss"]

# The optimiser works on x = K * (c_1, ..., c_{b-1}) with c_0 = 1. L-BFGS's first step has unit
# length in x; in c it is 1/K, small enough not to jump into coefficients whose inverse filter
# explodes (those give inf loss and stall the line search). Larger K are tried if that happens.
_STEP_DAMPINGS = (10.0, 100.0, 1000.0)


#: Largest ``n`` the strategy functions accept: they hold about ten float64 arrays of ``n`` entries
#: (~80 bytes per step: 0.8 GB here) and take O(n * bands) time per evaluation (10**6 steps with 64
#: bands: 4.7 s to optimise on 2 CPU cores). ``make_private`` has its own, tighter limits
#: (``privacy_engine.engine.limits``).
MAX_STRATEGY_STEPS = 10**7
#: Largest ``n * bands`` ``optimize_banded_toeplitz`` accepts (~1-2 minutes on 2 CPU cores).
MAX_OPTIMIZATION_WORK = 10**9
_BYTES_PER_STEP = 80


def _check_steps_cost(n: int) -> None:
    if n > MAX_STRATEGY_STEPS:
        raise ValueError(
            f"n={n} steps exceeds MAX_STRATEGY_STEPS={MAX_STRATEGY_STEPS}: the strategy's error over n steps needs "
            f"about {n * _BYTES_PER_STEP / 1e9:.3g} GB of memory and O(n * bands) time"
        )


def _validated_n(n: int, name: str = "n") -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return int(n)


def validated_coefficients(
    coefficients: Sequence[float] | np.ndarray, *, name: str = "coefficients"
) -> np.ndarray:
    """The strategy coefficients as a float64 array; ValueError naming ``name`` unless 1-D,
    non-empty, finite, with c_0 > 0 (C must be invertible)."""
    try:
        array = np.asarray(coefficients, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a 1-D sequence of numbers (c_0, ..., c_(b-1)): {error}") from error
    if array.ndim != 1 or array.size == 0:
        raise ValueError(
            f"{name} must be a non-empty 1-D sequence (c_0, ..., c_(b-1)), got shape {array.shape}"
        )
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must all be finite, got {array.tolist()}")
    if not array[0] > 0:
        raise ValueError(
            f"{name}[0] (c_0, the diagonal of the strategy C) must be > 0 so that C is invertible, "
            f"got {array[0]!r}. Negate all coefficients if c_0 < 0 (same strategy)."
        )
    return array


def _loss_and_gradient(coefficients: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """Loss and its gradient with respect to all ``b <= n`` coefficients, in O(n b)."""
    bands = coefficients.size
    with np.errstate(over="ignore", invalid="ignore"):
        step_response = lfilter([1.0], coefficients, np.ones(n))  # e = C^{-1} 1
        weights = np.arange(n, 0, -1, dtype=np.float64)  # row i covers e_0..e_i: e_k counted n-k times
        weighted = weights * step_response
        mean_row_norm = float(weighted @ step_response) / n
        # d(mean_row_norm)/dc_j = -(2/n) u^T S_j e with u = C^{-T} (w * e): C^T is upper
        # triangular, i.e. the same filter run backwards in time.
        adjoint = lfilter([1.0], coefficients, weighted[::-1])[::-1]
        # sum_k u_k e_{k-j} for j < b, read off sliding windows of e padded with b-1 zeros.
        padded = np.concatenate([np.zeros(bands - 1), step_response])
        lagged = adjoint @ sliding_window_view(padded, bands)
        grad_mean_row_norm = -(2.0 / n) * lagged[::-1]
        sensitivity_squared = float(coefficients @ coefficients)
        loss = sensitivity_squared * mean_row_norm
        gradient = 2.0 * coefficients * mean_row_norm + sensitivity_squared * grad_mean_row_norm
    return loss, gradient


def strategy_loss(
    coefficients: Sequence[float] | np.ndarray, n: int, *, column_normalized: bool = False
) -> float:
    """Mean expected squared error of BandMF's noisy prefix sums over ``n`` steps, per unit
    noise variance: ``max_col_norm(C)^2 * (1/n) * sum_i ||row_i(A C^{-1})||^2``.

    With ``column_normalized=True`` the strategy is ``C`` with every column rescaled to norm
    ``||c||_2`` (``BandMFNoise(column_normalize_for_steps=n)``), which only changes the last
    ``b - 1`` rows of ``C^{-1}``.

    Guarantee: equals the dense float64 computation on the ``n x n`` matrices (up to
    rounding); computed in O(n b) time and O(n) memory.

    ===========================  ======================================================
    case                         result
    ===========================  ======================================================
    len(coefficients) = 1        (n + 1) / 2 (DP-SGD)
    len(coefficients) > n        bands beyond n never enter the n x n C: ignored
    scale of coefficients        no effect
    C^{-1} grows too fast        inf (floating-point overflow)
    c_0 <= 0, NaN, not 1-D       ValueError naming coefficients
    n < 1                        ValueError naming n
    n > MAX_STRATEGY_STEPS       ValueError naming n and the memory it would take
    ===========================  ======================================================
    """
    n = _validated_n(n)
    _check_steps_cost(n)
    coefficients = validated_coefficients(coefficients)[:n]
    if not column_normalized:
        loss, _ = _loss_and_gradient(coefficients, n)
        return loss if math.isfinite(loss) else math.inf
    return _column_normalized_loss(coefficients, n)


def _column_normalized_loss(coefficients: np.ndarray, n: int) -> float:
    bands = coefficients.size
    sensitivity = float(np.linalg.norm(coefficients))
    with np.errstate(over="ignore", invalid="ignore"):
        impulse = np.zeros(n)
        impulse[0] = 1.0
        inverse_column = lfilter([1.0], coefficients, impulse)  # d
        step_response = np.cumsum(inverse_column)  # e
        # Rows i <= n - b of A C'^{-1} equal those of A C^{-1}: ||row_i||^2 = sum_{k<=i} e_k^2.
        first_scaled = n - bands + 1
        prefix_energy = np.cumsum(step_response**2)
        total = float(prefix_energy[:first_scaled].sum())
        # Later rows accumulate rows of C'^{-1} = diag(r) C^{-1} one at a time:
        # row_i(A C'^{-1}) = row_{i-1}(A C'^{-1}) + r_i * row_i(C^{-1}), row_i(C^{-1})[j] = d_{i-j}.
        row = np.zeros(n)
        row[:first_scaled] = step_response[first_scaled - 1 :: -1]
        prefix_norms = np.sqrt(np.cumsum(coefficients**2)) / sensitivity
        for i in range(first_scaled, n):
            row_scale = prefix_norms[min(bands - 1, n - 1 - i)]
            row[: i + 1] += row_scale * inverse_column[i::-1]
            total += float(row @ row)
        loss = sensitivity**2 * total / n
    return loss if math.isfinite(loss) else math.inf


def expected_error(
    coefficients: Sequence[float] | np.ndarray,
    n: int,
    noise_multiplier: float,
    *,
    max_grad_norm: float = 1.0,
    column_normalized: bool = False,
) -> float:
    """Expected squared error per coordinate of the noisy prefix sums, averaged over the ``n``
    steps: ``strategy_loss * (noise_multiplier * max_grad_norm)^2``.

    Use it to compare numbers of bands: each choice of ``b`` comes with its own
    ``noise_multiplier`` from the accountant (more bands, fewer cyclic groups, less
    amplification), and the smaller ``expected_error`` wins. Multiply by the number of model
    parameters for the total squared error.

    ==================================  ==============================
    case                                result
    ==================================  ==============================
    noise_multiplier = 0                0.0 (whatever max_grad_norm)
    max_grad_norm = 0                   0.0
    noise_multiplier < 0 / NaN / inf    ValueError naming it
    max_grad_norm < 0 / NaN             ValueError naming it
    max_grad_norm = inf with noise > 0  ValueError naming it
    ==================================  ==============================

    The settings are checked by ``privacy_engine.settings_checks`` (the same checks and messages as
    ``make_private``'s).
    """
    noise_multiplier = check_noise_multiplier(noise_multiplier)
    max_grad_norm = check_max_grad_norm(max_grad_norm)
    loss = strategy_loss(coefficients, n, column_normalized=column_normalized)
    noise_std = check_noise_std(noise_multiplier, max_grad_norm)
    if noise_std == 0.0:
        return 0.0
    return loss * noise_std**2


def _sqrt_prefix_sum_coefficients(bands: int) -> np.ndarray:
    # Taylor coefficients of (1 - x)^(-1/2): the Toeplitz square root of A (C = A^{1/2} is the
    # optimal unbanded strategy for max error), truncated: a good start for any band count.
    k = np.arange(1, bands, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


def optimize_banded_toeplitz(
    n: int,
    bands: int,
    *,
    max_iterations: int = 1000,
    tolerance: float = 1e-12,
) -> np.ndarray:
    """Coefficients of the ``bands``-banded Toeplitz strategy minimising ``strategy_loss``.

    L-BFGS (scipy) over ``c_1..c_{b-1}`` with ``c_0`` fixed to 1 (the loss is scale-invariant),
    exact O(n b) gradients, started from the truncated square root of the prefix-sum matrix.
    ``tolerance`` is the relative decrease of the loss at which L-BFGS stops.

    Guarantee: the returned vector is float64, has length ``bands``, unit L2 norm (so the
    sensitivity per participation is 1) and ``c_0 > 0``, and its loss is finite and no larger
    than that of the starting point. It is a local optimum found numerically; the known
    optima (n=128, b=4: 19.045234; n=1024, b=16: 40.231028) are reached to ~1e-12 relative.

    =========================  ===============================================
    case                       result
    =========================  ===============================================
    bands = 1                  (1.0,) (DP-SGD), loss (n + 1) / 2
    bands > n                  ValueError: only n bands exist in an n x n C
    n, bands < 1 / not int     ValueError naming the argument
    n > MAX_STRATEGY_STEPS,    ValueError naming n (and bands) and the cost
    n * bands > MAX_OPT..WORK
    max_iterations < 1         ValueError
    tolerance <= 0 / NaN       ValueError
    =========================  ===============================================
    """
    n = _validated_n(n)
    bands = _validated_n(bands, "bands")
    if bands > n:
        raise ValueError(
            f"bands={bands} exceeds n={n}: an n x n strategy has at most n bands; use bands <= n"
        )
    _check_steps_cost(n)
    if n * bands > MAX_OPTIMIZATION_WORK:
        raise ValueError(
            f"n={n} steps with bands={bands} is {n * bands} step-bands, over MAX_OPTIMIZATION_WORK="
            f"{MAX_OPTIMIZATION_WORK}: each L-BFGS iteration costs O(n * bands) (10**6 x 64 took 4.7 s to optimise)"
        )
    max_iterations = _validated_n(max_iterations, "max_iterations")
    if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"tolerance must be a positive finite number, got {tolerance!r}")
    start = _sqrt_prefix_sum_coefficients(bands)
    if bands == 1:
        return start

    best = start
    best_loss, _ = _loss_and_gradient(start, n)
    for damping in _STEP_DAMPINGS:

        def objective(x: np.ndarray, damping: float = damping) -> tuple[float, np.ndarray]:
            coefficients = np.concatenate([[1.0], x / damping])
            loss, gradient = _loss_and_gradient(coefficients, n)
            if not (math.isfinite(loss) and np.all(np.isfinite(gradient))):
                # Unstable inverse filter: a huge finite value makes the line search back off.
                return 1e300, np.zeros_like(x)
            return loss, gradient[1:] / damping

        result = minimize(
            objective,
            start[1:] * damping,
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": int(max_iterations), "ftol": float(tolerance), "gtol": 0.0, "maxcor": 20},
        )
        candidate = np.concatenate([[1.0], result.x / damping])
        candidate_loss, gradient = _loss_and_gradient(candidate, n)
        if math.isfinite(candidate_loss) and candidate_loss < best_loss:
            best, best_loss = candidate, candidate_loss
        # Scale-free stationarity test: the loss changes by < 1e-6 relative for a unit
        # change of c. Otherwise the line search stalled; retry with smaller first steps.
        if math.isfinite(candidate_loss) and np.abs(gradient).max() <= 1e-6 * candidate_loss:
            break
    return best / np.linalg.norm(best)
