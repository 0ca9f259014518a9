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
import weakref
from typing import Any

import torch
from torch import nn

from grad_samplers.registry import GRAD_SAMPLERS, NORM_SAMPLERS, register_grad_sampler, register_norm_sampler
from privacy_engine.capture import GradSampleModule as _GradSampleModule
from privacy_engine.capture.common import forward_with_model_signature
from privacy_engine.capture.manual import ManualGradSampleModule
from privacy_engine.clipping.clipper import PerSampleGradientClipper
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.models.validation import UnsupportedModuleError, module_label
from privacy_engine.opacus._binding import wrapper_built
from privacy_engine.settings_checks import check_grad_sample_mode

__all__ = [
    "AbstractGradSampleModule",
    "GradSampleModule",
    "GradSampleModuleExpandedWeights",
    "GradSampleModuleFastGradientClipping",
    "GradSampleModuleNoOp",
    "UnsupportedModelError",
    "drop_released_grad_samples",
    "get_gsm_class",
    "register_grad_sampler",
    "register_norm_sampler",
]


class UnsupportedModelError(UnsupportedModuleError, NotImplementedError):
    """A model the wrapper cannot give per-sample gradients for (a BatchNorm in training mode, a layer
    that ``torch.func`` cannot run per example, ...). Raised by this namespace's wrappers at
    construction, before the model is changed. It is both the engine's ``UnsupportedModuleError`` (a
    ``ValueError``) and the ``NotImplementedError`` Opacus's wrappers raise, so either ``except`` works.
    The message lists each problem and its fix (``ModuleValidator.fix`` / ``fix_module`` for most)."""


#: Set on a ``grad_sample`` tensor the namespace's optimizer put back after releasing its step.
RELEASED_FLAG = "_released_by_step"


def drop_released_grad_samples(module: nn.Module) -> None:
    """Set to None every ``grad_sample`` of ``module``'s parameters that a released step left for
    reading (``DPOptimizer.step`` in this namespace): the next backward must start from nothing, not
    add its examples' rows to those of the previous batch."""
    for param in module.parameters():
        grad_sample = getattr(param, "grad_sample", None)
        if grad_sample is not None and getattr(grad_sample, RELEASED_FLAG, False):
            param.grad_sample = None


class _OpacusStateDict:
    """Mixin: ``state_dict()`` with Opacus's keys (the wrapper's own nn.Module layout, the model held
    as ``_module``); ``load_state_dict`` takes either layout (the engine's wrapper strips the prefix).
    A wrapper built here is connected as Opacus scripts expect (``opacus._binding``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(*args, **kwargs)
        except UnsupportedModuleError as error:
            if isinstance(error, NotImplementedError):
                raise
            raise UnsupportedModelError(str(error)) from error
        # Opacus scripts never connect their pieces: the namespace connects a hand-built pair (opacus._binding).
        wrapper_built(self)

    @forward_with_model_signature
    def forward(self, *args: Any, **kwargs: Any):
        """The engine's forward; a training forward first drops the ``grad_sample`` a released step left
        for reading (``drop_released_grad_samples``), so each backward's rows are its own examples'."""
        if self.training and torch.is_grad_enabled():
            drop_released_grad_samples(self._module)
        return super().forward(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any):
        return nn.Module.state_dict(self, *args, **kwargs)

    # Opacus's utility methods, on this engine's mechanics.
    def set_grad_sample_to_none(self) -> None:
        """Set every parameter's ``grad_sample`` to None (Opacus's name for ``clear_grad_sample``)."""
        self.clear_grad_sample()

    def del_grad_sample(self) -> None:
        """Delete the ``grad_sample`` attribute of every parameter."""
        if "_earlier_passes" in self.__dict__:
            self._earlier_passes = {}
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


class _HooksSwitch:
    """Opacus's ``enable_hooks()`` / ``disable_hooks()`` / ``hooks_enabled`` for the namespace's ``GradSampleModule``."""

    @property
    def hooks_enabled(self) -> bool:
        """Whether forward and backward passes compute per-sample gradients (``disable_hooks``)."""
        return self.__dict__.get("_hooks_enabled", True)

    def enable_hooks(self) -> None:
        """Compute per-sample gradients again after ``disable_hooks()``."""
        self._hooks_enabled = True

    def disable_hooks(self) -> None:
        """Run the model without computing per-sample gradients until ``enable_hooks()``: a backward
        then fills ``p.grad`` only, as the plain model would (for evaluation, or for gradients that
        are not to be released).

        Guarantee: nothing computed while the hooks are off can be released: a private optimizer's
        ``step()`` after such a backward finds no per-sample gradients and raises, releasing and
        recording nothing (the step contract, ``privacy_engine.training.step_contract``). The switch
        acts at the forward: a backward run with the hooks disabled through a forward run with them
        enabled still gives that forward's per-sample gradients, clipped and released as usual (passes
        over one batch are summed per example before clipping, so nothing is clipped twice; Opacus
        raises at ``step()`` there). The fast-clipping wrapper refuses that case instead (see
        ``GradSampleModuleFastGradientClipping``).
        """
        self._hooks_enabled = False

    @forward_with_model_signature
    def forward(self, *args: Any, **kwargs: Any):
        """The wrapper's forward; with the hooks disabled, the same forward with nothing captured."""
        if self.hooks_enabled or not self.training:
            return super().forward(*args, **kwargs)
        # The capture and the batch binding read the wrapper's own training flag (the layers keep
        # theirs, so dropout and normalisation behave as in training): off, nothing is captured.
        self.training = False
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.training = True


