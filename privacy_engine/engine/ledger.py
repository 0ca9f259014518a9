"""The privacy ledger as the DP optimizer sees it: the engine's accountant, or, under truncated
sampling, a view that records every step with the group size and the cap."""

from __future__ import annotations

from typing import Any

from accountants import Accountant
from privacy_engine.engine.noise_plan import NoisePlan

__all__ = ["TruncatedLedger", "ledger_for"]


class TruncatedLedger:
    """The engine's accountant as ``DPOptimizer`` sees it under truncated sampling: every step is
    recorded with the group size and the cap, so that it is accounted as truncated Poisson
    sampling (the optimizer itself knows only noise multiplier, sample rate and bands)."""

    def __init__(self, accountant: Accountant, *, group_size: int, max_batch_size: int) -> None:
        self.accountant = accountant
        self.group_size = group_size
        self.max_batch_size = max_batch_size

    def step(self, **kwargs: Any) -> None:
        """Record the step on the accountant with this ledger's ``group_size`` and ``max_batch_size`` added
        (accounted as truncated Poisson sampling: PLD only, RDP raises ``NotImplementedError``). Errors as
        ``Accountant.step``: invalid arguments raise before anything is recorded."""
        self.accountant.step(**kwargs, group_size=self.group_size, max_batch_size=self.max_batch_size)

    # The "what if" questions the privacy budget asks (engine.budget) take the same step.
    def _truncated(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**kwargs, "group_size": self.group_size, "max_batch_size": self.max_batch_size}

    def history_if(self, **kwargs: Any) -> tuple:
        """``Accountant.history_if`` for the truncated step: the history it would leave; nothing recorded."""
        return self.accountant.history_if(**self._truncated(kwargs))

    def epsilon_if(self, delta: float, **kwargs: Any) -> float:
        """``Accountant.epsilon_if`` for the truncated step: epsilon at ``delta`` were it recorded now;
        nothing recorded."""
        return self.accountant.epsilon_if(delta, **self._truncated(kwargs))

    def would_exceed(self, max_epsilon: float, delta: float, **kwargs: Any) -> bool:
        """``Accountant.would_exceed`` for the truncated step: whether recording it would take epsilon at
        ``delta`` above ``max_epsilon``; nothing recorded."""
        return self.accountant.would_exceed(max_epsilon, delta, **self._truncated(kwargs))

    def steps_left(self, max_epsilon: float, delta: float, **kwargs: Any) -> int:
        """``Accountant.steps_left`` for the truncated step: how many more such steps keep epsilon at
        ``delta`` within ``max_epsilon``; nothing recorded."""
        return self.accountant.steps_left(max_epsilon, delta, **self._truncated(kwargs))

    def __getattr__(self, name: str) -> Any:
        # Only ordinary attributes are forwarded: copy/pickle probe dunders before __init__ has run.
        if name.startswith("__") or name == "accountant":
            raise AttributeError(name)
        return getattr(self.accountant, name)


def ledger_for(accountant: Accountant, noise_plan: NoisePlan) -> Accountant | TruncatedLedger:
    """What the optimizer records its steps with: ``accountant`` itself, or its truncated view."""
    if noise_plan.max_batch_size is None:
        return accountant
    return TruncatedLedger(accountant, group_size=noise_plan.group_size, max_batch_size=noise_plan.max_batch_size)
