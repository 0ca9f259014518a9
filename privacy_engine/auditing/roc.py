"""The ROC of a threshold attack on canary scores: true/false positive counts per threshold.

The attack guesses "held in" for every canary whose score is at least the threshold. Tied scores are
always on the same side of every threshold; a classifier that randomises between two neighbouring
thresholds reaches every point on the segment between them, so only the vertices of the upper convex
hull of the ROC are kept (a point on or under the segment between its neighbours is never needed: the
estimators here are monotone along a segment). The first vertex is the threshold ``+inf`` (nothing
guessed, (0, 0)), the last the smallest score (everything guessed, (n_out, n_in)).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class RocPoints:
    """Thresholds (decreasing) with the held-in canaries at or above each (``true_positives``) and the
    held-out ones at or above each (``false_positives``), both non-decreasing; ``num_in`` / ``num_out``
    are the totals."""

    thresholds: np.ndarray
    true_positives: np.ndarray
    false_positives: np.ndarray
    num_in: int
    num_out: int

    def __len__(self) -> int:
        return len(self.thresholds)

    @classmethod
    def hull(cls, in_scores: np.ndarray, out_scores: np.ndarray) -> RocPoints:
        """The vertices of the ROC's upper convex hull over all thresholds (every distinct score and +inf)."""
        thresholds = np.concatenate(([np.inf], np.unique(np.concatenate((in_scores, out_scores)))[::-1]))
        true_positives = len(in_scores) - np.searchsorted(np.sort(in_scores), thresholds, side="left")
        false_positives = len(out_scores) - np.searchsorted(np.sort(out_scores), thresholds, side="left")
        keep = _upper_hull(false_positives, true_positives)
        return cls(
            thresholds=thresholds[keep], true_positives=true_positives[keep], false_positives=false_positives[keep],
            num_in=len(in_scores), num_out=len(out_scores),
        )  # fmt: skip

    @classmethod
    def at_threshold(cls, in_scores: np.ndarray, out_scores: np.ndarray, threshold: float) -> RocPoints:
        """The single point of one threshold (scores >= threshold are guessed held in)."""
        return cls(
            thresholds=np.array([float(threshold)]),
            true_positives=np.array([int(np.sum(in_scores >= threshold))]),
            false_positives=np.array([int(np.sum(out_scores >= threshold))]),
            num_in=len(in_scores), num_out=len(out_scores),
        )  # fmt: skip


def _upper_hull(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the vertices of the upper convex hull of the points (x, y), x non-decreasing; points on
    a segment between two others (collinear) are dropped (Andrew's monotone chain, one pass)."""
    kept: list[int] = []
    for index in range(len(x)):
        while len(kept) >= 2:
            a, b = kept[-2], kept[-1]
            # cross product of (b - a) and (index - b): <= 0 means b is on or under the segment a -> index
            cross = (y[b] - y[a]) * (x[index] - x[b]) - (y[index] - y[b]) * (x[b] - x[a])
            if cross > 0:
                break
            kept.pop()
        kept.append(index)
    return np.array(kept)