class _FastClippingHooksSwitch(_HooksSwitch):
    """``enable_hooks()`` / ``disable_hooks()`` / ``hooks_enabled`` for the fast-clipping wrapper, and the count
    of its clipped passes for ``DPOptimizer.accumulated_iterations``.

    Guarantee: a training forward run with the hooks disabled is the plain model's forward (every
    gated layer, attention and ``torch.func`` fallback runs its own forward on the real parameters):
    its backward fills ``.grad`` with the plain gradient, clips nothing and captures nothing, and a
    private ``step()`` after it alone releases nothing (the step contract finds no per-sample
    contribution and raises). A forward run with the hooks enabled is clipped in its backward if the hooks
    are still enabled then. A backward run with the hooks disabled through such a forward captures and clips
    nothing and gives the gated parameters no gradient:

    ============================================  ==================================================
    the forward's calls that backward reaches     result
    ============================================  ==================================================
    all clipped already by a backward with the    nothing more (Opacus's second pass of its two-pass
    hooks enabled (``get_clipping_coef()``, then  pattern: here the first pass already clipped, so
    ``disable_hooks()``, then a weighted loss's   the step releases the clipped sum once)
    backward)
    some never clipped (the hooks were disabled   the next ``step()`` of the connected optimizer
    before the forward's first backward)          raises ``RuntimeError`` naming the layers, before
                                                  anything is released or counted; a later backward
                                                  with the hooks enabled through the same forward
                                                  clips them and lifts the refusal;
                                                  ``optimizer.zero_grad()`` drops the open step
                                                  (nothing of it released) and the refusal with it
    wrapper connected to no optimizer             nothing (nothing is released from it)
    ============================================  ==================================================

    (Opacus 1.6 puts the plain, unclipped gradient of such a backward in ``.grad`` and its fast-clipping
    optimizer releases it; its hooks-mode optimizer raises at ``step()`` as here.) While the hooks are
    disabled, a gradient reaching a parameter is the plain one and is let through (with them enabled, such a
    gradient raises ``ParameterUsageError``).
    """

    @forward_with_model_signature
    def forward(self, *args: Any, **kwargs: Any):
        """The fast-clipping forward; with the hooks disabled, the plain model's forward."""
        if self.hooks_enabled or not (self.training and torch.is_grad_enabled()):
            return super().forward(*args, **kwargs)
        # Every patched forward (gated layers, attention, the torch.func fallback) runs the layer's own
        # forward while this flag is set, so the parameters are used as in the plain model. (Switching the
        # wrapper's training flag instead leaves the layers in training mode: the gates then still detach the
        # parameters, and the backward gives no plain gradient.)
        self._flags.inside_fallback = True
        try:
            return self._module(*args, **kwargs)
        finally:
            self._flags.inside_fallback = False

    def _reject_gradient(self, name: str, grad: torch.Tensor | None) -> None:
        if not self.hooks_enabled:
            return  # the plain gradient of a forward run with the hooks disabled
        super()._reject_gradient(name, grad)

    # A backward pass run with the hooks disabled captures nothing. Through calls a backward with the hooks
    # enabled already consumed (Opacus's second pass) that is all; a call never consumed is noted, and the
    # connected optimizer's next step refuses (``flush_grad_samples``) unless a backward with the hooks enabled
    # consumes it first. The note holds the call weakly (its inputs must not outlive its graph) and its label.
    def _on_output_grad(self, use: Any, grads: torch.Tensor) -> None:
        if self.hooks_enabled:
            super()._on_output_grad(use, grads)
            self._clipped_after_all(use)
        else:
            self._note_unclipped(use)

    def _on_fallback_grad(self, use: Any, param: nn.Parameter, grads: torch.Tensor) -> None:
        if self.hooks_enabled:
            super()._on_fallback_grad(use, param, grads)
            self._clipped_after_all(use)
        else:
            self._note_unclipped(use)

    def _note_unclipped(self, use: Any) -> None:
        if use.consumed or self._consumer is None:
            return
        unclipped = self.__dict__.setdefault("_unclipped_calls", {})
        unclipped[id(use)] = (weakref.ref(use), module_label(use.path, use.layer))

    def _clipped_after_all(self, use: Any) -> None:
        unclipped = self.__dict__.get("_unclipped_calls")
        if unclipped:
            noted = unclipped.get(id(use))
            if noted is not None and noted[0]() is use:
                del unclipped[id(use)]

    def flush_grad_samples(self) -> None:
        """The engine's call at the start of every ``step()`` (before anything is clipped, released or counted);
        here it first refuses a step whose forward was backpropagated only with the hooks disabled (see the
        class docstring): that batch's examples would be silently left out of the release."""
        unclipped = self.__dict__.get("_unclipped_calls")
        if unclipped:
            layers = sorted({label for _, label in unclipped.values()})
            raise RuntimeError(
                f"a backward pass ran with the hooks disabled (disable_hooks()) through a forward run with them "
                f"enabled, and no backward with the hooks enabled reached the layers {', '.join(layers)} of that "
                f"forward: their gradient was neither clipped nor captured, so this step would release the batch "
                f"without it. Nothing was released or counted. Call optimizer.zero_grad() (it drops the open step), "
                f"then run the batch again with the hooks enabled for its first backward (Opacus's two-pass pattern: "
                f"backward with the hooks enabled, get_clipping_coef(), then disable_hooks() for the weighted second "
                f"backward; or one backward through DPLossFastGradientClipping)."
            )
        super().flush_grad_samples()

    def discard_unflushed_passes(self) -> None:
        """The engine's call when the optimizer drops its open step (``zero_grad``): the calls noted by a backward
        with the hooks disabled are dropped with it."""
        self._unclipped_calls = {}
        super().discard_unflushed_passes()

    def __getstate__(self) -> dict:
        """Pickle without the calls noted by a backward with the hooks disabled (they belong to the training
        run, as the engine's open step does)."""
        state = super().__getstate__()
        state.pop("_unclipped_calls", None)
        return state

    def _clip_pass(self) -> None:
        # The end of a backward pass: tell the connected namespace optimizer that one pass was clipped into its
        # open step (Opacus's accumulated_iterations), once the clipper holds it.
        state = self._passes.current
        clipped = state is not None and state.batch is not None and self._consumer is not None
        super()._clip_pass()
        note = getattr(self._consumer, "_note_fast_clipping_pass", None) if clipped else None
        if note is not None:
            note()


