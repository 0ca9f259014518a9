"""The group size truncated sampling is accounted at.

Truncated Poisson sampling's privacy depends on how many examples a batch is drawn from, and not
monotonically: with q = 0.1, a cap of 8, sigma = 1 and 100 participations, dp-accounting gives epsilon
14.0 / 24.0 / 17.0 (delta 1e-5) for groups of 50 / 100 / 200 examples (truncation costs most when the
expected batch is near the cap). Cyclic groups are assigned independently per example, so their sizes
differ; every example must be covered, so the step is accounted at the size whose epsilon is the
largest, not at the largest size.

Which sizes. dp-accounting's ``dataset_size`` is the number of examples sampled from *including* the
example whose privacy is measured (its truncation probability is over the ``dataset_size - 1`` others).
Under add/remove adjacency the run is on D: an example removed from D was one of its group's ``|g|``
members, and an example added to D joins a group that then has ``|g| + 1`` members. So the candidates are
``|g|`` and ``|g| + 1`` for every realised size ``|g|`` (with q = 0.08, a cap of 8, sigma 1 and 400 steps,
epsilon is 18.9951 at |g| = 106 and 19.0774 at 107).
"""

from __future__ import annotations

from collections.abc import Iterable

from accountants import Accountant
from accountants.events import EventSpec
from privacy_engine.engine.calibration import calibrate

__all__ = ["DEFAULT_CHOICE_DELTA", "worst_group_size"]

#: The delta the worst size is chosen at when no target or budget delta is given.
DEFAULT_CHOICE_DELTA = 1e-5


def worst_group_size(
    sizes: Iterable[int], *, accountant: Accountant, target: tuple[float, float] | None, noise_multiplier: float,
    sample_rate: float, steps: int, event: EventSpec, max_batch_size: int, delta: float | None,
) -> tuple[int, float]:  # fmt: skip
    """``(group_size, noise_multiplier)`` to account every step with, over the realised group ``sizes``.

    The candidates are every realised size ``|g|`` (an example removed from D) and ``|g| + 1`` (an
    example added to D joins a group of ``|g|``): see the module docstring.

    Guarantee: with a ``target``, the noise multiplier is the largest of the ones calibrated for each
    candidate (so the target holds for an example removed from or added to any group), and the size is
    the one that needed it. Without, the size is the candidate with the largest epsilon after ``steps``
    steps at ``delta``: then the reported epsilon covers every group and both directions of adjacency at
    that delta. Records nothing on ``accountant``.

    ============================  ===================================================
    case                          result
    ============================  ===================================================
    one distinct size s           candidates s and s + 1 (two epsilons computed)
    sizes empty                   ValueError (there is no group to account for)
    target given                  one (cached) calibration per distinct size
    no target, ``delta`` None     the choice is made at ``DEFAULT_CHOICE_DELTA``
    other deltas asked later      epsilon of the chosen size (the order of sizes can
                                  differ between deltas; sizes differ by a few %)
    ============================  ===================================================
    """
    realised = {int(size) for size in sizes}
    if not realised:
        raise ValueError("worst_group_size needs the realised group sizes; got none")
    # |g| (the removed example's group in D) and |g| + 1 (an added example's group in D').
    distinct = sorted(realised | {size + 1 for size in realised})
    if target is not None:
        sigmas = {
            size: calibrate(accountant, target, sample_rate, steps, event=event, group_size=size,
                            max_batch_size=max_batch_size)
            for size in distinct
        }
        worst = max(distinct, key=lambda size: (sigmas[size], size))
        return worst, sigmas[worst]
    choice_delta = DEFAULT_CHOICE_DELTA if delta is None else delta
    epsilons = {
        size: accountant.fresh().epsilon_if(choice_delta, noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                                            num_steps=steps, group_size=size, max_batch_size=max_batch_size,
                                            **event.step_kwargs())
        for size in distinct
    }
    return max(distinct, key=lambda size: (epsilons[size], size)), noise_multiplier
