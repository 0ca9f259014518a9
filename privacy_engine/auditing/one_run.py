"""One-run auditing: lower bounds from guesses about m canaries, each included with probability 1/2.

In one training run, each of ``m`` canaries is included independently with probability 1/2; the auditor
scores all of them, guesses "included" for the ``r`` canaries scoring at or above a threshold (abstains on
the rest) and is right ``v`` times. Under the null hypothesis that the training is (epsilon, delta)-DP
with respect to each canary (add/remove), ``v`` is stochastically dominated by ``Binomial(r, e^eps / (1 +
e^eps))`` up to a delta term (Steinke, Nasr, Jagielski 2023, "Privacy Auditing with One (1) Training Run",
arXiv:2305.08846: its main theorem with ``k_- = 0`` and the p-value algorithm of its appendix): a ``v`` with
p-value at most ``1 - confidence`` refutes the hypothesis. Under mu-GDP the f-DP analysis of Mahloujifar, Melis, Chaudhuri 2024 ("Auditing f-Differential
Privacy in One Run", arXiv:2410.22235, the ``audit_rh_with_cap`` recursion, as JAX Privacy 2.0 implements it)
gives a tighter test.

The canaries' inclusion is the only randomness these tests use: the bounds hold whatever the training
data, model and scores, as long as the scores are computed from the run's output without knowing which
canaries were included.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.special import expit
from scipy.stats import binom

from privacy_engine.auditing.checks import check_confidence, check_delta
from privacy_engine.auditing.gdp import gdp_tradeoff_inverse
from privacy_engine.auditing.roc import RocPoints


def _check_counts(num_canaries: int, num_guesses: int, num_correct: int) -> None:
    if not 0 <= num_correct <= num_guesses <= num_canaries:
        raise ValueError(
            "counts must satisfy 0 <= num_correct <= num_guesses <= num_canaries, got "
            f"num_correct={num_correct}, num_guesses={num_guesses}, num_canaries={num_canaries}"
        )


def one_run_p_value(num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float) -> float:
    """Probability of ``num_correct`` or more correct guesses among ``num_guesses`` if the run is
    (epsilon, delta)-DP (Steinke et al. 2023, the p-value algorithm of its appendix; guesses of
    "included" only).

    With ``q = e^eps / (1 + e^eps)`` and ``B ~ Binomial(r, q)``: ``P[B >= v] + 2 m delta max_{1<=i<=v}
    (P[B >= v - i] - P[B >= v]) / i``, capped at 1 (``m`` canaries, ``r`` guesses, ``v`` correct).

    ====================  ============================================
    case                  result
    ====================  ============================================
    num_correct = 0       1.0
    delta = 0             ``P[B >= v]``
    epsilon = inf         1.0
    counts inconsistent   ValueError naming the counts
    ====================  ============================================
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    delta = check_delta(delta)
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    q = float(expit(epsilon))
    tail = float(binom.sf(num_correct - 1, num_guesses, q))
    if delta == 0 or num_correct == 0:
        return min(tail, 1.0)
    shifts = np.arange(1, num_correct + 1)
    extra = binom.sf(num_correct - shifts - 1, num_guesses, q) - tail
    return min(tail + float(np.max(extra / shifts)) * delta * 2 * num_canaries, 1.0)


