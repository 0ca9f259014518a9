"""Names of the compatibility namespace that live in other parts of the engine, looked up when used.

``from privacy_engine.opacus.layers import DPLSTM`` must work as soon as the script is imported,
even in a version of the engine that lacks the part that implements the name (a script imports
``opacus.distributed`` at the top even when it runs on one process). Such a name resolves to a
stand-in that raises ``NotImplementedError``, saying what is missing, the moment it is called or
one of its attributes is read; where the part is present, the real object is returned.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["lazy_attribute", "unavailable"]


class _Unavailable(type):
    """Type of a stand-in: calling it or reading an attribute raises its message."""

    _message: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(cls._message)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(cls._message)

    def __instancecheck__(cls, instance: Any) -> bool:
        return False  # nothing can be an instance of something that does not exist

    def __repr__(cls) -> str:
        return f"<unavailable {cls.__name__}: {cls._message}>"


def unavailable(name: str, message: str) -> type:
    """A stand-in for ``name`` that raises ``NotImplementedError(message)`` when used."""
    return _Unavailable(name, (), {"_message": message, "__doc__": message})


def lazy_attribute(name: str, module_path: str, candidates: tuple[str, ...], what: str) -> Any:
    """The first of ``candidates`` found in ``module_path`` (imported now), or a stand-in for
    ``name`` when the module or the names are absent. An ``ImportError`` raised from inside a
    module that exists (a missing dependency, a bug) propagates: only absence becomes a stand-in.
    """
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as error:
        if error.name != module_path:
            raise
        module = None
    for candidate in candidates:
        value = getattr(module, candidate, None) if module is not None else None
        if value is not None:
            return value
    where = f"{module_path}.{candidates[0]}"
    return unavailable(
        name,
        f"{name} ({what}) is not available in this version of privacy_engine: it needs {where}, which is "
        f"missing. Update privacy_engine, or see the migration table in README.md for the equivalent.",
    )
