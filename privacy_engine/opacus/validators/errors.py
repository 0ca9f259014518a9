"""``opacus.validators.errors``: the module validator's error types."""

from __future__ import annotations

from typing import Any

from privacy_engine.opacus.validators import fixer_attribute

__all__ = [  # noqa: F822  (names served by __getattr__ below)
    "IllegalModuleConfigurationError",
    "NotYetSupportedModuleError",
    "ShouldReplaceModuleError",
    "UnsupportableModuleError",
    "UnsupportedModuleError",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return fixer_attribute(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
