"""Opacus's hand-built pipeline, connected: the inference Opacus scripts need, kept out of the core.

An Opacus script builds ``GradSampleModule(model)``, ``DPOptimizer(optimizer, ...)`` and
``DPDataLoader.from_data_loader(loader)`` separately and never connects them: Opacus's optimizer
reads whatever ``p.grad_sample`` holds. The engine connects a wrapper and an optimizer only through
``privacy_engine.connect_private`` (a ``DPOptimizer`` refuses per-sample gradients of a wrapper it is
not connected to), so this namespace makes that call for the script: when one of its wrappers
(``privacy_engine.opacus.GradSampleModule`` and the other ``GradSampleModule*`` classes) or one of its
optimizers (``privacy_engine.opacus.optimizers.DPOptimizer`` and subclasses) is built, it is connected to
the newest one of the other kind built here that is still unconnected and that ``connect_private``
accepts (the wrapper's trainable parameters are all the optimizer's; a fast-clipping wrapper only if it has
no clipper yet, and then it clips at the optimizer's ``max_grad_norm``, the bound the noise is calibrated to,
or if its clipper is the optimizer's). No loader is attached: the optimizer adopts the private loader of the
first drawn batch it trains on.

==================================================  ==============================================
case                                                result
==================================================  ==============================================
wrapper and optimizer built here, either order      connected when the second is built
several candidates                                  the newest unconnected one that fits
the other one already connected (to anything)       not connected: the step refuses, naming
                                                    ``connect_private``
objects of the engine's own classes, or built by    never touched (``make_private`` connects its
``make_private`` (of this namespace too:            own)
``built_by_make_private``)
==================================================  ==============================================

Only objects built through this namespace's classes are remembered, weakly (a dropped one is
forgotten).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.engine.connect import connect_private, connection_refusal

__all__ = ["built_by_make_private", "optimizer_built", "wrapper_built"]

# Opacus-namespace wrappers and optimizers, oldest first (the newest that fits is connected).
_WRAPPERS: list[weakref.ref] = []
_OPTIMIZERS: list[weakref.ref] = []
# Set while this namespace's make_private builds (it connects what it builds itself), per thread.
_MAKE_PRIVATE = threading.local()


@contextlib.contextmanager
def built_by_make_private() -> Iterator[None]:
    """What is built inside is ``make_private``'s (connected by the engine): neither remembered nor connected here."""
    previous = getattr(_MAKE_PRIVATE, "active", False)
    _MAKE_PRIVATE.active = True
    try:
        yield
    finally:
        _MAKE_PRIVATE.active = previous


def wrapper_built(wrapper: Any) -> None:
    """Remember an Opacus-namespace wrapper; connect it to the newest unconnected optimizer that fits."""
    _built(wrapper, _WRAPPERS, _OPTIMIZERS, lambda optimizer: (wrapper, optimizer))


def optimizer_built(optimizer: Any) -> None:
    """Remember an Opacus-namespace optimizer; connect it to the newest unconnected wrapper that fits."""
    _built(optimizer, _OPTIMIZERS, _WRAPPERS, lambda wrapper: (wrapper, optimizer))


def _built(piece: Any, own: Any, counterparts: Any, pair: Any) -> None:
    """Outside the namespace's make_private: remember ``piece`` in ``own`` and connect it to the newest
    counterpart that fits (``pair(counterpart)`` gives ``(wrapper, optimizer)``)."""
    if getattr(_MAKE_PRIVATE, "active", False):
        return
    _remember(own, piece)
    for counterpart in _newest_first(counterparts):
        wrapper, optimizer = pair(counterpart)
        if _fits(wrapper, optimizer):
            connect_private(wrapper, optimizer)
            return


def _fits(wrapper: Any, optimizer: Any) -> bool:
    if isinstance(wrapper, GhostClippingModule) and wrapper.clipper is not None and wrapper.clipper is not optimizer.clipper:
        # A fast-clipping wrapper that already clips with its own clipper (used alone, at its max_grad_norm) keeps
        # it; one without a clipper yet gets the optimizer's at connection (connect_private attaches it).
        return False
    return connection_refusal(wrapper, optimizer) is None


def _remember(refs: list[weakref.ref], obj: Any) -> None:
    refs[:] = [ref for ref in refs if ref() is not None]
    refs.append(weakref.ref(obj))


def _newest_first(refs: list[weakref.ref]) -> list[Any]:
    return [obj for obj in (ref() for ref in reversed(refs)) if obj is not None]
