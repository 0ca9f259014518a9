"""``opacus.accountants.registry``: accountant classes by name, ``register_accountant`` and
``create_accountant``.

``_ACCOUNTANTS`` (Opacus's name) maps a name to a class; the package fills in the built-ins
(``"rdp"``, ``"pld"``; ``"prv"`` is read as ``"pld"`` through the engine's table of names,
``ACCOUNTANT_ALIASES``). ``"gdp"`` is a built-in name too, with no class: Opacus's Gaussian
accountant is a central-limit approximation that can under-report epsilon, so it is refused.
"""

from __future__ import annotations

from accountants import Accountant
from privacy_engine.engine.options import ACCOUNTANT_ALIASES
from privacy_engine.opacus.accountants.interface import IAccountant

__all__ = ["create_accountant", "register_accountant"]

#: Name -> accountant class (an engine ``accountants.Accountant`` or an Opacus-style ``IAccountant``).
_ACCOUNTANTS: dict[str, type] = {}
#: Names that are Opacus's own and cannot be replaced without ``force=True``.
BUILT_IN_NAMES = frozenset({"rdp", "prv", "pld", "gdp"})
_GDP_REFUSED = (
    "Opacus's GaussianAccountant ('gdp', a central-limit approximation that can under-report epsilon) is not "
    "provided: use PRVAccountant (accountant='prv', the default) or RDPAccountant (accountant='rdp')"
)


def _engine_name(mechanism: str) -> str:
    return ACCOUNTANT_ALIASES.get(mechanism, mechanism)


def create_accountant(mechanism: str) -> Accountant | IAccountant:
    """A new accountant by name: ``"prv"`` (PLD here), ``"rdp"``, or a name given to
    ``register_accountant``. ``"gdp"`` (unless registered with ``force=True``) raises
    ``NotImplementedError`` saying why; an unknown name raises ``ValueError`` naming the accepted ones."""
    name = _engine_name(mechanism)
    if name not in _ACCOUNTANTS:
        if mechanism == "gdp":
            raise NotImplementedError(_GDP_REFUSED)
        names = sorted(set(ACCOUNTANT_ALIASES) | set(_ACCOUNTANTS))
        raise ValueError(f"accountant must be one of {names} ('gdp' is not provided); got {mechanism!r}")
    return _ACCOUNTANTS[name]()


def register_accountant(mechanism: str, accountant: type, force: bool = False) -> None:
    """Make ``create_accountant(mechanism)`` build ``accountant``.

    ``accountant`` is a subclass of the engine's ``accountants.Accountant`` (then
    ``PrivacyEngine(accountant=mechanism)`` accounts with it too) or of Opacus's interface
    ``IAccountant`` (then ``create_accountant`` builds it; the engine itself accounts only with
    ``accountants.Accountant`` subclasses and refuses it). Raises, before anything changes:
    ``TypeError`` for any other class, ``ValueError`` when ``mechanism`` is already registered or is
    one of Opacus's built-in names (``"rdp"``, ``"prv"``, ``"pld"``, ``"gdp"``), unless ``force=True``
    (``"prv"`` and ``"pld"`` name one accountant: replacing one replaces both).
    """
    if not (isinstance(accountant, type) and issubclass(accountant, (Accountant, IAccountant))):
        raise TypeError(f"accountant must be a subclass of accountants.Accountant or of IAccountant; got {accountant!r}")
    name = _engine_name(mechanism)
    if not force and (name in _ACCOUNTANTS or mechanism in BUILT_IN_NAMES):
        raise ValueError(f"an accountant is already registered for {mechanism!r}: pass force=True to replace it")
    _ACCOUNTANTS[name] = accountant