class _GradSampleListPerPass:
    """Opacus's ``p.grad_sample`` format for a ``GradSampleModule`` used on its own (connected to no
    optimizer): after one backward pass a tensor ``(batch, *p.shape)``; after passes through several
    forwards without ``zero_grad()``, a list with one such tensor per forward, in order (a second backward
    pass through one forward is refused by the wrapper, as without this format).

    Guarantee: each list entry holds exactly the per-sample gradients of one forward's examples; rows of
    different forwards are never added (the engine alone would add them row by row when the batch sizes
    match). Nothing here is released: a wrapper connected to a ``DPOptimizer`` (``make_private``, or one
    built here) keeps the engine's behaviour, each pass clipped on its own at the next batch; a training
    forward of a connected wrapper whose ``grad_sample`` still holds such a list raises ``RuntimeError``
    (call ``zero_grad()`` first) before the model runs.
    """

    def _standalone_pass(self) -> bool:
        return self.bound_optimizer is None and self.training and torch.is_grad_enabled() and self.hooks_enabled

    @forward_with_model_signature
    def forward(self, *args: Any, **kwargs: Any):
        """The wrapper's forward; used on its own, it first sets the earlier forwards' per-sample gradients
        aside, so that this forward's backward passes fill ``grad_sample`` afresh (see the class docstring)."""
        if not self._standalone_pass():
            # Lists exist only while earlier passes are set aside (clear_grad_sample empties both).
            if self.bound_optimizer is not None and any(
                isinstance(getattr(p, "grad_sample", None), list) for p in self.__dict__.get("_earlier_passes", ())
            ):
                raise RuntimeError(
                    "grad_sample holds the per-sample gradients of several backward passes run before this wrapper "
                    "was connected to an optimizer; call zero_grad() before training with it"
                )
            return super().forward(*args, **kwargs)
        earlier = {}
        for param in (p for p in self._module.parameters() if p.requires_grad):
            held = getattr(param, "grad_sample", None)
            if held is not None:
                earlier[param] = list(held) if isinstance(held, list) else [held]
                param.grad_sample = None
        self._earlier_passes = earlier
        output = super().forward(*args, **kwargs)
        if earlier:
            for leaf in torch.utils._pytree.tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    leaf.register_hook(self._on_output_backward)
        return output

    def _on_output_backward(self, grad: torch.Tensor) -> None:
        # At the start of a backward pass through the newest forward: its own tensor (if any) back in grad_sample,
        # where the engine's hooks expect a tensor, and the lists assembled again at the pass's end.
        earlier = self.__dict__.get("_earlier_passes", {})
        for param, passes in earlier.items():
            held = getattr(param, "grad_sample", None)
            if isinstance(held, list):
                param.grad_sample = held[-1] if len(held) > len(passes) else None
        if earlier and not self.__dict__.get("_lists_queued", False):
            self._lists_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._assemble_lists)

    def _assemble_lists(self) -> None:
        self._lists_queued = False
        for param, passes in self.__dict__.get("_earlier_passes", {}).items():
            held = getattr(param, "grad_sample", None)
            if isinstance(held, list):
                continue
            param.grad_sample = passes + ([] if held is None else [held])

    def clear_grad_sample(self) -> None:
        """Drop every parameter's per-sample gradients, those of earlier forwards included."""
        self._earlier_passes = {}
        super().clear_grad_sample()


