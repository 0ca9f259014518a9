"""What-if questions on an accountant's ledger: `epsilon_if`, `history_if`, `would_exceed` and
`steps_left` of every `Accountant` (mixed into the base class).

None of them changes the ledger: each works on a copy that shares the accountant's composition cache
(`accountants.composition`), so a question costs at most the composition a real step would cost, and
the answer's composition is kept for when the step is recorded. Decisions at the boundary
(`would_exceed`, `steps_left`) are settled by the drift-free composition, as dp-accounting decides.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accountants._validation import check_delta, check_int, check_real
from accountants.composition import AtomCount, AtomSequence, Composition, merged_counts

if TYPE_CHECKING:
    from accountants.history import HistoryEntry

__all__ = ["WhatIfMixin"]


def _last_fitting_above(fits: Callable[[int], bool], low: int, high: int) -> int:
    """Largest k in [low, high) with fits(k), by bisection, for fits monotone, fits(low) true and
    fits(high) false."""
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def _last_fitting(fits: Callable[[int], bool], high: int) -> int:
    """Largest k in [0, high] with fits(k), for fits monotone and fits(0) true."""
    return high if fits(high) else _last_fitting_above(fits, 0, high)


def _last_fitting_from_below(fits: Callable[[int], bool], high: int) -> int:
    """Largest k in [0, high] with fits(k), for fits monotone and fits(0) true, by doubling from 1 and then
    bisection: never probes far past the first k that does not fit (probes there may cost more)."""
    if high < 1 or not fits(1):
        return 0
    low, upper = 1, 2
    while upper <= high and fits(upper):
        low, upper = upper, 2 * upper
    if upper > high:
        if fits(high):
            return high
        upper = high
    return _last_fitting_above(fits, low, upper)


class WhatIfMixin:
    """The "what if" half of `Accountant` (which defines every attribute used here)."""

    # ----------------------------------------------------------------- subclass hooks
    def _decision_margin(self, composition: Composition, delta: float) -> float:
        """How far `composition.get_delta(e)` may be from the drift-free value (see `_exceeds`)."""
        return 0.0

    def _largest_count_within(
        self, start: Composition, atom: AtomCount, max_epsilon: float, delta: float, limit: int
    ) -> int:
        """About the largest m <= limit such that `start` plus m more occurrences of `atom` stays
        within (max_epsilon, delta) (`steps_left` checks the boundary exactly afterwards).
        Default: doubling, then bisection, each probe a composition from the cache."""

        def fits(extra: int) -> bool:
            sequence = (*start.sequence, AtomCount(atom.key, atom.event, extra))
            return self._composition_of(sequence).get_epsilon(delta) <= max_epsilon

        if limit <= 0 or not fits(1):
            return 0
        low, high = 1, 2
        while high <= limit and fits(high):
            low, high = high, high * 2
        if high > limit:
            if fits(limit):
                return limit
            high = limit
        return _last_fitting_above(fits, low, high)

    # ----------------------------------------------------------------- the boundary decision
    def _exceeds(self, sequence: AtomSequence, max_epsilon: float, delta: float) -> bool:
        """Whether `sequence` composed has epsilon > max_epsilon at delta, as dp-accounting's own
        composition of it decides.

        A cached composition may have gone through a few more lossy steps than dp-accounting's
        (`Composition.drift`), which moves its delta(epsilon) by at most `_decision_margin`; when
        its delta at max_epsilon is within that margin of `delta`, the drift-free composition is
        built and decides. So the guard, `steps_left` and dp-accounting agree at the boundary.
        """
        if not sequence:
            return False
        composition = self._composition_of(sequence)
        epsilon = composition.get_epsilon(delta)
        if composition.drift == 0 or not math.isfinite(epsilon):
            return epsilon > max_epsilon
        # epsilon is non-increasing in delta: epsilon > max_epsilon exactly when delta(max) > delta.
        delta_at_max = composition.get_delta(max_epsilon)
        if abs(delta_at_max - delta) > self._decision_margin(composition, delta):
            return delta_at_max > delta
        exact = self._cache.store(self._exact_composition(sequence))
        return exact.get_epsilon(delta) > max_epsilon

    # ----------------------------------------------------------------- what if
    def epsilon_if(self, delta: float, **step_kwargs: Any) -> float:
        """Epsilon at `delta` if `step(**step_kwargs)` were recorded now; the ledger does not change.

        Guarantee: equal to what `get_epsilon(delta)` returns right after `step(**step_kwargs)`
        (the composition is kept, so that call then costs nothing). Used by the privacy budget
        guard before each release.

        ===========================  ================================================
        case                         result
        ===========================  ================================================
        num_steps = 0                the current epsilon
        invalid step arguments       the error `step` raises; nothing recorded
        delta outside (0, 1)         ValueError naming delta
        ===========================  ================================================
        """
        delta = check_delta(delta)
        return self._after(step_kwargs).get_epsilon(delta)

    def history_if(self, **step_kwargs: Any) -> tuple[HistoryEntry, ...]:
        """The history `step(**step_kwargs)` would leave (errors as `step`); the ledger does not change."""
        return self._after(step_kwargs).history

    def would_exceed(self, max_epsilon: float, delta: float, **step_kwargs: Any) -> bool:
        """Whether recording `step(**step_kwargs)` now would make `get_epsilon(delta) > max_epsilon`.

        Guarantee: the decision of the drift-free composition (dp-accounting's way of composing
        the same event) even when the cached value is within float noise of `max_epsilon`; the
        ledger does not change. Agrees with `steps_left`: it is True exactly when
        `steps_left(max_epsilon, delta, **step_kwargs) == 0` for a one-step call.

        ============================  ======================================
        case                          result
        ============================  ======================================
        step releases without noise   True (epsilon inf)
        step with sample_rate 0       as without the step
        max_epsilon < 0, NaN, inf     ValueError naming max_epsilon
        invalid step arguments        the error `step` raises
        ============================  ======================================
        """
        max_epsilon = check_real("max_epsilon", max_epsilon, low=0.0)
        delta = check_delta(delta)
        after = self._after(step_kwargs)
        return after._exceeds(after._sequence(), max_epsilon, delta)

    def steps_left(self, max_epsilon: float, delta: float, *, limit: int = 2**20, **step_kwargs: Any) -> int:
        """How many more `step(**step_kwargs)` calls (one step each) keep `get_epsilon(delta) <= max_epsilon`.

        Guarantee: recording the returned number k of such steps keeps epsilon within max_epsilon,
        and one more would exceed it (unless k == limit), decided as `would_exceed` decides (so a
        guard consulting `would_exceed` before each step allows exactly k). The ledger does not
        change. The search doubles the number of participations and then bisects (PLD: binary
        lifting over powers of the step's distribution), then checks the boundary exactly.

        ==============================  ===========================================
        case                            result
        ==============================  ===========================================
        already over max_epsilon        0
        steps that add no privacy loss  limit (sample_rate 0)
        noiseless steps (q > 0)         0
        more than limit steps fit       limit
        num_steps given                 TypeError: each call counts one step
        limit < 0 / max_epsilon < 0     ValueError naming it
        invalid step arguments          the error `step` raises
        ==============================  ===========================================
        """
        max_epsilon = check_real("max_epsilon", max_epsilon, low=0.0)
        delta = check_delta(delta)
        limit = check_int("limit", limit, low=0)
        if "num_steps" in step_kwargs:
            raise TypeError("steps_left counts single steps: leave out num_steps.")
        self._after({**step_kwargs, "num_steps": 0})  # validates the step, records nothing
        sequence = self._sequence()
        if limit == 0 or self._exceeds(sequence, max_epsilon, delta):
            return 0
        before = merged_counts(sequence)

        def grown(steps: int) -> AtomSequence:
            return self._after({**step_kwargs, "num_steps": steps})._sequence() if steps else sequence

        def fits(steps: int) -> bool:
            return not self._exceeds(grown(steps), max_epsilon, delta)

        def changed(steps: int) -> dict[str, int]:
            after = merged_counts(grown(steps))
            return {key: count for key, count in after.items() if count != before.get(key, 0)}

        # The atom these steps add to (BandMF: the first steps may add no participation).
        probe = 1
        while not changed(probe):
            if probe >= limit:
                return limit
            probe = min(2 * probe, limit)
        keys = list(changed(probe))
        if len(keys) != 1:
            return _last_fitting(fits, limit)
        if probe < limit and list(changed(min(2 * probe, limit))) != keys:
            # More steps give another atom, not more of this one (an event of the whole run whose parameters
            # depend on the step count, e.g. BLT's "blt" kind): search on the step count itself, from below.
            return _last_fitting_from_below(fits, limit)
        atom = next(atom for atom in grown(probe) if atom.key == keys[0])

        def added(steps: int) -> int:
            return merged_counts(grown(steps)).get(atom.key, 0) - before.get(atom.key, 0)

        most = added(limit)
        fitting = self._largest_count_within(self._composition_of(sequence), atom, max_epsilon, delta, most)
        estimate = limit if fitting >= most else _last_fitting(lambda steps: added(steps) <= fitting, limit)
        # The search above decides on cached values; settle the boundary as would_exceed does.
        while estimate > 0 and not fits(estimate):
            estimate -= 1
        while estimate < limit and fits(estimate + 1):
            estimate += 1
        return estimate

