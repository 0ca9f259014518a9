"""The table of per-layer samplers: layer type -> one ``LayerSampler``, the forms a layer family provides.

A ``LayerSampler`` holds up to three functions, all taking the layer's inputs of one forward call and
the gradient of the loss with respect to its output:

- ``grad_sample(layer, activations, backprops) -> {param: per_sample_grad}``, the exact per-sample
  gradients, each of shape ``(batch, *param.shape)``;
- ``norm_sample(layer, activations, backprops) -> {param: per_sample_squared_norm}``, shape ``(batch,)``:
  the squared L2 norm of each example's gradient, computed without materialising the per-sample
  gradients when the layer allows it (fast clipping builds on this);
- ``weighted_sum(layer, activations, backprops, weights) -> {param: sum_i weights[i] * g_i}``: the
  per-example-weighted gradient sum (the clipped sum, when ``weights`` are clip factors) without
  materialising per-sample gradients; since every gradient is linear in the output gradient, this is
  the ordinary gradient computed with ``backprops`` scaled per example (``scale_per_example``).

Arguments, for all three:

- ``activations``: the layer's inputs of one forward call, detached, batch dimension first (the
  positional arguments; keyword arguments are bound into their positions).
- ``backprops``: the gradient of the loss with respect to the layer's output, batch dimension first,
  already scaled so that each example's slice is the gradient of *that example's* loss (the
  ``loss_reduction="mean"`` factor is undone before the sampler is called).
- Results hold an entry for each trainable parameter the layer owns directly; parameters with
  ``requires_grad=False`` are left out.

Registering::

    register_layer_sampler(
        LayerSampler(grad_sample=my_grad_sample, norm_sample=my_norm_sample, weighted_sum=my_weighted_sum),
        MyLayer,
    )

replaces whatever ``MyLayer`` had (a form left out is then absent: fast clipping materialises). The
decorators ``register_grad_sampler(MyLayer)`` / ``register_norm_sampler`` / ``register_weighted_sum_sampler``
(the Opacus-style function form) fill one form of the type's sampler and keep the others.

Third-party packages add samplers through the entry-point group ``privacy_engine.grad_samplers``: each
entry point names a module (or callable) that is imported (called) once, the first time a sampler is
looked up; it registers its samplers with the functions below. Registration is last-wins, so a plugin
overrides a built-in sampler for the same type.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping

import torch
from torch import nn

from grad_samplers._common import scale_per_example  # noqa: F401  (its home before _common; kept importable)

Activations = tuple[object, ...]
GradSampler = Callable[[nn.Module, Activations, torch.Tensor], dict[nn.Parameter, torch.Tensor]]
NormSampler = Callable[[nn.Module, Activations, torch.Tensor], dict[nn.Parameter, torch.Tensor]]
WeightedSumSampler = Callable[[nn.Module, Activations, torch.Tensor, torch.Tensor], dict[nn.Parameter, torch.Tensor]]

ENTRY_POINT_GROUP = "privacy_engine.grad_samplers"
_FORMS = ("grad_sample", "norm_sample", "weighted_sum")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSampler:
    """The per-sample forms of one layer family (see the module docstring for their contracts).

    ``grad_sample`` is what hooks mode needs; fast clipping uses ``norm_sample`` and ``weighted_sum``
    when both are present and otherwise materialises through ``grad_sample``. A sampler holds at least
    one form (one built by a single old-style decorator holds only that one).
    """

    grad_sample: GradSampler | None = None
    norm_sample: NormSampler | None = None
    weighted_sum: WeightedSumSampler | None = None
    #: Optional, for the first-backward usage check only: ``term_scale(layer, activations, backprops) ->
    #: {param: (batch,)}``, each example's L2 norm of ``sum |terms|`` (the per-sample gradient with every
    #: product it sums made non-negative), which sizes the check's rounding tolerance. Without it the check
    #: uses ``norm_sample`` on ``|activations|`` and ``|backprops|``, which is exact for layers linear in
    #: their input (linear, convolution, embedding); a layer that transforms its input first (a
    #: normalisation) provides its own.
    term_scale: NormSampler | None = None

    def __post_init__(self) -> None:
        if self.term_scale is not None and not callable(self.term_scale):
            raise TypeError(f"LayerSampler.term_scale must be callable or None; got {self.term_scale!r}")
        for form in _FORMS:
            function = getattr(self, form)
            if function is not None and not callable(function):
                raise TypeError(f"LayerSampler.{form} must be callable or None; got {function!r}")
        if all(getattr(self, form) is None for form in _FORMS):
            raise ValueError(f"LayerSampler needs at least one of {', '.join(_FORMS)}")


_SAMPLERS: dict[type[nn.Module], LayerSampler] = {}
_plugins_loaded = False


def _check_layer_types(layer_types: tuple, caller: str) -> tuple[type[nn.Module], ...]:
    """The layer types a registration was given, validated: ``(A, B)`` or, as Opacus writes it, one list
    or tuple ``([A, B])``."""
    if len(layer_types) == 1 and isinstance(layer_types[0], (list, tuple)):
        layer_types = tuple(layer_types[0])
    if not layer_types:
        raise TypeError(f"{caller}() needs at least one nn.Module subclass, e.g. {caller}(nn.Linear)")
    for layer_type in layer_types:
        if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
            raise TypeError(f"{caller}() takes nn.Module subclasses (or one list of them); got {layer_type!r}")
    return layer_types


def register_layer_sampler(sampler: LayerSampler, *layer_types: type[nn.Module]) -> LayerSampler:
    """Register ``sampler`` for layers of exactly these types, replacing what they had; returns it.

    Lookup is by exact type (a subclass may change ``forward``, so it falls back to ``torch.func``
    unless registered itself). The types are given as arguments or, as Opacus writes them, in one list.
    """
    if not isinstance(sampler, LayerSampler):
        raise TypeError(f"register_layer_sampler() takes a LayerSampler first; got {sampler!r}")
    for layer_type in _check_layer_types(layer_types, "register_layer_sampler"):
        _SAMPLERS[layer_type] = sampler
    return sampler


def _set_form(layer_type: type[nn.Module], form: str, function: Callable | None) -> None:
    """Put ``function`` (None: remove) as ``form`` of the type's sampler, keeping its other forms."""
    current = _SAMPLERS.get(layer_type)
    if current is None:
        if function is not None:
            _SAMPLERS[layer_type] = LayerSampler(**{form: function})
        return
    if all(getattr(current, other) is None for other in _FORMS if other != form) and function is None:
        del _SAMPLERS[layer_type]
        return
    _SAMPLERS[layer_type] = dataclasses.replace(current, **{form: function})


