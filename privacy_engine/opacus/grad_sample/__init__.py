"""``opacus.grad_sample`` on this engine: the wrappers under Opacus's names, and the sampler registry.

The wrappers are this engine's (``GradSampleModule``, ``GhostClippingModule``,
``ManualGradSampleModule``) with one difference, Opacus's state-dict keys: a model wrapped here saves
as Opacus saves it (every key prefixed ``_module.``), so a checkpoint goes both ways between the two
libraries; loading accepts keys with and without the prefix. (The engine's own wrappers save the
unwrapped model's keys.)

``register_grad_sampler`` is this engine's registry (types as arguments or in one list, as Opacus
writes them). A grad sampler receives ``(layer, activations, backprops)``: ``activations`` the
layer's inputs (a tuple; Opacus 1.6 passes a list, so ``activations[0]`` works in both),
``backprops`` the output gradient with the mean-reduction factor undone, batch first; it returns
``{parameter: per-sample gradient of shape (batch, *parameter.shape)}``.
"""

from __future__ import annotations

import abc
from typing import Any

from torch import nn

from grad_samplers.registry import GRAD_SAMPLERS, NORM_SAMPLERS, register_grad_sampler, register_norm_sampler
from privacy_engine.capture import GradSampleModule as _GradSampleModule
from privacy_engine.capture.manual import ManualGradSampleModule
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.opacus._binding import wrapper_built
from privacy_engine.settings_checks import check_grad_sample_mode

__all__ = [
    "AbstractGradSampleModule",
    "GradSampleModule",
    "GradSampleModuleExpandedWeights",
    "GradSampleModuleFastGradientClipping",
    "GradSampleModuleNoOp",
    "get_gsm_class",
    "register_grad_sampler",
    "register_norm_sampler",
]


class _OpacusStateDict:
    """Mixin: ``state_dict()`` with Opacus's keys (the wrapper's own nn.Module layout, the model held
    as ``_module``); ``load_state_dict`` takes either layout (the engine's wrapper strips the prefix).
    A wrapper built here is connected as Opacus scripts expect (``opacus._binding``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Opacus scripts never connect their pieces: the namespace connects a hand-built pair (opacus._binding).
        wrapper_built(self)

    def state_dict(self, *args: Any, **kwargs: Any):
        return nn.Module.state_dict(self, *args, **kwargs)

    # Opacus's utility methods, on this engine's mechanics.
    def set_grad_sample_to_none(self) -> None:
        """Set every parameter's ``grad_sample`` to None (Opacus's name for ``clear_grad_sample``)."""
        self.clear_grad_sample()

    def del_grad_sample(self) -> None:
        """Delete the ``grad_sample`` attribute of every parameter."""
        for param in self._module.parameters():
            if hasattr(param, "grad_sample"):
                del param.grad_sample

    def forbid_grad_accumulation(self) -> None:
        """Accepted for Opacus scripts; nothing to switch on: the step contract already clips each
        backward pass's examples on their own (see ``privacy_engine.training.step_contract``)."""

    def allow_grad_accumulation(self) -> None:
        """Accepted for Opacus scripts (see ``forbid_grad_accumulation``)."""

    def remove_hooks(self) -> None:
        """Remove the hooks (the model is given back as by ``to_standard_module``)."""
        self.to_standard_module()

    def cleanup(self) -> None:
        """Remove the hooks and the ``grad_sample`` attributes (Opacus 1.6's name)."""
        self.to_standard_module()


class GradSampleModule(_OpacusStateDict, _GradSampleModule):
    """This engine's ``GradSampleModule`` with Opacus's constructor and state-dict keys.

    ``force_functorch=True`` is accepted and changes nothing: layers without a registered sampler
    always go through ``torch.func``, and the registered samplers are exact. ``GRAD_SAMPLERS``
    (``{layer type: grad sampler}``, Opacus's class attribute) is a live view of the engine's table.
    """

    GRAD_SAMPLERS = GRAD_SAMPLERS

    def __init__(
        self,
        m: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
    ) -> None:
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict)
        self.force_functorch = bool(force_functorch)


class GradSampleModuleFastGradientClipping(_OpacusStateDict, GhostClippingModule):
    """This engine's fast-clipping wrapper (``grad_sample_mode="ghost"``) with Opacus's keys.

    Clipping happens inside the ordinary backward pass, with the bound of the clipper that
    ``make_private`` attaches; Opacus's ``max_grad_norm`` and ``use_ghost_clipping`` arguments are
    accepted for its scripts and not used here. ``GRAD_SAMPLERS`` / ``NORM_SAMPLERS`` (Opacus's class
    attributes) are live views of the engine's table.
    """

    GRAD_SAMPLERS = GRAD_SAMPLERS
    NORM_SAMPLERS = NORM_SAMPLERS

    def __init__(
        self,
        m: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        max_grad_norm: float | None = None,
        use_ghost_clipping: bool = True,
        strict: bool = True,
    ) -> None:
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict)


class GradSampleModuleNoOp(_OpacusStateDict, ManualGradSampleModule):
    """``grad_sample_mode="no_op"``: the loop computes ``p.grad_sample`` itself (see
    ``privacy_engine.capture.ManualGradSampleModule``), with Opacus's keys."""

    def forbid_grad_accumulation(self) -> None:
        """Accepted for Opacus scripts (nothing to switch on)."""

    def allow_grad_accumulation(self) -> None:
        """Accepted for Opacus scripts (nothing to switch on)."""


#: Opacus's expanded-weights wrapper: the same exact per-sample gradients as the hooks here.
GradSampleModuleExpandedWeights = GradSampleModule


class AbstractGradSampleModule(abc.ABC):
    """Every wrapper of this engine and of this namespace (for ``isinstance`` checks)."""


AbstractGradSampleModule.register(_GradSampleModule)
AbstractGradSampleModule.register(ManualGradSampleModule)

def get_gsm_class(grad_sample_mode: str) -> type:
    """The wrapper class of a ``grad_sample_mode`` (Opacus's function)."""
    classes = {
        "hooks": GradSampleModule,
        "functorch": GradSampleModule,
        "ew": GradSampleModuleExpandedWeights,
        "ghost": GradSampleModuleFastGradientClipping,
        "no_op": GradSampleModuleNoOp,
    }
    return classes[check_grad_sample_mode(grad_sample_mode)]
