"""``opacus.validators``: ``ModuleValidator`` and its registration decorators, the engine's module
fixer (``privacy_engine.models.fixer``: validate, fix, register validators and fixers, Opacus's error types).

The names are looked up in ``privacy_engine.models.fixer`` when used, so importing this module always works.
"""

from __future__ import annotations

from typing import Any

from privacy_engine.opacus._lazy import lazy_attribute

__all__ = [
    "IllegalModuleConfigurationError",
    "ModuleValidator",
    "NotYetSupportedModuleError",
    "ShouldReplaceModuleError",
    "UnsupportableModuleError",
    "UnsupportedModuleError",
    "register_module_fixer",
    "register_module_validator",
]


def fixer_attribute(name: str) -> Any:
    """``privacy_engine.models.fixer.<name>``, or a stand-in that explains its absence when used."""
    return lazy_attribute(name, "privacy_engine.models.fixer", (name,), "the module validator and fixer")


def __getattr__(name: str) -> Any:
    if name in __all__:
        return fixer_attribute(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
