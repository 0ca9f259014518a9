"""Rényi-DP accountant: dp-accounting's `RdpAccountant` behind the `Accountant` interface."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant

from accountants._validation import check_real
from accountants.base import Accountant

__all__ = ["DEFAULT_RDP_ORDERS", "RDPAccountant"]

#: dp-accounting's default orders: 1.1 ... 10.9 in steps of 0.1, 11 ... 63, then 128 ... 1024.
DEFAULT_RDP_ORDERS: tuple[float, ...] = tuple(
    float(order) for order in rdp_privacy_accountant.DEFAULT_RDP_ORDERS
)


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
        return self._orders

    def settings(self) -> dict[str, Any]:
        return {"orders": list(self._orders)}

    def _new_dp_accountant(self) -> dp_accounting.PrivacyAccountant:
        return dp_accounting.rdp.RdpAccountant(orders=list(self._orders))
