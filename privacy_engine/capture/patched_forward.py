"""A module's forward replaced by a wrapper's method, as a picklable object instead of a closure.

The wrappers replace the ``forward`` of some modules (the torch.func fallback in ``fallback_bridge.py``,
fast clipping's gate in ``clipping/ghost/gate.py``). A local function set as ``module.forward`` cannot be
pickled, so ``torch.save`` of a wrapped model failed (issue 27). ``PatchedForward`` keeps what such a
closure kept as attributes: the wrapper's method (a bound method pickles as its object and name), the
module's path, the module, the forward it replaces and what the method needs to know of the layer
(``context``); what the method derives from them is cached in ``derived`` and not pickled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["PatchedForward"]


class PatchedForward:
    """``module.forward`` replaced by ``method(self, args, kwargs)``; picklable when ``method``'s object,
    ``module``, a replaced forward other than the class's own, and ``context`` are."""

    def __init__(self, method: Callable, path: str, module: nn.Module, original: Callable, **context: Any) -> None:
        self.method = method
        self.path = path
        self.module = module
        # The class's own forward is looked up when called, not kept: a bound method pickles as
        # getattr(module, "forward"), which after loading is this object again (an endless recursion).
        own = getattr(original, "__func__", None) is type(module).forward and getattr(original, "__self__", None) is module
        self._original = None if own else original
        self.context = context
        self.derived: Any = None  # the method's cache (samplers bound to the layer), rebuilt after loading

    @property
    def original(self) -> Callable:
        """The forward this one replaced."""
        if self._original is not None:
            return self._original
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.method(self, args, kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "derived": None}
