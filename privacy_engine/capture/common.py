"""What every capturing wrapper shares (the hooks wrapper, fast clipping, the manual wrapper): the error for a parameter used outside its module, the registry of hooked modules,
the key prefix of a state dict saved from a wrapper, and the interface ``training/`` uses (``ContractedWrapper``).

Kept apart from the wrappers so that each imports it and none imports another for these.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from privacy_engine.capture.patched_forward import PatchedForward

__all__ = [
    "HOOKED_MODULES",
    "WRAPPER_PREFIX",
    "ContractedWrapper",
    "ParameterUsageError",
    "WrappedModuleAccess",
    "forward_with_model_signature",
    "per_sample_gradients",
    "strip_wrapper_prefix",
]


# Every module currently hooked by some capturing wrapper: wrapping one twice would count twice.
HOOKED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class ParameterUsageError(RuntimeError):
    """A parameter received gradient that its owning module's per-sample gradients do not explain."""


WRAPPER_PREFIX = "_module."


def strip_wrapper_prefix(state_dict, module: nn.Module):
    """``state_dict`` with the ``_module.`` key prefix removed, if it was saved from a wrapper holding the
    model as ``_module`` with ``nn.Module.state_dict`` (every key has the prefix and none of ``module``'s
    own keys has it; Opacus's wrappers save this way); otherwise unchanged. The
    ``_metadata`` (per-module versions) is translated with the keys."""
    keys = list(state_dict.keys())
    if not keys or not all(key.startswith(WRAPPER_PREFIX) for key in keys):
        return state_dict
    if any(key.startswith(WRAPPER_PREFIX) for key in module.state_dict()):
        return state_dict
    stripped = OrderedDict((key[len(WRAPPER_PREFIX) :], value) for key, value in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        root = WRAPPER_PREFIX[:-1]
        stripped._metadata = OrderedDict(
            ("" if name == root else name[len(WRAPPER_PREFIX) :], value)
            for name, value in metadata.items()
            if name == root or name.startswith(WRAPPER_PREFIX)
        )
    return stripped


def per_sample_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> ``grad_sample`` for every parameter that has one (a convenience for inspection)."""
    return {n: p.grad_sample for n, p in model.named_parameters() if getattr(p, "grad_sample", None) is not None}


class _BoundForward:
    """A wrapper's forward bound to the wrapper, whose ``__signature__`` is the wrapped model's forward
    signature (what ``inspect.signature(wrapper.forward)`` reports)."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, function: Callable, wrapper: nn.Module) -> None:
        self.__func__ = function
        self.__self__ = wrapper

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        own = inspect.signature(functools.partial(self.__func__, self.__self__))
        model = self.__self__.__dict__.get("_modules", {}).get("_module")
        if model is None:
            return own
        forward = model.forward
        if isinstance(forward, PatchedForward):  # the whole model through the fallback: its own forward's
            forward = forward.original
        try:
            return inspect.signature(forward)
        except (TypeError, ValueError):  # a forward inspect cannot read: the wrapper's own
            return own

    @property
    def __name__(self) -> str:
        return self.__func__.__name__

    def __repr__(self) -> str:
        return f"<bound forward of {type(self.__self__).__name__} wrapping {self.__signature__}>"


class forward_with_model_signature:  # a decorator, lower case like ``property``
    """Decorator of a wrapper's ``forward(self, *args, **kwargs)``: on an instance, ``wrapper.forward``
    reports the wrapped model's forward signature (``inspect.signature``), so that tools that keep only
    the inputs a model's forward accepts (Hugging Face ``Trainer`` drops the other dataset columns) see
    the model's parameters instead of ``*args, **kwargs``. Calls are unchanged; on the class it is the
    plain function."""

    def __init__(self, function: Callable) -> None:
        self._function = function
        functools.update_wrapper(self, function)

    def __get__(self, instance, owner=None):
        if instance is None:
            return self._function
        return _BoundForward(self._function, instance)


class ContractedWrapper(Protocol):
    """Everything ``training/`` (``DPOptimizer``, its ``StepContract`` and ``ParameterSync``) calls on a
    capturing wrapper bound to it; it reads and writes no other attribute of the wrapper.

    ``GradSampleModule`` and ``GhostClippingModule`` implement every method; ``ManualGradSampleModule``
    keeps no per-pass ticket, and answers the last three with ``WrappedModuleAccess``'s defaults. A fast
    clipping wrapper adds ``clipper``, ``padding_mask_source`` and ``attach_clipper``.
    """

    def bind(self, consumer: Any) -> None:
        """Tie the wrapper's training forwards and backward passes to ``consumer`` (the optimizer)."""

    @property
    def bound_optimizer(self) -> Any:
        """The optimizer ``bind`` tied the wrapper to (None while unbound)."""

    def flush_grad_samples(self) -> None:
        """Hand the completed backward passes' per-sample gradients to the bound optimizer."""

    def forget_forward_batch(self) -> None:
        """The optimizer released a step: a later backward must come from a new forward."""

    def discard_unflushed_passes(self) -> None:
        """The optimizer dropped its open step: passes not yet flushed are never handed over."""

    @property
    def has_unflushed_passes(self) -> bool:
        """Whether completed backward passes wait to be flushed."""


class WrappedModuleAccess:
    """Mixin of every capturing wrapper (an ``nn.Module`` holding the model as ``_module``): the model's
    state dict and attributes seen through the wrapper, ``grad_sample`` cleared with the gradients, and
    the step-contract calls of ``ContractedWrapper`` for a wrapper that keeps no per-pass ticket (no-ops:
    ``GradSampleModule`` overrides them). Reads ``_module`` and ``_consumer`` (set by every wrapper's
    ``__init__`` and ``bind``)."""

    @property
    def bound_optimizer(self) -> Any:
        """The ``DPOptimizer`` this wrapper is bound to (``bind``), or None."""
        return self._consumer

    def forget_forward_batch(self) -> None:
        """Nothing to forget: this wrapper does not tie backward passes to their forward."""

    def discard_unflushed_passes(self) -> None:
        """Nothing waits: the per-sample gradients the loop set are handed over at ``flush_grad_samples``."""

    @property
    def has_unflushed_passes(self) -> bool:
        """Always False: this wrapper keeps no pass waiting to be flushed."""
        return False

    def clear_grad_sample(self) -> None:
        """Drop every parameter's per-sample gradients (frees their memory)."""
        for param in self._module.parameters():
            if getattr(param, "grad_sample", None) is not None:
                param.grad_sample = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or, with ``set_to_none``, drop) the gradients as ``nn.Module.zero_grad`` does, and drop
        every parameter's ``grad_sample`` too, so no per-sample gradient of an earlier pass is left over."""
        super().zero_grad(set_to_none=set_to_none)
        self.clear_grad_sample()

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict: same keys as without the wrapper."""
        return self._module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the wrapped module: its own keys, or a wrapper's (every key prefixed ``_module.``, as
        ``nn.Module.state_dict`` of a wrapper holding the model as ``_module`` gives; Opacus saves so)."""
        return self._module.load_state_dict(strip_wrapper_prefix(state_dict, self._module), strict=strict, assign=assign)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_module":
                raise
            return getattr(self._module, name)

    @property
    def wrapped_module(self) -> nn.Module:
        """The model this wrapper holds (``_module``)."""
        # Read at every forward and step (the foreign-parameter check): straight from ``_modules``, where
        # ``nn.Module.__setattr__`` keeps it, without the two Python ``__getattr__`` calls ``self._module`` makes;
        # anywhere else (not set yet), the usual lookup and its AttributeError.
        modules = self.__dict__.get("_modules")
        model = None if modules is None else modules.get("_module")
        return model if model is not None else self._module
