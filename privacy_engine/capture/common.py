"""What every capturing wrapper shares (the hooks wrapper, fast clipping, the manual wrapper): the loss
reductions, the error for a parameter used outside its module, the registry of hooked modules, and
Opacus's state-dict key prefix.

Kept apart from the wrappers so that each imports it and none imports another for these.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch import nn

__all__ = [
    "HOOKED_MODULES",
    "LOSS_REDUCTIONS",
    "WRAPPER_PREFIX",
    "ParameterUsageError",
    "WrappedModuleAccess",
    "per_sample_gradients",
    "strip_wrapper_prefix",
]

LOSS_REDUCTIONS = ("mean", "sum")

# Every module currently hooked by some capturing wrapper: wrapping one twice would count twice.
HOOKED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class ParameterUsageError(RuntimeError):
    """A parameter received gradient that its owning module's per-sample gradients do not explain."""


WRAPPER_PREFIX = "_module."


def strip_wrapper_prefix(state_dict, module: nn.Module):
    """``state_dict`` with Opacus's ``_module.`` key prefix removed, if it was saved from a wrapper
    (every key has the prefix and none of ``module``'s own keys has it); otherwise unchanged. The
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


class WrappedModuleAccess:
    """Mixin of every capturing wrapper (an ``nn.Module`` holding the model as ``_module``): the model's
    state dict and attributes seen through the wrapper, and ``grad_sample`` cleared with the gradients."""

    def clear_grad_sample(self) -> None:
        """Drop every parameter's per-sample gradients (frees their memory)."""
        for param in self._module.parameters():
            if getattr(param, "grad_sample", None) is not None:
                param.grad_sample = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.clear_grad_sample()

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict: same keys as without the wrapper."""
        return self._module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the wrapped module: its own keys, or Opacus's (every key prefixed ``_module.``,
        as a checkpoint of an Opacus-wrapped model has them)."""
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
        return self._module
