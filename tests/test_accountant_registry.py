"""The accountants' registry (``accountants.registry``): each accountant registers itself where it is
defined, and the base class names the registered alternatives without importing them."""

from __future__ import annotations

import pytest

from accountants import ACCOUNTANTS, PLDAccountant, RDPAccountant, make_accountant
from accountants.registry import register_accountant


def test_the_built_in_accountants_are_registered_by_name():
    assert ACCOUNTANTS == {"pld": PLDAccountant, "rdp": RDPAccountant}
    assert type(make_accountant(" RDP ")) is RDPAccountant


def test_another_class_under_a_registered_name_is_refused_and_changes_nothing():
    before = dict(ACCOUNTANTS)

    class Impostor(PLDAccountant):
        name = "pld"

    with pytest.raises(ValueError, match="'pld' is registered already"):
        register_accountant(Impostor)
    assert ACCOUNTANTS == before
