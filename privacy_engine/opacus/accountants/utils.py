"""``opacus.accountants.utils.get_noise_multiplier`` on ``accountants.calibrate_noise_multiplier``."""

from __future__ import annotations

from typing import Any

from accountants import calibrate_noise_multiplier, make_accountant
from privacy_engine.engine.options import ACCOUNTANT_ALIASES

__all__ = ["get_noise_multiplier"]


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: int | None = None,
    steps: int | None = None,
    accountant: str = "rdp",
    epsilon_tolerance: float = 0.01,
    **_ignored: Any,
) -> float:
    """The smallest noise multiplier keeping ``steps`` DP-SGD steps (or ``int(epochs / sample_rate)``,
    as Opacus counts) at sample rate ``sample_rate`` within ``(target_epsilon, target_delta)``.

    Guarantee: ``accountants.calibrate_noise_multiplier``'s (epsilon at the returned sigma, computed
    by a fresh accountant of that kind, is at most ``target_epsilon``), which is tighter than
    Opacus's ``epsilon_tolerance`` (accepted, not needed). ``accountant``: ``"rdp"`` (Opacus's
    default here) or ``"prv"`` (PLD).

    ============================  ==========================================
    case                          result
    ============================  ==========================================
    both or neither of            ValueError (give exactly one)
    epochs / steps
    accountant "gdp" or unknown   ValueError naming accountant
    target out of reach           accountants.CalibrationError
    ============================  ==========================================
    """
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs and steps")
    if accountant not in ACCOUNTANT_ALIASES:
        raise ValueError(f"accountant must be 'rdp' or 'prv' ('gdp' is not provided); got {accountant!r}")
    if steps is None:
        steps = int(epochs / sample_rate)
    return calibrate_noise_multiplier(
        target_epsilon, target_delta, sample_rate, steps, accountant=make_accountant(ACCOUNTANT_ALIASES[accountant])
    )
