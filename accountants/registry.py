"""Accountants by name: `make_accountant("pld")`, `make_accountant("rdp")`."""

from __future__ import annotations

from typing import Any

from accountants.base import Accountant
from accountants.pld import PLDAccountant
from accountants.rdp import RDPAccountant

__all__ = ["ACCOUNTANTS", "make_accountant"]

ACCOUNTANTS: dict[str, type[Accountant]] = {
    PLDAccountant.name: PLDAccountant,
    RDPAccountant.name: RDPAccountant,
}


def make_accountant(name: str, **settings: Any) -> Accountant:
    """A new, empty accountant by name; `settings` go to its constructor.

    =====================================  =========================================
    case                                   result
    =====================================  =========================================
    "pld" (any case, spaces stripped)      ``PLDAccountant(**settings)``
    "rdp"                                  ``RDPAccountant(**settings)``
    anything else                          ValueError naming name and the choices
    unknown setting                        TypeError from the constructor
    =====================================  =========================================
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in ACCOUNTANTS:
        raise ValueError(f"name must be one of {sorted(ACCOUNTANTS)}; got {name!r}.")
    return ACCOUNTANTS[key](**settings)
