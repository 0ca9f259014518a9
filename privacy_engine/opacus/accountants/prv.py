"""``opacus.accountants.prv``."""

from privacy_engine.opacus.accountants import PRVAccountant

__all__ = ["PRVAccountant"]
