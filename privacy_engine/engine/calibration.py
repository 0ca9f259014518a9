"""The noise multiplier for an (epsilon, delta) target, its cache, and the warnings a target earns.

``calibrate`` is ``accountants.calibrate_noise_multiplier`` (whose guarantee it keeps) on a fresh
accountant of the engine's kind and settings, cached: choosing BandMF bands calibrates one sigma per
candidate, and tutorials repeat the same runs over seeds and epsilons. ``warn_if_delta_too_large``
and ``warn_if_noise_drowns_the_gradient`` say when a target is accepted but not what a user wants.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

import accountants
from accountants import Accountant, PLDAccountant, calibrate_noise_multiplier
from accountants.calibration import DEFAULT_TOLERANCE
from accountants.events import EventSpec

__all__ = [
    "COMPARISON_TOLERANCE",
    "calibrate",
    "comparison_accountant",
    "warn_if_delta_too_large",
    "warn_if_noise_drowns_the_gradient",
]

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
    steps: int, event: EventSpec, group_size: int | None, max_batch_size: int | None, tolerance: float,
) -> float:  # fmt: skip
    # Calibration is a deterministic function of these arguments (the accountant is rebuilt from
    # its settings), so caching cannot change a result, only skip recomputing it.
    accountant = accountant_type(**{k: list(v) if isinstance(v, tuple) else v for k, v in settings})
    return calibrate_noise_multiplier(
        target_epsilon, target_delta, sample_rate, steps, accountant=accountant, group_size=group_size,
        max_batch_size=max_batch_size, tolerance=tolerance, **event.step_kwargs(),
    )  # fmt: skip


def calibrate(accountant: Accountant, target: tuple[float, float], sample_rate: float, steps: int, *,
              event: EventSpec, group_size: int | None, max_batch_size: int | None,
              tolerance: float | None = None) -> float:  # fmt: skip
    """Smallest sigma meeting ``target`` for the mechanism stating ``event`` (its kind, parameters and
    bands: a custom mechanism is calibrated for the event it states) on ``accountant``'s kind and settings
    (``accountants.calibrate_noise_multiplier``, whose guarantee it keeps), cached. Records nothing
    on ``accountant``; raises ``accountants.CalibrationError`` as it does."""
    return _cached_calibration(
        type(accountant), _frozen_settings(accountant), target[0], target[1], float(sample_rate), int(steps),
        event, group_size, max_batch_size, DEFAULT_TOLERANCE if tolerance is None else float(tolerance),
    )  # fmt: skip


def comparison_accountant(accountant: Accountant) -> Accountant:
    """A fresh accountant of ``accountant``'s kind for comparing band counts (PLD: a grid no finer
    than ``COMPARISON_PLD_INTERVAL``)."""
    if isinstance(accountant, PLDAccountant):
        return PLDAccountant(value_discretization_interval=max(accountant.value_discretization_interval,
                                                               COMPARISON_PLD_INTERVAL))  # fmt: skip
    return accountant.fresh()


# ---------------------------------------------------------------------------------------------- warnings
_LIBRARY_FOLDERS = (str(Path(__file__).parents[1]) + os.sep, str(Path(accountants.__file__).parent) + os.sep)


def _outside_the_library() -> int:
    """The ``stacklevel`` of the first caller outside privacy_engine and accountants (the user's line:
    ``make_private_with_epsilon``, or a subclass's method, may be reached by any path)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_FOLDERS):
        frame, level = frame.f_back, level + 1
    return level


def warn_if_delta_too_large(target_delta: float | None, num_examples: int) -> None:
    """Warn when ``target_delta >= 1 / num_examples`` (the usual rule: delta well below 1/N).

    Why the rule: releasing one example chosen at random, in full, is (0, 1/N)-DP; a guarantee with
    delta >= 1/N therefore allows publishing examples outright. Values outside (0, 1) never get here
    (``PrivacyOptions`` refuses them, naming ``target_delta``). None (no target, no budget): nothing.
    """
    if target_delta is None or target_delta < 1.0 / num_examples:
        return
    warnings.warn(
        f"target_delta={target_delta:g} is at least 1/N = 1/{num_examples} = {1.0 / num_examples:.3g} (N: the "
        f"{num_examples} examples the loader samples from). Releasing one example chosen at random, in full, "
        f"is (0, 1/N)-DP, so a guarantee with delta >= 1/N allows publishing examples outright. The usual rule is "
        f"delta well below 1/N, e.g. 1/N**1.1 = {num_examples ** -1.1:.2g}.",
        UserWarning,
        stacklevel=_outside_the_library(),
    )


def warn_if_noise_drowns_the_gradient(*, noise_multiplier: float, expected_batch_size: float,
                                      target: tuple[float, float], steps: int) -> None:  # fmt: skip
    """Warn when a calibrated DP-SGD noise multiplier is larger than the expected batch size.

    The rule: each step adds Gaussian noise of std ``noise_multiplier * C / B`` to every coordinate
    of the averaged clipped gradient (C the clipping bound, B the expected batch size), while the
    whole averaged clipped gradient has norm at most C. ``noise_multiplier > B`` means the noise on
    *each single coordinate* is larger than the largest norm the *whole* gradient can have: every
    step's update is mostly noise, whatever the model (with ``loss_reduction="sum"`` both sides are
    B times larger, so the rule is the same). It is a warning, not an error: many steps average the
    noise out somewhat, and the guarantee holds regardless. Only for DP-SGD (BandMF's per-step noise
    is a combination of several rows, which this simple rule does not describe).
    """
    if noise_multiplier <= expected_batch_size:
        return
    epsilon, delta = target
    warnings.warn(
        f"make_private_with_epsilon calibrated noise_multiplier={noise_multiplier:.4g} for target_epsilon="
        f"{epsilon:g}, target_delta={delta:g} over {steps} steps: each step adds noise of std noise_multiplier * "
        f"max_grad_norm / expected_batch_size = {noise_multiplier:.4g} * C / {expected_batch_size:g} = "
        f"{noise_multiplier / expected_batch_size:.3g} C to every coordinate of the averaged gradient, more than "
        f"C (max_grad_norm), the largest norm the whole averaged clipped gradient can have. Training is unlikely "
        f"to learn anything: raise target_epsilon, use larger batches or more examples, or train fewer epochs.",
        UserWarning,
        stacklevel=_outside_the_library(),
    )
