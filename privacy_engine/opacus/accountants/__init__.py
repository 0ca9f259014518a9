"""``opacus.accountants`` on dp-accounting: the engine's accountants with Opacus's interface.

``RDPAccountant`` is dp-accounting's RDP accountant; ``PRVAccountant`` (Opacus's default, a numerical
privacy-loss accountant) is dp-accounting's PLD accountant, which computes the same quantity
(epsilon of the composed sampled Gaussian mechanism) by another discretisation; the two agree to
well within 1% on DP-SGD (tests/test_opacus_examples.py). ``GaussianAccountant`` (Opacus's CLT approximation, not an upper bound)
is not provided.

Interface added to the engine's accountants: ``step(noise_multiplier=, sample_rate=)`` (the engine's
own), ``len(accountant)`` (steps), ``mechanism()``, ``get_optimizer_hook_fn(sample_rate)``,
``get_privacy_spent`` (RDP), Opacus's extra ``get_epsilon`` arguments, and Opacus-format state
dicts (``{"history": [(noise_multiplier, sample_rate, steps), ...], "mechanism": ...}``) loaded by
``load_state_dict`` and written by ``opacus_state_dict()``. ``accountant.history`` stays the
engine's (``HistoryEntry`` records).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from accountants import PLDAccountant as _PLDAccountant
from accountants import RDPAccountant as _RDPAccountant
from accountants.events import EventSpec
from accountants.state import STATE_DICT_FORMAT
from privacy_engine.opacus._lazy import unavailable
from privacy_engine.opacus.accountants import registry
from privacy_engine.opacus.accountants.interface import IAccountant
from privacy_engine.opacus.accountants.registry import _GDP_REFUSED, create_accountant, register_accountant

__all__ = [
    "GaussianAccountant",
    "IAccountant",
    "PRVAccountant",
    "RDPAccountant",
    "create_accountant",
    "register_accountant",
    "registry",
]


class _OpacusInterface:
    """Opacus's accountant methods on an engine accountant (mixin)."""

    opacus_mechanism: str

    @classmethod
    def mechanism(cls) -> str:
        return cls.opacus_mechanism

    def __len__(self) -> int:
        return self.steps

    @property
    def history(self):
        """The recorded steps (this engine's ``HistoryEntry`` records). Assigning a list of Opacus's
        ``(noise_multiplier, sample_rate, steps)`` tuples replaces them (as ``load_state_dict`` of
        Opacus's state dict does; ``ValueError`` for anything else, before anything changes)."""
        return super().history

    @history.setter
    def history(self, entries) -> None:
        self.load_state_dict({"history": list(entries), "mechanism": self.mechanism()})

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """A step hook for ``DPOptimizer.attach_step_hook``: records each released step with this
        accountant (``sample_rate``, the optimizer's ``noise_multiplier``, and the number of loader
        batches the step accumulated). An optimizer that already records its steps here (one from
        ``make_private`` of an engine holding this accountant) records nothing more through the
        hook, so no step is counted twice.

        Guarantee: every step the optimizer releases after ``attach_step_hook`` is recorded here
        exactly once, as a step of its ``noise_multiplier`` at ``sample_rate`` (Opacus's rule); the
        rate must be the loader's real one, which the hook cannot check.

        ==========================================  =========================================
        case                                        recorded
        ==========================================  =========================================
        a released step                             one step (noise_multiplier, sample_rate)
        a skipped micro-batch step                  nothing (the hook is not called)
        k loader batches accumulated in one step    one release of k draws (batches_per_step)
        k fixed-size batches in one step            one draw at k * sample_rate (as the engine
        (``poisson_sampling=False``)                and Opacus record it)
        optimizer already records here              nothing more (warned once)
        ==========================================  =========================================
        """
        warned = []

        def hook(optimizer: Any) -> None:
            ledger = getattr(optimizer, "accountant", None)
            if ledger is self or getattr(ledger, "accountant", None) is self:
                if not warned:
                    warned.append(True)
                    warnings.warn("this optimizer already records its steps with this accountant; the hook adds nothing")
                return
            batches = int(getattr(optimizer, "accumulated_iterations", 1))
            disjoint = getattr(optimizer, "_released_disjoint_batches", None)
            if batches > 1 and disjoint is not None and disjoint():
                # Fixed-size batches of one pass over the data, each example in at most one: one draw at their
                # summed rate, the engine's record of the same release (and Opacus's).
                self.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=min(1.0, sample_rate * batches))
                return
            extra = {"batches_per_step": batches} if batches > 1 else {}
            self.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=sample_rate, **extra)

        return hook

    def opacus_state_dict(self) -> dict[str, Any]:
        """The history in Opacus's format (DP-SGD steps only: BandMF, truncated or accumulated steps
        have no Opacus equivalent and raise ``ValueError``)."""
        history = []
        for entry in self.history:
            # The default event with one band (DP-SGD's): any other kind, BandMF or custom, has no Opacus equivalent.
            if entry.spec != EventSpec() or entry.max_batch_size is not None or entry.batches_per_step != 1:
                raise ValueError(f"{entry} has no Opacus equivalent (Opacus records plain DP-SGD steps only)")
            history.append((entry.noise_multiplier, entry.sample_rate, entry.num_steps))
        return {"history": history, "mechanism": self.mechanism()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the engine's state dict, or Opacus's (``{"history": [(sigma, q, steps), ...],
        "mechanism": ...}``, from any Opacus accountant: the steps are the same whatever the analysis)."""
        if isinstance(state_dict, dict) and "format" not in state_dict and "mechanism" in state_dict:
            history = state_dict.get("history")
            if not isinstance(history, (list, tuple)):
                raise ValueError("an Opacus accountant state dict needs 'history': a list of (noise_multiplier, "
                                 "sample_rate, steps)")  # fmt: skip
            entries = []
            for item in history:
                if not isinstance(item, (list, tuple)) or len(item) != 3:
                    raise ValueError(f"Opacus history entries are (noise_multiplier, sample_rate, steps); got {item!r}")
                entries.append({"noise_multiplier": float(item[0]), "sample_rate": float(item[1]),
                                "num_steps": int(item[2])})  # fmt: skip
            state_dict = {"format": STATE_DICT_FORMAT, "accountant": self.name, "settings": self.settings(),
                          "history": entries}  # fmt: skip
        super().load_state_dict(state_dict)


class RDPAccountant(_OpacusInterface, _RDPAccountant):
    """dp-accounting's RDP accountant with Opacus's interface (``alphas`` are the RDP orders)."""

    opacus_mechanism = "rdp"

    def get_epsilon(self, delta: float, alphas: Sequence[float] | None = None, **_ignored: Any) -> float:
        """Epsilon at ``delta``; with ``alphas`` (Opacus's argument), over those RDP orders only."""
        if alphas is None:
            return super().get_epsilon(delta)
        return self._at_orders(alphas).get_epsilon(delta)

    def get_privacy_spent(self, *, delta: float, alphas: Sequence[float] | None = None) -> tuple[float, float]:
        """``(epsilon, best RDP order)`` at ``delta`` (dp-accounting's conversion)."""
        accountant = self if alphas is None else self._at_orders(alphas)
        epsilon = accountant.get_epsilon(delta)
        if not self.history or epsilon in (0.0, float("inf")):
            return epsilon, float("nan")
        _, order = accountant._new_dp_accountant().compose(accountant.event()).get_epsilon_and_optimal_order(delta)
        return epsilon, float(order)

    def _at_orders(self, alphas: Sequence[float]) -> RDPAccountant:
        other = RDPAccountant(orders=list(alphas))
        state = self.state_dict()
        state["settings"] = other.settings()
        other.load_state_dict(state)
        return other


#: PLD grid of ``PRVAccountant``: Opacus's PRV accountant trades accuracy for speed by default
#: (``eps_error=0.01``, absolute); a 1e-3 grid does the same here: about 10x faster than the engine's
#: 1e-4, and pessimistic (never below the finer grid's epsilon; the same to 5 digits over a few steps,
#: within about 0.5% over thousands).
PRV_VALUE_DISCRETIZATION_INTERVAL = 1e-3


class PRVAccountant(_OpacusInterface, _PLDAccountant):
    """Opacus's default accountant name, on dp-accounting's PLD accountant (a 1e-3 grid by default,
    see ``PRV_VALUE_DISCRETIZATION_INTERVAL``; ``PRVAccountant(1e-4)`` for the engine's accuracy).
    Opacus's ``eps_error`` and ``delta_error`` are accepted and not used: the grid sets the accuracy."""

    opacus_mechanism = "prv"

    def __init__(self, value_discretization_interval: float = PRV_VALUE_DISCRETIZATION_INTERVAL) -> None:
        super().__init__(value_discretization_interval=value_discretization_interval)

    def get_epsilon(self, delta: float, *, eps_error: float | None = None, delta_error: float | None = None) -> float:
        """Epsilon at ``delta``; ``eps_error`` / ``delta_error`` (Opacus's) are accepted, unused."""
        return super().get_epsilon(delta)


GaussianAccountant = unavailable("GaussianAccountant", _GDP_REFUSED)

# The built-in names (``registry.create_accountant``; "prv" is read as "pld").
registry._ACCOUNTANTS.update({"rdp": RDPAccountant, "pld": PRVAccountant})