def one_run_epsilon(num_canaries: int, num_guesses: int, num_correct: int, confidence: float, delta: float) -> float:
    """Epsilon lower bound of one-run auditing: the largest epsilon whose (epsilon, delta) hypothesis
    ``one_run_p_value`` rejects at level ``1 - confidence``.

    Guarantee: if the run is (epsilon, delta)-DP towards each canary, the returned value exceeds epsilon
    with probability at most ``1 - confidence`` over the canaries' inclusion (one fixed guessing rule).

    ============================  ====================================================
    case                          result
    ============================  ====================================================
    no guesses or none correct    0.0
    precision <= 1/2              0.0 (nothing distinguishable)
    all m guesses correct         the largest value m canaries allow at this level
    confidence not in (0, 1)      ValueError naming ``confidence``
    delta not in [0, 1)           ValueError naming ``delta``
    ============================  ====================================================
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    significance = 1 - check_confidence(confidence)
    delta = check_delta(delta)
    return _largest_rejected(
        lambda eps: significance - one_run_p_value(num_canaries, num_guesses, num_correct, eps, delta),
        xtol=1e-9,
    )


def _gdp_excess(mu: float, num_canaries: int, num_guesses: int, num_correct: int, significance: float) -> float:
    """Positive iff mu-GDP is rejected at ``significance`` (Mahloujifar et al. 2024, ``audit_rh_with_cap``):
    the mass of correct / wrong guesses the f-DP curve forces, pushed back one correct guess at a time."""
    correct = significance * num_correct / num_canaries
    wrong = significance * (num_guesses - num_correct) / num_canaries
    for i in range(num_correct - 1, -1, -1):
        new_wrong = max(wrong, float(gdp_tradeoff_inverse(mu, correct)))
        if new_wrong == wrong:
            break  # neither mass can change again
        correct = min(correct + i / (num_guesses - i) * (new_wrong - wrong), 1.0)
        wrong = new_wrong
    return correct + wrong - num_guesses / num_canaries


def one_run_gdp_mu(num_canaries: int, num_guesses: int, num_correct: int, confidence: float) -> float:
    """mu lower bound of one-run f-DP auditing: the largest mu for which mu-GDP is rejected at level
    ``1 - confidence`` (Mahloujifar, Melis, Chaudhuri 2024).

    Guarantee: if the run is mu-GDP towards each canary, the returned value exceeds mu with probability
    at most ``1 - confidence`` over the canaries' inclusion (one fixed guessing rule). Convert to an
    epsilon at a delta with ``gdp_epsilon``.

    ============================  ==================================
    case                          result
    ============================  ==================================
    no guesses or none correct    0.0
    nothing distinguishable       0.0
    confidence not in (0, 1)      ValueError naming ``confidence``
    ============================  ==================================
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    significance = 1 - check_confidence(confidence)
    if num_correct == 0:
        return 0.0
    return _largest_rejected(
        lambda mu: _gdp_excess(mu, num_canaries, num_guesses, num_correct, significance), xtol=1e-9
    )


def _largest_rejected(excess, *, xtol: float) -> float:
    """The root of ``excess`` (positive: rejected; decreasing) on [0, inf); 0.0 if it is not positive at 0."""
    if excess(0.0) <= 0:
        return 0.0
    low, high = 0.0, 1.0
    while excess(high) > 0:
        low, high = high, high * 2
        if high > 1e6:
            return math.inf
    return float(brentq(excess, low, high, xtol=xtol))


def one_run_epsilon_at(points: RocPoints, significance: float, *, delta: float) -> tuple[float, float]:
    """Best ``one_run_epsilon`` over ``points`` (guess held in at or above each threshold; m = all canaries)
    and its threshold; ``(0.0, inf)`` if none rejects epsilon = 0."""
    num_canaries = points.num_in + points.num_out

    def excess_at(index: int):
        correct = int(points.true_positives[index])
        guesses = correct + int(points.false_positives[index])
        return lambda eps: significance - one_run_p_value(num_canaries, guesses, correct, eps, delta)

    return _best_point(points, excess_at)


def one_run_gdp_mu_at(points: RocPoints, significance: float) -> tuple[float, float]:
    """Best ``one_run_gdp_mu`` over ``points`` and its threshold; ``(0.0, inf)`` if none rejects mu = 0."""
    num_canaries = points.num_in + points.num_out

    def excess_at(index: int):
        correct = int(points.true_positives[index])
        guesses = correct + int(points.false_positives[index])
        return lambda mu: _gdp_excess(mu, num_canaries, guesses, correct, significance)

    return _best_point(points, excess_at)


def _largest_above(excess, floor: float) -> float:
    """The root of ``excess`` above ``floor``, or ``floor`` if ``excess(floor)`` is not positive."""
    if excess(floor) <= 0:
        return floor
    return floor + _largest_rejected(lambda x: excess(floor + x), xtol=1e-9)


def _best_point(points: RocPoints, excess_at) -> tuple[float, float]:
    guesses = points.true_positives + points.false_positives
    precision = np.divide(points.true_positives, guesses, out=np.zeros(len(points)), where=guesses > 0)
    best, best_threshold = 0.0, float("inf")
    # Most precise thresholds first: a point is solved only if it rejects the best value so far (the tests
    # are monotone in the parameter), so the order changes the work, not the result.
    for index in np.argsort(-precision, kind="stable"):
        if points.true_positives[index] == 0:
            continue
        value = _largest_above(excess_at(int(index)), best)
        if value > best:
            best, best_threshold = value, float(points.thresholds[index])
    return best, best_threshold
