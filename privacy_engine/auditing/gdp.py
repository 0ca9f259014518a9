"""Gaussian differential privacy (mu-GDP, Dong, Roth and Su 2019) and its (epsilon, delta) curve."""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.special import ndtr, ndtri
from scipy.stats import norm


def gdp_delta(mu: float, epsilon: float) -> float:
    """The smallest delta for which mu-GDP implies (epsilon, delta)-DP (Dong, Roth, Su 2019, Corollary 2.13):
    ``Phi(-epsilon / mu + mu / 2) - e^epsilon Phi(-epsilon / mu - mu / 2)``.

    =============  ===============================
    case           result
    =============  ===============================
    mu = 0         0.0 (perfect privacy)
    mu = inf       1.0
    epsilon = inf  0.0
    mu < 0         ValueError naming ``mu``
    epsilon < 0    ValueError naming ``epsilon``
    =============  ===============================
    """
    if not mu >= 0:
        raise ValueError(f"mu must be >= 0, got {mu}")
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if mu == 0 or epsilon == math.inf:
        return 0.0
    if mu == math.inf:
        return 1.0
    # In logs: the two terms are close when delta is small.
    first = norm.logcdf(-epsilon / mu + mu / 2)
    second = epsilon + norm.logcdf(-epsilon / mu - mu / 2)
    if second >= first:
        return 0.0
    return float(math.exp(first) * -math.expm1(second - first))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest epsilon with mu-GDP implying (epsilon, delta)-DP: the root of ``gdp_delta(mu, .) = delta``.

    =========================  ==============================
    case                       result
    =========================  ==============================
    mu = 0                     0.0
    gdp_delta(mu, 0) <= delta  0.0
    delta not in (0, 1)        ValueError naming ``delta``
    mu < 0 or inf              ValueError naming ``mu``
    =========================  ==============================
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not 0 <= mu < math.inf:
        raise ValueError(f"mu must be finite and >= 0, got {mu}")
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    high = 1.0
    while gdp_delta(mu, high) > delta:
        high *= 2
    return float(brentq(lambda eps: gdp_delta(mu, eps) - delta, 0.0, high, xtol=1e-12, rtol=1e-12))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The largest mu for which mu-GDP implies (epsilon, delta)-DP (``gdp_delta`` increases with mu): the
    mu of the Gaussian mechanism that is exactly (epsilon, delta)-DP (``1 / sigma`` for sensitivity 1).

    ====================  ==============================
    case                  result
    ====================  ==============================
    epsilon = inf         inf
    delta not in (0, 1)   ValueError naming ``delta``
    epsilon < 0           ValueError naming ``epsilon``
    ====================  ==============================
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if epsilon == math.inf:
        return math.inf
    high = 1.0
    while gdp_delta(high, epsilon) < delta:
        high *= 2
    return float(brentq(lambda mu: gdp_delta(mu, epsilon) - delta, 0.0, high, xtol=1e-12, rtol=1e-12))


def gdp_tradeoff_inverse(mu: float, x: np.ndarray | float) -> np.ndarray | float:
    """``Phi(Phi^-1(x) - mu)``: under mu-GDP, the smallest probability an event can have on one of two
    neighbouring datasets when it has probability ``x`` on the other (``x = 0``: 0, ``x = 1``: 1)."""
    return ndtr(ndtri(x) - mu)  # the ufuncs, not scipy.stats.norm: called in a loop by one_run
