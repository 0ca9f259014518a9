"""Accountants by name: `make_accountant("pld")`, `make_accountant("rdp")`.

Each accountant registers itself where it is defined (``@register_accountant`` in ``pld.py``,
``rdp.py``); importing the package imports them all, so the table is complete before any step is
recorded. The registry imports no accountant: the base class reads it to name an alternative when
dp-accounting cannot account for a step, without an import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from accountants.base import Accountant

__all__ = ["ACCOUNTANTS", "make_accountant", "register_accountant"]

#: Accountant classes by their ``name``, in the order they were registered.
ACCOUNTANTS: dict[str, type[Accountant]] = {}

_AccountantClass = TypeVar("_AccountantClass", bound="type[Accountant]")


def register_accountant(cls: _AccountantClass) -> _AccountantClass:
    """Class decorator: make ``cls`` reachable as ``make_accountant(cls.name)``. A name is taken once:
    another class under a registered name raises ``ValueError`` (the same class again, e.g. its module
    reloaded, replaces the entry)."""
    known = ACCOUNTANTS.get(cls.name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"an accountant named {cls.name!r} is registered already ({ACCOUNTANTS[cls.name].__name__})")
    ACCOUNTANTS[cls.name] = cls
    return cls


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
