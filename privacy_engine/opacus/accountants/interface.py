"""``IAccountant``: Opacus's accountant interface, for accountants written against it.

An Opacus script subclasses ``IAccountant`` and implements ``step``, ``get_epsilon``, ``__len__`` and
``mechanism``; such a class can be instantiated, registered (``register_accountant``), built by
``create_accountant`` and attached to an optimizer through ``get_optimizer_hook_fn``. Every engine
accountant (``accountants.Accountant``, hence this namespace's ``RDPAccountant`` and
``PRVAccountant``) is a virtual subclass, so ``isinstance(accountant, IAccountant)`` holds for them.
The engine's ``PrivacyEngine`` accounts only with ``accountants.Accountant`` subclasses (their
composition is dp-accounting's); it refuses an ``IAccountant`` that is not one.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable
from typing import Any

from accountants import Accountant

__all__ = ["IAccountant"]


class IAccountant(abc.ABC):
    """Opacus's abstract accountant (see the module docstring)."""

    @abc.abstractmethod
    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one step of the sampled Gaussian mechanism."""

    @abc.abstractmethod
    def get_epsilon(self, delta: float, *args: Any, **kwargs: Any) -> float:
        """Epsilon of the recorded steps at ``delta``."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of recorded steps."""

    @classmethod
    @abc.abstractmethod
    def mechanism(cls) -> str:
        """The accountant's name."""

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """A step hook for ``DPOptimizer.attach_step_hook``: each released step calls
        ``self.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=sample_rate)``."""

        def hook(optimizer: Any) -> None:
            self.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=sample_rate)

        return hook

    def state_dict(self) -> dict[str, Any]:
        """``{"history": a copy of self.history, "mechanism": ...}`` (Opacus's layout)."""
        return {"history": copy.deepcopy(getattr(self, "history", [])), "mechanism": self.mechanism()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set ``self.history`` from ``state_dict["history"]`` (``ValueError`` when it is missing)."""
        if not isinstance(state_dict, dict) or "history" not in state_dict:
            raise ValueError("an accountant state dict needs a 'history' entry")
        self.history = copy.deepcopy(state_dict["history"])


IAccountant.register(Accountant)