def _form_decorator(form: str, caller: str, layer_types: tuple) -> Callable[[Callable], Callable]:
    layer_types = _check_layer_types(layer_types, caller)

    def decorate(function: Callable) -> Callable:
        for layer_type in layer_types:
            _set_form(layer_type, form, function)
        return function

    return decorate


def register_grad_sampler(*layer_types: type[nn.Module]) -> Callable[[GradSampler], GradSampler]:
    """Decorator: ``function`` becomes the ``grad_sample`` form of these types' samplers (other forms
    kept). Types as arguments, ``register_grad_sampler(A, B)``, or in one list as Opacus writes them,
    ``register_grad_sampler([A, B])`` (the same for the norm and weighted-sum decorators)."""
    return _form_decorator("grad_sample", "register_grad_sampler", layer_types)


def register_norm_sampler(*layer_types: type[nn.Module]) -> Callable[[NormSampler], NormSampler]:
    """Decorator: ``function`` becomes the ``norm_sample`` form of these types' samplers."""
    return _form_decorator("norm_sample", "register_norm_sampler", layer_types)


def register_weighted_sum_sampler(
    *layer_types: type[nn.Module],
) -> Callable[[WeightedSumSampler], WeightedSumSampler]:
    """Decorator: ``function`` becomes the ``weighted_sum`` form of these types' samplers."""
    return _form_decorator("weighted_sum", "register_weighted_sum_sampler", layer_types)


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


def layer_sampler_for(layer: nn.Module) -> LayerSampler | None:
    """The registered sampler for ``type(layer)``, or None (the ``torch.func`` fallback applies)."""
    load_plugins()
    return _SAMPLERS.get(type(layer))


def _form_for(layer: nn.Module, form: str) -> Callable | None:
    sampler = layer_sampler_for(layer)
    return None if sampler is None else getattr(sampler, form)


def grad_sampler_for(layer: nn.Module) -> GradSampler | None:
    """The registered grad sampler for ``type(layer)``, or None (the ``torch.func`` fallback applies)."""
    return _form_for(layer, "grad_sample")


def norm_sampler_for(layer: nn.Module) -> NormSampler | None:
    """The registered norm sampler for ``type(layer)``, or None (materialise, then reduce)."""
    return _form_for(layer, "norm_sample")


def weighted_sum_sampler_for(layer: nn.Module) -> WeightedSumSampler | None:
    """The registered weighted-sum sampler for ``type(layer)``, or None."""
    return _form_for(layer, "weighted_sum")


def registered_layer_samplers() -> Mapping[type[nn.Module], LayerSampler]:
    """A copy of the table (after plugins are loaded)."""
    load_plugins()
    return dict(_SAMPLERS)


def registered_grad_samplers() -> Mapping[type[nn.Module], GradSampler]:
    """A copy of the types that have a grad sampler, with it (after plugins are loaded)."""
    load_plugins()
    return dict(GRAD_SAMPLERS)


class FormTable(MutableMapping):
    """One form of every registered sampler as a ``{layer type: function}`` mapping: a live view of
    the one table, not a copy. Reading gives the registered function of that form; setting an entry
    sets that form only (as the form's decorator does); deleting one removes that form, and the type's
    entry once it has no form left. (Opacus keeps one dict per form, ``GradSampleModule.GRAD_SAMPLERS``
    and ``NORM_SAMPLERS``, where these views give one form each of a single table.)"""

    def __init__(self, form: str) -> None:
        if form not in _FORMS:
            raise ValueError(f"form must be one of {_FORMS}; got {form!r}")
        self._form = form

    def __getitem__(self, layer_type: type[nn.Module]) -> Callable:
        function = getattr(_SAMPLERS[layer_type], self._form) if layer_type in _SAMPLERS else None
        if function is None:
            raise KeyError(layer_type)
        return function

    def __setitem__(self, layer_type: type[nn.Module], function: Callable) -> None:
        _set_form(layer_type, self._form, function)

    def __delitem__(self, layer_type: type[nn.Module]) -> None:
        if layer_type not in self:
            raise KeyError(layer_type)
        _set_form(layer_type, self._form, None)

    def __iter__(self) -> Iterator[type[nn.Module]]:
        return iter([layer_type for layer_type, sampler in _SAMPLERS.items() if getattr(sampler, self._form)])

    def __len__(self) -> int:
        return sum(1 for _ in self)


GRAD_SAMPLERS = FormTable("grad_sample")
NORM_SAMPLERS = FormTable("norm_sample")
WEIGHTED_SUM_SAMPLERS = FormTable("weighted_sum")
