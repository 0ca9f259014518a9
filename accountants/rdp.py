"""Rényi-DP accountant: dp-accounting's `RdpAccountant` behind the `Accountant` interface."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from accountants._validation import check_real
from accountants.base import Accountant
from accountants.composition import AtomSequence, Composition, CompositionCache
from accountants.registry import register_accountant

__all__ = ["DEFAULT_RDP_ORDERS", "RDPAccountant"]

#: dp-accounting's default orders: 1.1 ... 10.9 in steps of 0.1, 11 ... 63, then 128 ... 1024.
DEFAULT_RDP_ORDERS: tuple[float, ...] = tuple(
    float(order) for order in rdp_privacy_accountant.DEFAULT_RDP_ORDERS
)


# dp-accounting logs (on absl's logger) when its series for the RDP of the subsampled Gaussian at one
# fractional order does not converge; it then leaves that order out of the minimum, which only makes
# the epsilon it reports larger (still a valid bound). Nothing for the user to do: filtered while we
# compose. Its other warnings (a negative Renyi divergence, answered with epsilon 0) are kept.
_NOT_CONVERGED = "_compute_log_a_frac failed to converge"


class _NotConvergedFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NOT_CONVERGED)


@contextlib.contextmanager
def _without_convergence_warnings() -> Iterator[None]:
    """Drop dp-accounting's "failed to converge" records on the ``absl`` logger inside the block only.

    A filter of its own is added to that logger and removed on exit (also on an exception), so nested
    blocks and the user's own absl logging are unaffected; other records pass unchanged.
    """
    logger = logging.getLogger("absl")
    quiet = _NotConvergedFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _RDPCache(CompositionCache):
    """Compositions, plus each atom's RDP vector (dp-accounting's, for one occurrence)."""

    def __init__(self) -> None:
        super().__init__(capacity=4)
        self.atom_rdp: dict[str, np.ndarray] = {}


class _RDPComposition(Composition):
    """RDP at each order: the sum over entries of count * (the atom's RDP), as dp-accounting adds them."""

    def __init__(self, sequence: AtomSequence, orders: tuple[float, ...], rdp: np.ndarray) -> None:
        super().__init__(sequence)
        self._orders = orders
        self._rdp = rdp

    def _epsilon(self, delta: float) -> float:
        return rdp_privacy_accountant.compute_epsilon(self._orders, self._rdp, delta)[0]

    def _delta(self, epsilon: float) -> float:
        return rdp_privacy_accountant.compute_delta(self._orders, self._rdp, epsilon)[0]


@register_accountant
class RDPAccountant(Accountant):
    """Epsilon from Rényi DP at a fixed set of orders (dp-accounting's `RdpAccountant`).

    Guarantee: `get_epsilon` is dp-accounting's RDP-to-(epsilon, delta) conversion, minimised over
    `orders`: a valid upper bound for every order set, looser than PLD (typically 5-20 %).
    Truncated Poisson sampling is not supported by dp-accounting's RDP accountant; `step` raises
    NotImplementedError naming PLDAccountant for it.

    ====================  ==============================================
    orders                result
    ====================  ==============================================
    None                  DEFAULT_RDP_ORDERS (dp-accounting's default)
    any order <= 1        ValueError naming orders
    empty / NaN / inf     ValueError naming orders
    ====================  ==============================================
    """

    name = "rdp"

    def __init__(self, orders: Sequence[float] | None = None) -> None:
        super().__init__()
        if orders is None:
            orders = DEFAULT_RDP_ORDERS
        if (
            isinstance(orders, str)
            or not isinstance(orders, Sequence)
            or len(orders) == 0
        ):
            raise ValueError(
                f"orders must be a non-empty sequence of RDP orders > 1 (or None for the "
                f"default); got {orders!r}."
            )
        self._orders = tuple(
            check_real(
                "orders",
                order,
                low=1.0,
                low_open=True,
                hint="RDP orders must exceed 1.",
            )
            for order in orders
        )

    @property
    def orders(self) -> tuple[float, ...]:
        """The RDP orders epsilon is minimised over (each > 1, finite), as given or `DEFAULT_RDP_ORDERS`."""
        return self._orders

    def settings(self) -> dict[str, Any]:
        """Constructor keyword arguments that rebuild an equivalent empty accountant: `{"orders": [...]}`."""
        return {"orders": list(self._orders)}

    def _new_dp_accountant(self) -> dp_accounting.PrivacyAccountant:
        return dp_accounting.rdp.RdpAccountant(orders=list(self._orders))

    # ----------------------------------------------------------------- cached composition
    # RDP composes by addition: dp-accounting adds count * (the atom's RDP vector) per event. Each
    # atom's vector is computed once (dp-accounting's own, composing the atom once) and kept, so a
    # composition costs one multiply-add per distinct atom, never a new RDP evaluation.
    def _new_cache(self) -> CompositionCache:
        return _RDPCache()

    def _build_composition(self, sequence: AtomSequence) -> Composition:
        cache = self._cache
        rdp = np.zeros(len(self._orders), dtype=np.float64)
        for atom in sequence:
            if atom.key not in cache.atom_rdp:
                with _without_convergence_warnings():
                    cache.atom_rdp[atom.key] = self._new_dp_accountant().compose(atom.event).rdp
            rdp += atom.count * cache.atom_rdp[atom.key]
        return _RDPComposition(sequence, self._orders, rdp)
