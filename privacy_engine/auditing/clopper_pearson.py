"""Clopper-Pearson (exact binomial) one-sided confidence bounds on a rate."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import beta

from privacy_engine.auditing.checks import check_confidence


def clopper_pearson_upper(successes: ArrayLike, trials: int, confidence: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bound on the success probability of a binomial.

    Guarantee: for ``k ~ Binomial(trials, p)``, ``P[p <= clopper_pearson_upper(k, trials, c)] >= c`` for
    every ``p`` (exact, not asymptotic). The bound is the ``c`` quantile of ``Beta(k + 1, trials - k)``:
    the ``p`` at which seeing ``k`` or fewer successes has probability ``1 - c``.

    =========================  =====================================
    case                       result
    =========================  =====================================
    successes = trials         1.0
    successes = 0              ``1 - (1 - c) ** (1 / trials)``
    trials = 0                 1.0 (nothing observed)
    confidence not in (0, 1)   ValueError naming ``confidence``
    successes < 0 or > trials  ValueError naming ``successes``
    =========================  =====================================
    """
    confidence = check_confidence(confidence)
    k = np.asarray(successes, dtype=np.float64)
    if np.any(k < 0) or np.any(k > trials):
        raise ValueError(f"successes must be in [0, trials={trials}], got {successes}")
    with np.errstate(invalid="ignore"):
        bound = beta.ppf(confidence, k + 1, trials - k)
    return np.where(k < trials, bound, 1.0)


def clopper_pearson_lower(successes: ArrayLike, trials: int, confidence: float) -> np.ndarray:
    """One-sided Clopper-Pearson lower bound on the success probability of a binomial.

    Guarantee: ``P[p >= clopper_pearson_lower(k, trials, c)] >= c`` for every ``p``; it equals
    ``1 - clopper_pearson_upper(trials - k, trials, c)`` (the ``1 - c`` quantile of ``Beta(k, trials - k + 1)``).

    ========================  =====================================
    case                      result
    ========================  =====================================
    successes = 0             0.0
    successes = trials        ``(1 - c) ** (1 / trials)``
    trials = 0                0.0 (nothing observed)
    confidence not in (0, 1)  ValueError naming ``confidence``
    ========================  =====================================
    """
    k = np.asarray(successes, dtype=np.float64)
    return 1.0 - clopper_pearson_upper(trials - k, trials, confidence)
