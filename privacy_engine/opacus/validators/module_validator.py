"""``opacus.validators.module_validator``: ``ModuleValidator``."""

from __future__ import annotations

from typing import Any

from privacy_engine.opacus.validators import fixer_attribute

__all__ = ["ModuleValidator"]  # noqa: F822  (served by __getattr__ below)


def __getattr__(name: str) -> Any:
    if name in __all__:
        return fixer_attribute(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
