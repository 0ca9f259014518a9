"""``opacus.utils.module_utils``: small helpers over a module's parameters and state dicts."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "are_state_dict_equal",
    "clone_module",
    "get_submodule",
    "has_trainable_params",
    "parametrized_modules",
    "requires_grad",
    "trainable_modules",
    "trainable_parameters",
]


def has_trainable_params(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` (its submodules included) requires a gradient."""
    return any(p.requires_grad for p in module.parameters())


def parametrized_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, submodule)`` for every submodule (``module`` itself included) that holds parameters
    of its own (not only through its children)."""
    for name, submodule in module.named_modules():
        if any(True for _ in submodule.parameters(recurse=False)):
            yield name, submodule


def trainable_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, submodule)`` for every submodule with a parameter of its own that requires a gradient."""
    for name, submodule in parametrized_modules(module):
        if requires_grad(submodule):
            yield name, submodule


def trainable_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter of ``module`` that requires a gradient."""
    for name, param in module.named_parameters():
        if param.requires_grad:
            yield name, param


def requires_grad(module: nn.Module, *, recurse: bool = False) -> bool:
    """Whether any parameter of ``module`` requires a gradient (its own only, unless ``recurse``)."""
    return any(p.requires_grad for p in module.parameters(recurse=recurse))


def clone_module(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` (nothing is serialised or unpickled)."""
    return copy.deepcopy(module)


def get_submodule(module: nn.Module, target: str) -> nn.Module:
    """The submodule at the dotted path ``target`` (``""`` is ``module`` itself); ``AttributeError``
    naming the missing part when there is none."""
    return module.get_submodule(target)


def _equal(first: Any, second: Any) -> bool:
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
                and first.shape == second.shape and bool(torch.equal(first, second)))  # fmt: skip
    if isinstance(first, Mapping) and isinstance(second, Mapping):
        return first.keys() == second.keys() and all(_equal(first[key], second[key]) for key in first)
    return first == second


def are_state_dict_equal(sd1: Mapping[str, Any], sd2: Mapping[str, Any]) -> bool:
    """Whether two state dicts have the same keys and exactly equal values (tensors compared with
    ``torch.equal``, nested dicts recursively)."""
    return _equal(sd1, sd2)
