"""The group size truncated sampling is accounted at.

Truncated Poisson sampling's privacy depends on how many examples a batch is drawn from, and not
monotonically: with q = 0.1, a cap of 8, sigma = 1 and 100 participations, dp-accounting gives epsilon
14.0 / 24.0 / 17.0 (delta 1e-5) for groups of 50 / 100 / 200 examples (truncation costs most when the
expected batch is near the cap). Cyclic groups are assigned independently per example, so their sizes
differ; every example must be covered, so the step is accounted at the size whose epsilon is the
largest, not at the largest size.
"""

from __future__ import annotations

from collections.abc import Iterable

from accountants import Accountant
from privacy_engine.engine.calibration import calibrate

__all__ = ["DEFAULT_CHOICE_DELTA", "worst_group_size"]

#: The delta the worst size is chosen at when no target or budget delta is given.
DEFAULT_CHOICE_DELTA = 1e-5


def worst_group_size(
    sizes: Iterable[int], *, accountant: Accountant, target: tuple[float, float] | None, noise_multiplier: float,
    sample_rate: float, steps: int, num_bands: int, max_batch_size: int, delta: float | None,
) -> tuple[int, float]:  # fmt: skip
    """``(group_size, noise_multiplier)`` to account every step with, over the realised group ``sizes``.

    Guarantee: with a ``target``, the noise multiplier is the largest of the ones calibrated for each
    size (so the target holds for an example of any group), and the size is the one that needed it.
    Without, the size is the one with the largest epsilon after ``steps`` steps at ``delta``: then the
    reported epsilon covers every group at that delta. Records nothing on ``accountant``.

    ============================  ===================================================
    case                          result
    ============================  ===================================================
    one distinct size             that size, no epsilon computed
    target given                  one (cached) calibration per distinct size
    no target, ``delta`` None     the choice is made at ``DEFAULT_CHOICE_DELTA``
    other deltas asked later      epsilon of the chosen size (the order of sizes can
                                  differ between deltas; sizes differ by a few %)
    ============================  ===================================================
    """
    distinct = sorted({int(size) for size in sizes})
    if target is not None:
        sigmas = {
            size: calibrate(accountant, target, sample_rate, steps, num_bands=num_bands, group_size=size,
                            max_batch_size=max_batch_size)
            for size in distinct
        }
        worst = max(distinct, key=lambda size: (sigmas[size], size))
        return worst, sigmas[worst]
    if len(distinct) == 1:
        return distinct[0], noise_multiplier
    choice_delta = DEFAULT_CHOICE_DELTA if delta is None else delta
    epsilons = {
        size: accountant.fresh().epsilon_if(choice_delta, noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                                            num_steps=steps, num_bands=num_bands, group_size=size,
                                            max_batch_size=max_batch_size)
        for size in distinct
    }
    return max(distinct, key=lambda size: (epsilons[size], size)), noise_multiplier
