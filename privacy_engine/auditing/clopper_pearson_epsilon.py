"""Epsilon lower bound from Clopper-Pearson intervals on the attack's TPR and FPR (Jagielski et al. 2020)."""

from __future__ import annotations

import numpy as np

from privacy_engine.auditing.clopper_pearson import clopper_pearson_upper
from privacy_engine.auditing.roc import RocPoints


def clopper_pearson_epsilon_at(
    points: RocPoints, significance: float, *, delta: float, one_sided: bool
) -> tuple[float, float]:
    """Best ``log(TPR_low - delta) - log(FPR_high)`` over ``points`` and its threshold, where both bounds
    are Clopper-Pearson at significance ``significance / 2`` each (together: ``significance``). With
    ``one_sided=False`` the two neighbouring datasets are swapped too (DP bounds both directions), at
    the same thresholds: ``log(TNR_low - delta) - log(FNR_high)``. ``(0.0, inf)`` when no point gives a positive value."""
    false_negatives = points.num_in - points.true_positives
    fnr_high = clopper_pearson_upper(false_negatives, points.num_in, 1 - significance / 2)
    fpr_high = clopper_pearson_upper(points.false_positives, points.num_out, 1 - significance / 2)
    rules = [(1 - fnr_high, fpr_high)]
    if not one_sided:
        # DP bounds both directions (the datasets swap roles): P[out says out] <= e^eps P[in says out] + delta.
        rules.append((1 - fpr_high, fnr_high))
    best, best_threshold = 0.0, float("inf")
    for rate_low, other_high in rules:
        valid = np.flatnonzero(rate_low > delta)
        if valid.size == 0:
            continue
        with np.errstate(divide="ignore"):
            epsilons = np.log(rate_low[valid] - delta) - np.log(other_high[valid])
        index = int(np.argmax(epsilons))
        if epsilons[index] > best:
            best, best_threshold = float(epsilons[index]), float(points.thresholds[valid[index]])
    return best, best_threshold
