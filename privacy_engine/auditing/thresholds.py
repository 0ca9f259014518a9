"""How an estimator picks the threshold of the attack: explicit, Bonferroni over all, or split.

A bound at confidence ``c`` holds for one threshold fixed before the scores are seen. Searching all
thresholds for the best one needs a correction, which is what a strategy says:

* ``Explicit(threshold)``: the threshold is given; the bound holds at confidence ``c`` as it is.
* ``Bonferroni()``: every vertex of the ROC hull (``RocPoints.hull``) is tried at confidence
  ``1 - (1 - c) / k`` for ``k`` vertices, and the best is returned.
* ``Split(fraction, seed)``: a random ``fraction`` of the held-in and of the held-out scores picks the best
  threshold (uncorrected); the rest gives the bound at that threshold, at confidence ``c``.

As in JAX Privacy, the Bonferroni ``k`` is the number of hull vertices of the observed scores, a set that
depends on the scores; ``Split`` is the strategy whose guarantee needs no such caveat.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from privacy_engine.auditing.roc import RocPoints

#: An estimator at a set of ROC points: ``(points, significance) -> (best value, its threshold)``;
#: ``significance`` is one minus the confidence of the bound at one point.
BestAtPoints = Callable[[RocPoints, float], tuple[float, float]]


@dataclasses.dataclass(frozen=True)
class Explicit:
    """Use this threshold (scores >= threshold are guessed held in)."""

    threshold: float

    def __post_init__(self) -> None:
        if np.isnan(self.threshold):
            raise ValueError("threshold must be a number, got nan")


@dataclasses.dataclass(frozen=True)
class Bonferroni:
    """Try every ROC hull vertex, each at significance ``(1 - confidence) / number of vertices``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split:
    """Choose the threshold on ``fraction`` of the scores, bound on the rest (``seed``: the partition's,
    ``numpy.random.default_rng``; None for OS entropy)."""

    fraction: float = 0.5
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {self.fraction}")


ThresholdStrategy = Explicit | Bonferroni | Split


def best_over_thresholds(
    strategy: ThresholdStrategy, in_scores: np.ndarray, out_scores: np.ndarray, significance: float,
    best_at: BestAtPoints,
) -> float:  # fmt: skip
    """The estimate ``best_at`` gives under ``strategy`` (see the module docstring)."""
    if isinstance(strategy, Explicit):
        return best_at(RocPoints.at_threshold(in_scores, out_scores, strategy.threshold), significance)[0]
    if isinstance(strategy, Bonferroni):
        points = RocPoints.hull(in_scores, out_scores)
        return best_at(points, significance / len(points))[0]
    if isinstance(strategy, Split):
        rng = np.random.default_rng(strategy.seed)
        choose_in, bound_in = _partition(in_scores, rng, strategy.fraction, "in_scores")
        choose_out, bound_out = _partition(out_scores, rng, strategy.fraction, "out_scores")
        _, threshold = best_at(RocPoints.hull(choose_in, choose_out), significance)
        return best_at(RocPoints.at_threshold(bound_in, bound_out, threshold), significance)[0]
    raise TypeError(f"threshold must be Explicit, Bonferroni or Split, got {strategy!r}")


def _partition(scores: np.ndarray, rng: np.random.Generator, fraction: float, name: str) -> tuple[np.ndarray, ...]:
    # The same draws as JAX Privacy's split (one permutation per score set, in then out), so a seed gives
    # the same partition in both libraries.
    split = int(len(scores) * fraction)
    if split == 0 or split == len(scores):
        raise ValueError(
            f"{name} has {len(scores)} scores: Split(fraction={fraction}) leaves one side empty; "
            "use more canaries or another threshold strategy"
        )
    order = rng.permutation(len(scores))
    return scores[order[:split]], scores[order[split:]]
