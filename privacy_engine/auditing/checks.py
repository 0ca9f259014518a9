"""Argument checks shared by the auditing estimators: score arrays, confidence, delta."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def as_scores(scores: ArrayLike, name: str) -> np.ndarray:
    """``scores`` as a read-only 1-D float64 copy; ``ValueError`` naming ``name`` if it is empty, not 1-D, or holds
    NaN or +-inf (an infinite score would coincide with the threshold that classifies nothing as held in)."""
    array = np.array(scores, dtype=np.float64)  # a copy: the auditor's scores cannot change under it
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-dimensional, got {array.ndim} dimensions")
    if array.size == 0:
        raise ValueError(f"{name} must not be empty: a bound needs at least one held-in and one held-out score")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    array.setflags(write=False)
    return array


def check_confidence(confidence: float) -> float:
    """``confidence`` as a float in (0, 1); ``ValueError`` naming it otherwise."""
    confidence = float(confidence)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1) (e.g. 0.95), got {confidence}")
    return confidence


def check_delta(delta: float, *, positive: bool = False) -> float:
    """``delta`` as a float in [0, 1) (in (0, 1) with ``positive``); ``ValueError`` naming it otherwise."""
    delta = float(delta)
    low_ok = delta > 0.0 if positive else delta >= 0.0
    if not (low_ok and delta < 1.0):
        allowed = "(0, 1)" if positive else "[0, 1)"
        raise ValueError(f"delta must be in {allowed}, got {delta}")
    return delta