class GradSampleModule(_GradSampleListPerPass, _OpacusStateDict, _HooksSwitch, _GradSampleModule):
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


class _StandaloneClipper(PerSampleGradientClipper):
    """The clipper of a fast-clipping wrapper used without an optimizer: each backward pass's clipped
    sum is added to the parameters' ``.grad`` (Opacus's behaviour), besides the accumulator."""

    def accumulate_clipped_sums_(self, clipped_sums, per_sample_norms, *, padding_mask=None, take_ownership=False):
        super().accumulate_clipped_sums_(clipped_sums, per_sample_norms, padding_mask=padding_mask)
        self.reset()  # nothing is released from here: the sums live in .grad only
        for param, total in clipped_sums.items():
            total = total.detach().to(param.dtype)
            param.grad = total.clone() if param.grad is None else param.grad + total


class GradSampleModuleFastGradientClipping(_OpacusStateDict, _FastClippingHooksSwitch, GhostClippingModule):
    """This engine's fast-clipping wrapper (``grad_sample_mode="ghost"``) with Opacus's keys.

    Clipping happens inside the ordinary backward pass, with the bound of the clipper that
    ``make_private`` (or a ``DPOptimizer`` built by hand and connected to it) attaches. Used on its
    own, without an optimizer, the wrapper clips at ``max_grad_norm``: after ``backward()`` each
    parameter's ``.grad`` holds the sum over the examples of their gradients clipped to
    ``max_grad_norm`` in total L2 norm (Opacus's result; no noise: nothing is private yet), and
    ``last_per_sample_norms`` their unclipped norms. A ``DPOptimizer`` of this namespace built over its
    parameters before its first training forward (Opacus's hand-built pipeline) is connected to it, and
    its clipper (at the optimizer's ``max_grad_norm``, the bound the noise is calibrated to) is used
    instead. A training forward without a clipper and without ``max_grad_norm`` raises ``RuntimeError``.
    ``p.grad_sample`` is None on every trainable parameter (Opacus's attribute; nothing is materialised). ``use_ghost_clipping`` is accepted for Opacus's
    scripts (the engine chooses per layer). ``GRAD_SAMPLERS`` / ``NORM_SAMPLERS`` (Opacus's class
    attributes) are live views of the engine's table. ``enable_hooks()`` / ``disable_hooks()``: a backward
    with the hooks disabled through a forward no backward with them enabled clipped makes the connected
    optimizer's next ``step()`` raise before anything is released or counted (``_FastClippingHooksSwitch``);
    each clipped backward pass counts in ``DPOptimizer.accumulated_iterations``.
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
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number or None; got {max_grad_norm!r}")
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict)
        self.max_grad_norm = max_grad_norm
        self.use_ghost_clipping = use_ghost_clipping
        for param in self._module.parameters():
            if param.requires_grad:
                param.grad_sample = None  # Opacus's attribute; fast clipping never forms per-sample gradients

    def get_norm_sample(self) -> torch.Tensor:
        """Each example's gradient norm in the last backward pass (unclipped; shape ``(batch,)`` for flat
        clipping, ``(batch, num_groups)`` per layer): Opacus's method, here ``last_per_sample_norms``.
        ``RuntimeError`` before any backward pass."""
        norms = self.last_per_sample_norms
        if norms is None:
            raise RuntimeError("no per-sample norms yet: run a training forward and its backward first")
        return norms[:, 0] if norms.dim() == 2 and norms.shape[1] == 1 else norms

    def get_clipping_coef(self) -> torch.Tensor:
        """The factor each example's gradient was multiplied by in the last backward pass (the clipper's rule,
        at most 1), same shape as ``get_norm_sample()``. Opacus's method. Here the clipping already happened
        inside that backward pass: a second backward weighted by these factors (Opacus's two-pass pattern)
        is not needed (``DPLossFastGradientClipping`` runs one)."""
        norms = self.get_norm_sample()
        factors = self.clipper.clip_factors_for_norms(norms)
        return factors[:, 0] if norms.dim() == 1 else factors

    @forward_with_model_signature
    def forward(self, *args: Any, **kwargs: Any):
        """The engine's fast-clipping forward; used on its own, it first attaches a clipper at
        ``max_grad_norm`` (see the class docstring)."""
        if self.training and torch.is_grad_enabled() and self.clipper is None and self.max_grad_norm is not None:
            trainable = [p for p in self._module.parameters() if p.requires_grad]
            self.attach_clipper(_StandaloneClipper(trainable, float(self.max_grad_norm)))
        return super().forward(*args, **kwargs)


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
