"""Smallest noise multiplier that meets an (epsilon, delta) target.

Every epsilon here comes from an `Accountant`, that is from dp-accounting. The search only decides
where to evaluate:

1. For the PLD accountant, cheap coarse grids first. A PLD on a grid of step v costs about 1/v
   and, being pessimistic, overestimates epsilon by roughly 0.05-0.2 % times
   (v * participations / epsilon)^2 (measured on DP-SGD; a heuristic, not a bound). So the root is found on a coarse grid
   (ratio ~8), refined on a medium grid (ratio ~0.5), and only then touched on the accountant's
   own grid. The RDP accountant is cheap and is searched directly.
2. log(epsilon) is close to linear in log(sigma). The first grid brackets the root by Newton
   steps from a rough guess and finishes with Brent's method; each later grid starts at the
   previous root and needs one to three secant steps.
3. The answer is the smallest sigma evaluated on the accountant's own settings with epsilon <= target.
   That evaluation is the ordinary public path (fresh accountant, `step`, `get_epsilon`), so the
   guarantee holds whatever the heuristics did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import dp_accounting
from scipy import optimize

from accountants._validation import (
    check_delta,
    check_int,
    check_num_bands,
    check_real,
    check_sample_rate,
    check_truncation,
)
from accountants.base import Accountant
from accountants.events import DEFAULT_EVENT_KIND, max_participations
from accountants.pld import PLDAccountant
from accountants.registry import make_accountant

__all__ = ["CalibrationError", "calibrate_noise_multiplier"]

#: Search range for sigma. Below 0.1 a fine PLD grid needs tens of millions of points
#: (the privacy loss range grows like 1/sigma^2) and such targets are not private in practice.
SIGMA_MIN = 0.1
SIGMA_MAX = 1e6
DEFAULT_TOLERANCE = 2e-3
#: Most steps a PLD calibration composes: its search time grows with them (measured on 2 CPU
#: cores, q=0.01: 10**6 steps 8 s, 10**7 steps 148 s). RDP calibration is cheap at any count.
MAX_PLD_CALIBRATION_STEPS = 10**6

# Grid step / (target_epsilon / participations) for the coarse and medium PLD grids (see 1. above).
_COARSE_GRID_RATIO = 8.0
_MEDIUM_GRID_RATIO = 0.5
_COARSE_GRID_MAX = 2e-2
_MEDIUM_GRID_MAX = 2e-3
# A grid less than this many times coarser than the next one saves too little to be worth a stage.
_MIN_GRID_SPEEDUP = 3.0
_COARSE_XTOL = 1e-2  # in log(sigma): the coarse grid's own bias is larger than this
_MAX_REFINE_STEPS = 6


class CalibrationError(ValueError):
    """The target cannot be bracketed within [SIGMA_MIN, SIGMA_MAX].

    `unreachable` is True when epsilon is still above the target at SIGMA_MAX, False when it is
    already below the target at SIGMA_MIN.
    """

    def __init__(self, message: str, *, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    *,
    accountant: str | Accountant = "pld",
    num_bands: int = 1,
    group_size: int | None = None,
    max_batch_size: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    mechanism: str = DEFAULT_EVENT_KIND,
    mechanism_parameters: Mapping[str, Any] | None = None,
) -> float:
    """Smallest noise multiplier whose epsilon at `target_delta` is at most `target_epsilon`.

    The mechanism is the one `Accountant.step` records: `steps` DP-SGD steps (num_bands = 1) or
    BandMF steps with cyclic Poisson sampling over `num_bands` groups, optionally truncated
    (`group_size`, `max_batch_size`), with Poisson sampling probability `sample_rate`; or the event
    kind a noise mechanism states (`mechanism`, `mechanism_parameters`: `EventSpec.step_kwargs()`).

    Guarantee: for the returned sigma, a fresh accountant of the requested kind and settings,
    after `step(noise_multiplier=sigma, sample_rate=..., num_steps=steps, ...)`, reports
    `get_epsilon(target_delta) <= target_epsilon`. This is checked at full precision before
    returning; a sigma that fails the check is never returned. Tightness (best effort): the
    sigma is within about `tolerance` (relative) of the smallest such sigma.

    =======================================  =============================================
    case                                     result
    =======================================  =============================================
    steps = 0 or sample_rate = 0             0.0 (nothing data-dependent is released)
    sample_rate = 1                          full-batch Gaussian; works for tiny epsilon
    target met only above SIGMA_MAX = 1e6    CalibrationError (a ValueError) saying so
    target met already at SIGMA_MIN = 0.1    0.1 (verified; looser targets are not tightened)
    truncation with accountant="rdp"         NotImplementedError naming PLDAccountant
    accountant instance with history         ValueError (pass an empty one)
    target_epsilon <= 0, delta not in (0,1)  ValueError naming the argument
    PLD with steps > 10**6                   ValueError naming steps (MAX_PLD_CALIBRATION_STEPS)
    =======================================  =============================================

    Args:
        target_epsilon: epsilon budget, > 0.
        target_delta: delta, in (0, 1).
        sample_rate: Poisson sampling probability q, in [0, 1].
        steps: number of training steps, >= 0.
        accountant: "pld" (default), "rdp", or an empty `Accountant` whose settings to use
            (e.g. `PLDAccountant(value_discretization_interval=1e-3)`).
        num_bands: BandMF bands b >= 1 (1 is DP-SGD).
        group_size: examples sampled from per step, for truncated sampling (with max_batch_size).
        max_batch_size: batch size cap, for truncated sampling (with group_size).
        tolerance: relative precision of the search in sigma, in (0, 0.1].
        mechanism: the event kind (`accountants.events.register_event_kind`); default DP-SGD / BandMF.
        mechanism_parameters: that kind's parameters (plain values).
    """
    target_epsilon = check_real(
        "target_epsilon", target_epsilon, low=0.0, low_open=True
    )
    target_delta = check_delta(target_delta, "target_delta")
    kind = mechanism
    mechanism = _mechanism(sample_rate, steps, num_bands, group_size, max_batch_size)  # the step's kwargs
    if mechanism_parameters or kind != DEFAULT_EVENT_KIND:
        mechanism.update(mechanism=kind, mechanism_parameters=dict(mechanism_parameters or {}))
    tolerance = check_real("tolerance", tolerance, low=0.0, high=0.1, low_open=True)
    template = _resolve_accountant(accountant)
    if isinstance(template, PLDAccountant) and mechanism["num_steps"] > MAX_PLD_CALIBRATION_STEPS:
        raise ValueError(
            f"steps={mechanism['num_steps']} exceeds MAX_PLD_CALIBRATION_STEPS={MAX_PLD_CALIBRATION_STEPS}: calibrating "
            "a PLD accountant's noise over them takes minutes (10**7 steps: 148 s) and the time grows with the steps; "
            'use fewer steps, or accountant="rdp"'
        )
    # Raises NotImplementedError (e.g. RDP + truncation) before any search work.
    template.fresh().step(noise_multiplier=1.0, **{**mechanism, "num_steps": 0})

    final = _EpsilonGap(template, mechanism, target_epsilon, target_delta)
    participations = max_participations(mechanism["num_steps"], mechanism["num_bands"])
    if (participations == 0 or mechanism["sample_rate"] == 0.0) and final.epsilon(0.0) <= target_epsilon:
        return 0.0

    log_sigma = math.log(
        _initial_guess(target_epsilon, target_delta, mechanism["sample_rate"], participations)
    )
    return _search(_levels(final, participations), log_sigma, tolerance)


# --------------------------------------------------------------------------- internals
def _mechanism(
    sample_rate: float, steps: int, num_bands: int, group_size: int | None, max_batch_size: int | None
) -> dict[str, Any]:
    """The validated `Accountant.step` keyword arguments (all but the noise multiplier)."""
    sample_rate = check_sample_rate(sample_rate)
    steps = check_int("steps", steps, low=0)
    num_bands = check_num_bands(num_bands)
    group_size, max_batch_size = check_truncation(group_size, max_batch_size)
    return {
        "sample_rate": sample_rate,
        "num_steps": steps,
        "num_bands": num_bands,
        "group_size": group_size,
        "max_batch_size": max_batch_size,
    }


def _levels(final: _EpsilonGap, participations: int) -> list[_EpsilonGap]:
    """The gaps to search in turn: on the coarser PLD grids of `_coarse_grids` (none unless `final`
    is a PLD accountant), then `final` itself."""
    return [
        _EpsilonGap(
            PLDAccountant(value_discretization_interval=interval),
            final.mechanism,
            final.target_epsilon,
            final.target_delta,
        )
        for interval in _coarse_grids(final.template, final.target_epsilon, participations)
    ] + [final]


def _search(gaps: list[_EpsilonGap], log_sigma: float, tolerance: float) -> float:
    """The smallest sigma found passing the last of `gaps` (the requested accountant), searching
    each gap in turn from `log_sigma`: bracket on the first, refine on the later ones.

    Guarantee: the returned sigma was evaluated on the last gap with epsilon <= target.
    """
    final = gaps[-1]
    slope = -1.0
    try:
        # The first level starts from a rough guess and brackets; later ones start next to the root.
        _, log_sigma, slope = _solve(
            gaps[0], log_sigma, slope, _COARSE_XTOL if len(gaps) > 1 else tolerance / 2
        )
        for gap in gaps[1:-1]:
            # Land well inside the tolerance: the final level is meant to need a single evaluation.
            log_sigma, slope = _refine(gap, log_sigma, slope, tolerance / 4)
    except CalibrationError as error:
        if not error.unreachable and final.epsilon(SIGMA_MIN) <= final.target_epsilon:
            # A loose target already met at the bottom of the search range: SIGMA_MIN satisfies it
            # (checked just now on the requested accountant), it is only not the tightest answer.
            return SIGMA_MIN
        # A coarse grid's pessimism can put a tiny target out of its reach but not out of the
        # final accountant's: only the final accountant may declare a target unreachable.
        if not error.unreachable or gaps[0] is final:
            raise
        _, log_sigma, slope = _solve(final, math.log(SIGMA_MAX), slope, tolerance / 2)
    log_sigma, _ = _refine(final, log_sigma, slope, tolerance)
    # The guarantee: this exact float was evaluated on the requested accountant and passed.
    # (An explicit check rather than an assert, which `python -O` would strip.)
    if not final.epsilons[log_sigma] <= final.target_epsilon:
        raise RuntimeError(
            "internal error: calibration was about to return an unverified sigma"
        )
    return _sigma(log_sigma)


class _EpsilonGap:
    """log(epsilon(sigma)) - log(target) as a function of log(sigma), for one accountant setting.

    Memoised by log(sigma), so that a point is never evaluated twice and the returned sigma is
    exactly the float that was checked. Evaluated through the public path (fresh accountant,
    `step`, `get_epsilon`) so that the final check is what a user would compute.
    """

    _TINY = 1e-300

    def __init__(
        self,
        template: Accountant,
        mechanism: dict[str, Any],
        target_epsilon: float,
        target_delta: float,
    ) -> None:
        self.template = template
        self.mechanism = mechanism
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self.values: dict[float, float] = {}
        self.epsilons: dict[float, float] = {}

    def epsilon(self, sigma: float) -> float:
        accountant = self.template.fresh()
        accountant.step(noise_multiplier=sigma, **self.mechanism)
        return accountant.get_epsilon(self.target_delta)

    def __call__(self, log_sigma: float) -> float:
        if log_sigma not in self.values:
            epsilon = self.epsilon(_sigma(log_sigma))
            # Clamp so that epsilon = 0 or inf stays usable by the root finder.
            value = math.log(min(max(epsilon, self._TINY), 1 / self._TINY)) - math.log(
                self.target_epsilon
            )
            # The sign must agree with the exact comparison, which log rounding might not.
            value = (
                min(value, 0.0)
                if epsilon <= self.target_epsilon
                else max(value, self._TINY)
            )
            self.values[log_sigma] = value
            self.epsilons[log_sigma] = epsilon
        return self.values[log_sigma]


def _sigma(log_sigma: float) -> float:
    return float(math.exp(log_sigma))


def _resolve_accountant(accountant: str | Accountant) -> Accountant:
    if isinstance(accountant, Accountant):
        if accountant.steps:
            raise ValueError(
                "accountant must be empty (its settings are used, not its history); got one with "
                f"{accountant.steps} steps. Pass accountant.fresh() or a name."
            )
        return accountant.fresh()
    if isinstance(accountant, str):
        try:
            return make_accountant(accountant)
        except ValueError as error:
            raise ValueError(f"accountant: {error}") from None
    raise TypeError(
        f"accountant must be 'pld', 'rdp' or an Accountant instance; got {type(accountant).__name__}."
    )


def _initial_guess(
    target_epsilon: float, target_delta: float, sample_rate: float, participations: int
) -> float:
    """A starting point only: sigma for a full-batch Gaussian composed `participations` times,
    scaled by q (the small-q, many-step regime). Never trusted, only evaluated."""
    full_batch = dp_accounting.get_sigma_gaussian(
        target_epsilon, target_delta
    ) * math.sqrt(max(participations, 1))
    guess = min(max(sample_rate * full_batch, 0.6), full_batch)
    return min(max(guess, SIGMA_MIN), SIGMA_MAX)


def _coarse_grids(
    template: Accountant, target_epsilon: float, participations: int
) -> list[float]:
    """Coarser PLD grid steps to search before touching `template`; none for other accountants."""
    if not isinstance(template, PLDAccountant):
        return []
    finest = template.value_discretization_interval
    scale = target_epsilon / max(participations, 1)
    medium = min(
        max(_MEDIUM_GRID_RATIO * scale, _MIN_GRID_SPEEDUP * finest), _MEDIUM_GRID_MAX
    )
    coarse = min(_COARSE_GRID_RATIO * scale, _COARSE_GRID_MAX)
    grids = []
    if coarse >= _MIN_GRID_SPEEDUP * max(medium, finest):
        grids.append(coarse)
    if medium >= _MIN_GRID_SPEEDUP * finest:
        grids.append(medium)
    return grids


def _solve(
    gap: _EpsilonGap, log_sigma: float, slope: float, xtol: float
) -> tuple[float, float, float]:
    """Bracket and solve gap(sigma) = 0 in log(sigma).

    Returns (log of the largest sigma seen with gap > 0, log of the smallest with gap <= 0,
    secant slope d gap / d log sigma across the bracket).
    """
    log_min, log_max = math.log(SIGMA_MIN), math.log(SIGMA_MAX)
    log_sigma = min(max(log_sigma, log_min), log_max)
    value = gap(log_sigma)
    points = [(log_sigma, value)]
    # Newton steps with some overshoot, so that the next point likely lands past the root.
    while not (any(v > 0 for _, v in points) and any(v <= 0 for _, v in points)):
        step = -value / slope
        step = math.copysign(min(max(abs(step) * 1.25 + xtol, xtol), 1.5), step)
        new_log_sigma = min(max(log_sigma + step, log_min), log_max)
        if new_log_sigma == log_sigma:
            _raise_bracket_failure(gap, new_log_sigma)
        new_value = gap(new_log_sigma)
        secant = (new_value - value) / (new_log_sigma - log_sigma)
        if math.isfinite(secant) and secant < 0:
            slope = min(max(secant, -50.0), -0.05)
        log_sigma, value = new_log_sigma, new_value
        points.append((log_sigma, value))
    low = max(x for x, v in points if v > 0)
    high = min(x for x, v in points if v <= 0)
    if high > low:
        slope = _secant(gap(low), gap(high), low, high, slope)
        optimize.brentq(gap, low, high, xtol=xtol)
        # Brent's last iterate may sit on either side; take the tightest bracket it evaluated.
        evaluated = [(x, v) for x, v in gap.values.items() if low <= x <= high]
        low = max((x for x, v in evaluated if v > 0), default=low)
        high = min((x for x, v in evaluated if v <= 0), default=high)
    return low, high, slope


def _secant(
    value_low: float, value_high: float, low: float, high: float, fallback: float
) -> float:
    secant = (value_high - value_low) / (high - low)
    return (
        min(max(secant, -50.0), -0.05)
        if math.isfinite(secant) and secant < 0
        else fallback
    )


def _refine(
    gap: _EpsilonGap, log_sigma: float, slope: float, accept: float
) -> tuple[float, float]:
    """Secant steps on `gap` from a point near the root, aiming just above it.

    Returns (log sigma of the smallest passing point, slope) once a passing point is within
    about `accept` of the root (by the local slope, or by a failing point below it). Typically one
    or two evaluations. Falls back to `_solve` if no passing point turns up.
    """
    # log sigma of the smallest sigma seen with epsilon <= target, and of the largest with >.
    best_ok: float | None = None
    worst_bad: float | None = None
    previous: tuple[float, float] | None = None
    for _ in range(_MAX_REFINE_STEPS):
        value = gap(log_sigma)
        # Points closer than this differ mostly by discretisation jitter, not by the slope.
        if previous is not None and abs(log_sigma - previous[0]) >= 1e-4:
            slope = _secant(previous[1], value, previous[0], log_sigma, slope)
        previous = (log_sigma, value)
        if value <= 0:
            best_ok = log_sigma if best_ok is None else min(best_ok, log_sigma)
            # value / slope (>= 0): how far log sigma could still shrink.
            if value / slope <= accept:
                break
        else:
            worst_bad = log_sigma if worst_bad is None else max(worst_bad, log_sigma)
        if (
            best_ok is not None
            and worst_bad is not None
            and best_ok - worst_bad <= accept
        ):
            break
        next_log_sigma = log_sigma - value / slope + accept / 2
        if best_ok is not None and worst_bad is not None:
            if not worst_bad < next_log_sigma < best_ok:
                next_log_sigma = (worst_bad + best_ok) / 2
        elif worst_bad is not None:
            next_log_sigma = max(next_log_sigma, worst_bad + accept / 2)
        log_sigma = next_log_sigma
    if best_ok is None:
        # The previous level misled us (not expected): bracket on this level.
        _, best_ok, slope = _solve(gap, log_sigma, slope, accept / 2)
    return best_ok, slope


def _raise_bracket_failure(gap: _EpsilonGap, log_sigma: float) -> None:
    epsilon = gap.epsilons[log_sigma]
    target = gap.target_epsilon
    settings = ", ".join(
        f"{key}={value!r}"
        for key, value in gap.template.settings().items()
        if key != "orders"
    )
    accountant = f"{type(gap.template).__name__}({settings})"
    if gap.values[log_sigma] > 0:
        raise CalibrationError(
            f"target_epsilon={target:g} is unreachable: {accountant} gives epsilon {epsilon:g} even at "
            f"noise_multiplier={SIGMA_MAX:g}, the top of the search range (bracket failure). "
            "Raise target_epsilon or target_delta, or lower sample_rate or steps.",
            unreachable=True,
        )
    raise CalibrationError(
        f"could not bracket noise_multiplier: {accountant} gives epsilon {epsilon:g} <= "
        f"target_epsilon={target:g} "
        f"already at noise_multiplier={SIGMA_MIN:g}, the bottom of the search range. Such a loose "
        "target is outside what calibration supports; choose the noise multiplier directly and "
        "check it with an accountant's get_epsilon.",
        unreachable=False,
    )
