"""``opacus.accountants.rdp``."""

from privacy_engine.opacus.accountants import RDPAccountant

__all__ = ["RDPAccountant"]
