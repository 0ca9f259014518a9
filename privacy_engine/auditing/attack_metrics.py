"""Attack metrics that are not privacy bounds: the best TPR at a given FPR, and the AUROC."""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata

from privacy_engine.auditing.roc import RocPoints


def tpr_at_fpr(points: RocPoints, fpr: float | np.ndarray) -> float | np.ndarray:
    """The largest TPR a threshold attack reaches at false positive rate ``fpr``, randomising between two
    neighbouring thresholds where needed (linear interpolation on the ROC hull ``points``)."""
    fpr = np.asarray(fpr, dtype=np.float64)
    if not np.all((fpr >= 0) & (fpr <= 1)):
        raise ValueError(f"fpr must be in [0, 1], got {fpr}")
    fpr_points = points.false_positives / points.num_out
    tpr_points = points.true_positives / points.num_in
    # np.interp would average a vertical segment (several TPRs at one FPR); the largest is wanted.
    right = np.minimum(np.searchsorted(fpr_points, fpr, side="right"), len(points) - 1)
    left = right - 1
    span = fpr_points[right] - fpr_points[left]
    weight = np.divide(fpr - fpr_points[left], span, out=np.ones_like(fpr), where=span > 0)
    result = tpr_points[left] + weight * (tpr_points[right] - tpr_points[left])
    return float(result) if result.ndim == 0 else result


def auroc_of_hull(points: RocPoints) -> float:
    """Area under the ROC hull (trapezoids between its vertices)."""
    fpr = points.false_positives / points.num_out
    tpr = points.true_positives / points.num_in
    return float(np.sum((fpr[1:] - fpr[:-1]) * (tpr[1:] + tpr[:-1]) / 2))


def auroc_of_scores(in_scores: np.ndarray, out_scores: np.ndarray) -> float:
    """``P[in score > out score] + P[equal] / 2`` (Mann-Whitney), the area under the plain ROC."""
    ranks = rankdata(np.concatenate((in_scores, out_scores)))  # ties get their mean rank
    num_in, num_out = len(in_scores), len(out_scores)
    return float((ranks[:num_in].sum() - num_in * (num_in + 1) / 2) / (num_in * num_out))
