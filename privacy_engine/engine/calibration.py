"""The noise multiplier for an (epsilon, delta) target, and its cache.

``calibrate`` is ``accountants.calibrate_noise_multiplier`` (whose guarantee it keeps) on a fresh
accountant of the engine's kind and settings, cached: choosing BandMF bands calibrates one sigma per
candidate, and tutorials repeat the same runs over seeds and epsilons.
"""

from __future__ import annotations

import functools

from accountants import Accountant, PLDAccountant, calibrate_noise_multiplier
from accountants.calibration import DEFAULT_TOLERANCE

__all__ = ["COMPARISON_TOLERANCE", "calibrate", "comparison_accountant"]

# Comparing band counts needs each one's sigma only roughly (the criterion is compared, not
# promised): a coarser PLD grid and search tolerance make it ~3-5x cheaper. The chosen b is then
# calibrated again on the engine's own accountant, which is what the guarantee rests on.
COMPARISON_PLD_INTERVAL = 1e-3
COMPARISON_TOLERANCE = 1e-2


def _frozen_settings(accountant: Accountant) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in accountant.settings().items()))


@functools.lru_cache(maxsize=1024)
def _cached_calibration(
    accountant_type: type, settings: tuple, target_epsilon: float, target_delta: float, sample_rate: float,
    steps: int, num_bands: int, group_size: int | None, max_batch_size: int | None, tolerance: float,
) -> float:  # fmt: skip
    # Calibration is a deterministic function of these arguments (the accountant is rebuilt from
    # its settings), so caching cannot change a result, only skip recomputing it.
    accountant = accountant_type(**{k: list(v) if isinstance(v, tuple) else v for k, v in settings})
    return calibrate_noise_multiplier(
        target_epsilon, target_delta, sample_rate, steps, accountant=accountant, num_bands=num_bands,
        group_size=group_size, max_batch_size=max_batch_size, tolerance=tolerance,
    )  # fmt: skip


def calibrate(accountant: Accountant, target: tuple[float, float], sample_rate: float, steps: int, *,
              num_bands: int, group_size: int | None, max_batch_size: int | None,
              tolerance: float | None = None) -> float:  # fmt: skip
    """Smallest sigma meeting ``target`` for this mechanism on ``accountant``'s kind and settings
    (``accountants.calibrate_noise_multiplier``, whose guarantee it keeps), cached. Records nothing
    on ``accountant``; raises ``accountants.CalibrationError`` as it does."""
    return _cached_calibration(
        type(accountant), _frozen_settings(accountant), target[0], target[1], float(sample_rate), int(steps),
        int(num_bands), group_size, max_batch_size, DEFAULT_TOLERANCE if tolerance is None else float(tolerance),
    )  # fmt: skip


def comparison_accountant(accountant: Accountant) -> Accountant:
    """A fresh accountant of ``accountant``'s kind for comparing band counts (PLD: a grid no finer
    than ``COMPARISON_PLD_INTERVAL``)."""
    if isinstance(accountant, PLDAccountant):
        return PLDAccountant(value_discretization_interval=max(accountant.value_discretization_interval,
                                                               COMPARISON_PLD_INTERVAL))  # fmt: skip
    return accountant.fresh()
