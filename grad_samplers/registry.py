"""The table of per-layer samplers: layer type -> functions that compute per-sample quantities.

A *grad sampler* has the signature ``(layer, activations, backprops) -> {param: per_sample_grad}``:

- ``activations``: the layer's inputs of one forward call, detached, batch dimension first (the
  positional arguments; keyword arguments are bound into their positions).
- ``backprops``: the gradient of the loss with respect to the layer's output, batch dimension first,
  already scaled so that each example's slice is the gradient of *that example's* loss (the
  ``loss_reduction="mean"`` factor is undone before the sampler is called).
- It returns, for each trainable parameter the layer owns directly, a tensor of shape
  ``(batch, *param.shape)``. Parameters with ``requires_grad=False`` are left out.

A *norm sampler* has the same arguments and returns ``{param: per_sample_squared_norm}`` with tensors of
shape ``(batch,)``: the squared L2 norm of each example's gradient, computed without materialising the
per-sample gradients when the layer allows it (fast clipping builds on this).

A *weighted-sum sampler* ``(layer, activations, backprops, weights) -> {param: sum_i weights[i] * g_i}``
gives the per-example-weighted gradient sum (the clipped sum, when ``weights`` are clip factors) without
materialising per-sample gradients; since every gradient is linear in the output gradient, this is the
ordinary gradient computed with ``backprops`` scaled per example.

Third-party packages add samplers through the entry-point group ``privacy_engine.grad_samplers``: each
entry point names a module (or callable) that is imported (called) once, the first time a sampler is
looked up; it registers its samplers with the decorators below. Registration is last-wins, so a plugin
overrides a built-in sampler for the same type.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import nn

Activations = tuple[object, ...]
GradSampler = Callable[[nn.Module, Activations, torch.Tensor], dict[nn.Parameter, torch.Tensor]]
NormSampler = Callable[[nn.Module, Activations, torch.Tensor], dict[nn.Parameter, torch.Tensor]]
WeightedSumSampler = Callable[[nn.Module, Activations, torch.Tensor, torch.Tensor], dict[nn.Parameter, torch.Tensor]]

ENTRY_POINT_GROUP = "privacy_engine.grad_samplers"

_GRAD_SAMPLERS: dict[type[nn.Module], GradSampler] = {}
_NORM_SAMPLERS: dict[type[nn.Module], NormSampler] = {}
_WEIGHTED_SUM_SAMPLERS: dict[type[nn.Module], WeightedSumSampler] = {}
_plugins_loaded = False


def _check_layer_types(layer_types: tuple, decorator: str) -> tuple[type[nn.Module], ...]:
    """The layer types a decorator was given, validated: ``(A, B)`` or, as Opacus writes it, one list
    or tuple ``([A, B])``."""
    if len(layer_types) == 1 and isinstance(layer_types[0], (list, tuple)):
        layer_types = tuple(layer_types[0])
    if not layer_types:
        raise TypeError(f"{decorator}() needs at least one nn.Module subclass, e.g. {decorator}(nn.Linear)")
    for layer_type in layer_types:
        if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
            raise TypeError(f"{decorator}() takes nn.Module subclasses (or one list of them); got {layer_type!r}")
    return layer_types


def register_grad_sampler(*layer_types: type[nn.Module]) -> Callable[[GradSampler], GradSampler]:
    """Register a function computing exact per-sample gradients for layers of exactly these types.

    Lookup is by exact type (a subclass may change ``forward``, so it falls back to ``torch.func``
    unless registered itself). Registering a type that already has a sampler replaces it. The types
    are given as arguments, ``register_grad_sampler(A, B)``, or as Opacus writes them, in one list:
    ``register_grad_sampler([A, B])`` (the same for the norm and weighted-sum decorators).
    """
    layer_types = _check_layer_types(layer_types, "register_grad_sampler")

    def decorate(function: GradSampler) -> GradSampler:
        for layer_type in layer_types:
            _GRAD_SAMPLERS[layer_type] = function
        return function

    return decorate


def register_norm_sampler(*layer_types: type[nn.Module]) -> Callable[[NormSampler], NormSampler]:
    """Register a function computing per-sample squared gradient norms for layers of these types."""
    layer_types = _check_layer_types(layer_types, "register_norm_sampler")

    def decorate(function: NormSampler) -> NormSampler:
        for layer_type in layer_types:
            _NORM_SAMPLERS[layer_type] = function
        return function

    return decorate


def scale_per_example(tensor: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``tensor`` (batch first) with example ``i`` multiplied by ``weights[i]``: the output gradient a
    weighted-sum sampler differentiates with (every gradient is linear in it)."""
    return tensor * weights.to(tensor.dtype).reshape(-1, *([1] * (tensor.dim() - 1)))


def register_weighted_sum_sampler(
    *layer_types: type[nn.Module],
) -> Callable[[WeightedSumSampler], WeightedSumSampler]:
    """Register a function computing ``sum_i weights[i] * grad_i`` for layers of these types."""
    layer_types = _check_layer_types(layer_types, "register_weighted_sum_sampler")

    def decorate(function: WeightedSumSampler) -> WeightedSumSampler:
        for layer_type in layer_types:
            _WEIGHTED_SUM_SAMPLERS[layer_type] = function
        return function

    return decorate


def load_plugins(*, reload: bool = False) -> None:
    """Import every entry point of the group ``privacy_engine.grad_samplers`` (once)."""
    global _plugins_loaded
    if _plugins_loaded and not reload:
        return
    _plugins_loaded = True
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry_point.load()
            if callable(loaded) and not isinstance(loaded, type):
                loaded()
        except Exception as error:  # noqa: BLE001  (a broken plugin must not break every model, nor the plugins after it)
            warnings.warn(
                f"grad-sampler plugin {entry_point.name!r} ({entry_point.value}) failed to load: {error}",
                stacklevel=2,
            )


def grad_sampler_for(layer: nn.Module) -> GradSampler | None:
    """The registered grad sampler for ``type(layer)``, or None (the ``torch.func`` fallback applies)."""
    load_plugins()
    return _GRAD_SAMPLERS.get(type(layer))


def norm_sampler_for(layer: nn.Module) -> NormSampler | None:
    """The registered norm sampler for ``type(layer)``, or None (materialise, then reduce)."""
    load_plugins()
    return _NORM_SAMPLERS.get(type(layer))


def weighted_sum_sampler_for(layer: nn.Module) -> WeightedSumSampler | None:
    """The registered weighted-sum sampler for ``type(layer)``, or None."""
    load_plugins()
    return _WEIGHTED_SUM_SAMPLERS.get(type(layer))


def registered_grad_samplers() -> Mapping[type[nn.Module], GradSampler]:
    """A read-only view of the table (after plugins are loaded)."""
    load_plugins()
    return dict(_GRAD_SAMPLERS)
