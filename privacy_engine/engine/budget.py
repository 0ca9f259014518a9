"""A privacy budget the DP optimizer consults before each release.

    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        ..., target_epsilon=2.0, target_delta=1e-5, epochs=2)   # the budget defaults to the target
    for epoch in range(4):
        for x, y in loader:
            ...
            optimizer.step()          # raises PrivacyBudgetExceeded before the release that would
                                      # take epsilon past 2.0: nothing is released or recorded
    engine.steps_left()               # how many more such steps fit

`PrivacyBudget.check_release` decides with the accountant's cached compositions
(`Accountant.would_exceed`, `Accountant.steps_left`): after the first two steps it plans how many
steps of the same kind fit and counts down, so a check usually costs a comparison of histories;
whenever the ledger is not what it expected (another optimizer stepped, a checkpoint was loaded)
it decides again from the accountant.
"""

from __future__ import annotations

import math
from typing import Any

from accountants._validation import check_delta, check_real

__all__ = ["PrivacyBudget", "PrivacyBudgetExceeded", "step_kwargs_of"]


class PrivacyBudgetExceeded(RuntimeError):
    """The next release would take epsilon past the budget; it was not released or recorded.

    Attributes: ``epsilon_spent`` (epsilon of what was released so far), ``epsilon_after`` (what
    this release would have made it), ``max_epsilon``, ``delta``, ``steps_left`` (single steps of
    this kind that still fit: 0 unless the refused release held several steps).
    """

    def __init__(
        self, *, epsilon_spent: float, epsilon_after: float, max_epsilon: float, delta: float, steps_left: int
    ) -> None:
        self.epsilon_spent = epsilon_spent
        self.epsilon_after = epsilon_after
        self.max_epsilon = max_epsilon
        self.delta = delta
        self.steps_left = steps_left
        super().__init__(
            f"privacy budget exceeded: this release would take epsilon (delta={delta:g}) from "
            f"{epsilon_spent:.6g} spent to {epsilon_after:.6g} > max_epsilon={max_epsilon:g}; "
            f"{steps_left} more step(s) of this kind fit. Nothing was released or recorded: stop "
            "training here (the model is as of the last released step), or make_private with a larger "
            "max_epsilon (max_epsilon=math.inf: no budget; make_private_with_epsilon's budget defaults to "
            "target_epsilon, enough for the epochs it was calibrated for)."
        )


def _frozen(step_kwargs: dict[str, Any]) -> tuple:
    return tuple(sorted(step_kwargs.items()))


class PrivacyBudget:
    """``(max_epsilon, delta)``: no release may take the accountant's epsilon at ``delta`` past
    ``max_epsilon``.

    Guarantee: ``check_release(accountant, **step_kwargs)`` returns only if recording
    ``accountant.step(**step_kwargs)`` keeps ``accountant.get_epsilon(delta) <= max_epsilon``, as
    dp-accounting's own composition of the resulting history decides (`Accountant.would_exceed`);
    otherwise it raises ``PrivacyBudgetExceeded``. Either way the accountant is unchanged. Call it
    before anything is released.

    ===========================================  ==============================================
    case                                         result
    ===========================================  ==============================================
    the step keeps epsilon <= max_epsilon        returns None
    epsilon after the step > max_epsilon         PrivacyBudgetExceeded (spent, after, steps left)
    already over budget (e.g. loaded ledger)     PrivacyBudgetExceeded at the first check
    noiseless step with sample_rate > 0          PrivacyBudgetExceeded (epsilon inf)
    step with sample_rate 0                      returns None (no privacy loss)
    max_epsilon < 0 / NaN / inf                  ValueError naming max_epsilon
    delta outside (0, 1)                         ValueError naming delta
    ===========================================  ==============================================
    """

    def __init__(self, max_epsilon: float, delta: float) -> None:
        self.max_epsilon = check_real(
            "max_epsilon", max_epsilon, low=0.0, hint="It is the largest epsilon the run may reach."
        )
        self.delta = check_delta(delta)
        # The history expected at the next check (after the step this check allowed) and its step
        # arguments; and, once planned, how many more such steps fit from there.
        self._expected: tuple | None = None
        self._left: int | None = None

    def __repr__(self) -> str:
        return f"PrivacyBudget(max_epsilon={self.max_epsilon!r}, delta={self.delta!r})"

    def check_release(self, accountant: Any, **step_kwargs: Any) -> None:
        """Raise ``PrivacyBudgetExceeded`` if ``accountant.step(**step_kwargs)`` would take epsilon
        past the budget (see the class docstring); change nothing either way."""
        history = tuple(accountant.history)
        single = step_kwargs.get("num_steps", 1) == 1
        expected = (history, _frozen(step_kwargs))
        consistent = self._expected == expected
        if consistent and self._left is not None:
            left: int | None = self._left
        elif consistent and single:
            # Two checks in a row with nothing else recorded in between: plan the rest of the run.
            plan_kwargs = {key: value for key, value in step_kwargs.items() if key != "num_steps"}
            left = accountant.steps_left(self.max_epsilon, self.delta, **plan_kwargs)
        else:
            left = None
        # A refusal is always decided afresh (a plan at its end may only have met steps_left's limit).
        exceeds = left in (None, 0) and accountant.would_exceed(self.max_epsilon, self.delta, **step_kwargs)
        if exceeds:
            self._expected, self._left = None, None
            raise self._exceeded(accountant, step_kwargs)
        self._expected = (tuple(accountant.history_if(**step_kwargs)), _frozen(step_kwargs))
        self._left = None if not left else left - 1

    def _exceeded(self, accountant: Any, step_kwargs: dict[str, Any]) -> PrivacyBudgetExceeded:
        plan_kwargs = {key: value for key, value in step_kwargs.items() if key != "num_steps"}
        return PrivacyBudgetExceeded(
            epsilon_spent=accountant.get_epsilon(self.delta),
            epsilon_after=accountant.epsilon_if(self.delta, **step_kwargs),
            max_epsilon=self.max_epsilon,
            delta=self.delta,
            steps_left=accountant.steps_left(self.max_epsilon, self.delta, **plan_kwargs),
        )

    def steps_left(self, accountant: Any, **step_kwargs: Any) -> int:
        """How many more single steps ``step_kwargs`` fit in this budget (``Accountant.steps_left``)."""
        return accountant.steps_left(self.max_epsilon, self.delta, **step_kwargs)


def step_kwargs_of(optimizer: Any) -> dict[str, Any]:
    """The accountant arguments of one ordinary step of a ``DPOptimizer`` (one batch, one noise
    row), as its ``pre_step`` records them; truncation is added by its ledger."""
    kwargs: dict[str, Any] = {
        "noise_multiplier": optimizer.noise_multiplier,
        "sample_rate": optimizer.sample_rate,
        **optimizer.privacy_event.step_kwargs(),  # the event its noise mechanism states
    }
    if getattr(optimizer, "source", ""):
        kwargs["source"] = optimizer.source
    return kwargs


def budget_from(max_epsilon: float | None, target_delta: float | None) -> PrivacyBudget | None:
    """The budget ``make_private`` was given (None for none); errors name the argument."""
    if max_epsilon is None or (isinstance(max_epsilon, float) and math.isinf(max_epsilon) and max_epsilon > 0):
        return None
    if target_delta is None:
        raise ValueError("max_epsilon needs target_delta (the delta the budget's epsilon is taken at), e.g. 1e-5")
    # Checked here so that the error names the argument the user gave (PrivacyBudget calls it delta).
    return PrivacyBudget(max_epsilon, check_delta(target_delta, "target_delta"))
