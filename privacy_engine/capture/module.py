"""GradSampleModule: wrap an ``nn.Module`` so that every backward pass also yields exact per-sample
gradients in ``param.grad_sample``.

How it works, per submodule that directly owns parameters:

- a layer with a registered grad sampler (``grad_samplers``) gets a forward hook that keeps its
  (detached) inputs and puts a gradient hook on its output; when the output's gradient arrives the
  sampler turns inputs and output gradient into per-sample gradients, and the inputs are dropped
  (``capture.hooks``);
- any other module is handed to the ``torch.func`` fallback, which runs its forward under ``vmap``
  with one view of its parameters per example (it claims the module's whole subtree;
  ``capture.fallback_bridge``).

Per-sample gradients add up: over several calls of a module in one forward, over modules sharing a
parameter (tied embeddings), and over several backward passes until ``clear_grad_sample()``.

The other pieces of the wrapper, one file each: the batch size of a forward (``capture.batch_size``),
the step contract (``capture.step_binding``), the first-backward check (``capture.usage_check``), the
independence of the examples (``capture.independence``, ``capture.loss_coupling``). Their state is
declared in ``capture.state``, one object per part, with which part writes and reads it.
Fast clipping (``privacy_engine.clipping.ghost``) subclasses this wrapper; this module never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from functools import partial
from typing import ClassVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from grad_samplers import grad_sampler_for, is_per_sample_unit, register_optional_samplers
from grad_samplers.registry import GradSampler
from privacy_engine.capture.batch_size import BatchSizeTracking, declared_batch_dims
from privacy_engine.capture.common import (
    HOOKED_MODULES,
    ParameterUsageError,
    WrappedModuleAccess,
    forward_with_model_signature,
)
from privacy_engine.capture.fallback_bridge import FallbackBridge
from privacy_engine.capture.hooks import LayerHooks
from privacy_engine.capture.independence import IndependenceGuard
from privacy_engine.capture.root_parameters import ROOT_PARAMETER_ELEMENTS, RootParameters
from privacy_engine.capture.state import BatchSizeState, CaptureTables, ForwardFlags, UsageCheckState
from privacy_engine.capture.step_binding import (
    StepContractBinding,
    mark_wrapped_parameters,
    set_binding_fields,
    unmark_wrapped_parameters,
)
from privacy_engine.capture.usage_check import UsageCheck
from privacy_engine.integrations.hf_losses import install_per_example_losses
from privacy_engine.models.validation import UnsupportedModuleError, batchnorm_problem, find_problems, module_label
from privacy_engine.settings_checks import check_loss_reduction

__all__ = ["GradSampleModule", "ParameterUsageError"]


class GradSampleModule(
    UsageCheck,
    LayerHooks,
    FallbackBridge,
    RootParameters,
    StepContractBinding,
    BatchSizeTracking,
    WrappedModuleAccess,
    nn.Module,
):
    """Wraps ``module``; after ``loss.backward()`` each trainable parameter ``p`` holds
    ``p.grad_sample`` of shape ``(batch, *p.shape)`` next to the ordinary ``p.grad``.

    Guarantee: ``p.grad_sample[i]`` is the gradient of example ``i``'s own loss term with respect to
    ``p`` (exact, not an estimate), so that ``p.grad_sample.sum(0)`` equals ``p.grad`` for
    ``loss_reduction="sum"`` and ``batch * p.grad`` for ``"mean"``. At the first backward this is
    checked for every parameter: a parameter whose gradient is not explained by its owning module's
    per-sample gradients (used outside that module's forward) raises ``ParameterUsageError``.

    ==============================  ==================================================
    case                            behaviour
    ==============================  ==================================================
    module called twice in forward  contributions summed per example
    parameter shared by modules     contributions summed per example (tied weights)
    two backward passes             summed until ``clear_grad_sample()``/``zero_grad``
    frozen parameter                no ``grad_sample``
    wrapper in eval / ``no_grad``   nothing captured, nothing kept
    a layer in eval, wrapper train  captured as usual (BatchNorm with frozen statistics)
    BatchNorm in training mode      ``UnsupportedModuleError`` (use GroupNorm)
    examples interacting: batch     ``InteractingExamplesError`` before the output is
    statistics, a buffer written,   returned or, for the loss, before backward
    a coupled loss (first step)     (``capture.independence``, ``capture.loss_coupling``)
    Embedding max_norm / sparse     ``UnsupportedModuleError``
    a layer's output has 1 example  shared by every example (position embeddings with
    in a forward of B examples      ``position_ids`` (1, T)): expanded to B, exact
                                    (see ``_note_batch_size``)
    other batch-size differences    ``ValueError`` naming both modules
    0-dim parameter                 ``grad_sample`` of shape ``(batch,)``
    custom autograd.Function in a   ``UnsupportedModuleError`` naming the module (add
    fallback module, without vmap   ``setup_context`` / vmap support)
    model called directly, not      ``RuntimeError`` at the first hooked layer
    through the wrapper (training)
    activation checkpointing        exact, equal to the run without it (``capture.recompute``);
    (torch.utils.checkpoint, HF)    a forward during backward that is not a recomputation:
                                    ``RuntimeError``
    parameter owned by the root     its own per-sample gradients by forward-mode tangents
    itself (CLIP ``logit_scale``)   (``capture.root_parameters``); children hooked as usual
    module owning only frozen       no fallback owner (children hooked); unfrozen after
    parameters (no sampler)         wrapping: ``RuntimeError`` at the next training forward
    sampler returns a wrong shape   ``RuntimeError`` naming the sampler and module
    backward twice on one forward   ``RuntimeError`` (inputs were freed after use)
    empty batch (Poisson sampling)  ``grad_sample`` of shape ``(0, *p.shape)``
    called after unwrapping         ``RuntimeError`` (see ``to_standard_module``)
    ==============================  ==================================================

    Args:
        module: the model. It is not copied; ``to_standard_module()`` gives it back unchanged.
        batch_first: whether the batch is dim 0 (True) or dim 1 (False) of the inputs and outputs, and
            of every layer not inside a module that declares its own layout (a boolean ``batch_first``
            attribute, e.g. ``nn.TransformerEncoderLayer(batch_first=False)``: the layers inside it are
            read at dim 1 whatever this says; ``capture.batch_size.declared_batch_dims``).
        loss_reduction: ``"mean"`` if the loss averages over the batch (its 1/B is undone),
            ``"sum"`` if it sums.
        grad_sample_mode: only ``"hooks"``. Fast clipping (per-sample norms and the clipped sum inside
            backward, no ``grad_sample``) is another wrapper, built explicitly: ``GhostClippingModule``
            (``"ghost"`` raises ``ValueError`` saying so).
        strict: raise on the wrap-time problems above (True) or only warn (False: the per-sample
            gradients of the offending modules are then not trustworthy).

    State: one object per part (``capture.state``): ``_tables`` (what wrapping set up), ``_flags`` (where
    the wrapper is), ``_usage`` (the first-backward check), ``_batch_sizes`` (the running forward's batch),
    ``_independence`` (``IndependenceGuard``), and the step binding's fields (``StepContractBinding``).
    ``training/`` reaches it only through the public step-contract methods (``bind``,
    ``flush_grad_samples``, ``forget_forward_batch``, ``discard_unflushed_passes``,
    ``has_unflushed_passes``; ``capture.common.ContractedWrapper``).
    """

    #: Whether the first backward verifies every parameter's gradient against its per-sample gradients
    #: (``capture.usage_check``). A subclass whose backward never writes ``.grad`` turns it off and refuses
    #: stray gradients its own way (``GhostClippingModule``: a hook per parameter).
    checks_parameter_usage: ClassVar[bool] = True

    def __init__(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        grad_sample_mode: str = "hooks",
    ) -> None:
        _check_hooks_mode(grad_sample_mode)
        _check_wrappable(module, loss_reduction, strict)
        super().__init__()
        self._module = module
        self.batch_first = batch_first
        self.loss_reduction = loss_reduction
        self.strict = strict
        self._batch_dim = 0 if batch_first else 1
        # The state of each part, declared in capture.state (which part writes and reads what).
        param_names: dict[nn.Parameter, str] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            param_names.setdefault(param, name)
        self._tables = CaptureTables(
            param_names=param_names,
            batchnorms=[(p, m) for p, m in module.named_modules() if isinstance(m, _BatchNorm)],
        )
        self._flags = ForwardFlags()
        self._usage = UsageCheckState(phase="pending" if self.checks_parameter_usage else "off")
        self._batch_sizes = BatchSizeState()
        # The step contract's state, declared by StepContractBinding (capture.step_binding), set when a
        # DPOptimizer binds this wrapper: which batch each forward ran on, and per-pass clipping.
        self._consumer = None  # the DPOptimizer whose clipper takes this wrapper's backward passes
        self._generation = 0  # training forwards so far; a backward checks its forward is still live
        self._generation_tickets: dict[int, object] = {}
        self._forward_ticket = None  # the batch of the newest training forward
        self._grad_sample_ticket = None  # the batch whose completed backward passes fill grad_sample
        self._backward_running = False
        self._awaiting_backward = False  # a forward on a drawn batch ran and its backward has not
        self._independence = IndependenceGuard(module, batch_dim=self._batch_dim, strict=strict)
        root_parameters = _root_parameters_by_tangents(module)
        self._tables.root_parameters = root_parameters
        for _, param in root_parameters:
            self._tables.owner_paths.setdefault(param, "")
        try:
            plan, self._tables.unowned = self._plan(module, skip_root=bool(root_parameters))
            self._tables.layer_batch_dims = declared_batch_dims(module, [path for path, _, _ in plan], self._batch_dim)
            for path, layer, sampler in plan:
                self._attach(path, layer, sampler)
            self._tables.handles.append(module.register_forward_pre_hook(self._note_input_batch, with_kwargs=True))
        except BaseException:
            self._detach()
            raise
        # Hugging Face models called with labels= through this wrapper return per-example losses (issue 18).
        self._hf_losses = install_per_example_losses(module, loss_reduction=loss_reduction, is_active=self._forwarding)
        mark_wrapped_parameters(module, type(self).__name__)  # binds nothing: privacy_engine.connect_private does

    # ------------------------------------------------------------------ wrapping
    @staticmethod
    def _plan(
        root: nn.Module, *, skip_root: bool = False
    ) -> tuple[list[tuple[str, nn.Module, GradSampler | None]], list[tuple[str, nn.Parameter]]]:
        """(path, module, sampler or None for the fallback) for each module owning parameters, and the
        frozen parameters no module owns.

        A module with a grad sampler owns its parameters, frozen or not (its hook checks ``requires_grad``
        at each forward). A module without one owns them only if one is trainable: then the fallback
        differentiates its whole subtree; a module whose own parameters are all frozen is no fallback owner
        (its children are planned as usual) and its parameters are listed as unowned (refused at the
        forward if unfrozen). A registered per-sample unit (``grad_samplers.units``) with a trainable
        parameter anywhere in its subtree goes to the fallback whole, whatever samplers its layers have. ``skip_root``: the root's own parameters have their own path
        (``capture.root_parameters``)."""
        register_optional_samplers()  # samplers for layers of libraries imported since (HF Conv1D)
        plan: list[tuple[str, nn.Module, GradSampler | None]] = []
        unowned: list[tuple[str, nn.Parameter]] = []

        def visit(path: str, module: nn.Module) -> None:
            # One unit of the fallback (grad_samplers.units): its layers do not hold the examples at a dim.
            if module is not root and is_per_sample_unit(module) and any(p.requires_grad for p in module.parameters()):
                plan.append((path, module, None))
                return
            own = list(module.named_parameters(recurse=False))
            sampler = grad_sampler_for(module)
            if own and not (skip_root and module is root):
                if sampler is not None or any(p.requires_grad for _, p in own):
                    plan.append((path, module, sampler))
                    if sampler is None:
                        return  # the fallback differentiates the whole subtree
                else:
                    unowned.extend((f"{path}.{name}" if path else name, p) for name, p in own)
            for name, child in module.named_children():
                visit(f"{path}.{name}" if path else name, child)

        visit("", root)
        return plan, unowned

    def _attach(self, path: str, layer: nn.Module, sampler: GradSampler | None) -> None:
        """Instrument one module that owns parameters (``sampler``: its grad sampler, None for the fallback).

        The extension point of construction: ``__init__`` calls it once per module of ``_plan``, after
        every state object of this class exists and before a subclass's ``__init__`` goes on. An override
        (``GhostClippingModule``) records the owner in ``_tables.owner_paths``, installs hooks or forwards,
        lists them in ``_tables`` (``handles`` / ``patched``) and adds the module to ``HOOKED_MODULES``; what
        it installs may read the subclass's own state only when it runs (at forward time).
        """
        owned = layer.parameters(recurse=sampler is None)
        for param in owned:
            self._tables.owner_paths.setdefault(param, path)
        if sampler is not None:
            handle = layer.register_forward_hook(partial(self._capture, path, sampler), with_kwargs=True)
            self._tables.handles.append(handle)
        else:
            self._patch_forward(path, layer)
        HOOKED_MODULES.add(layer)

    def _detach(self) -> None:
        tables = self._tables
        for handle in tables.handles + self._usage.handles:
            handle.remove()
        tables.handles, self._usage.handles = [], []
        for module in tables.patched:
            del module.forward
            if module in tables.instance_forwards:
                module.forward = tables.instance_forwards.pop(module)
        tables.patched = []
        for module in self._module.modules():
            HOOKED_MODULES.discard(module)

    def to_standard_module(self) -> nn.Module:
        """Remove every hook and attribute this wrapper added and return the original module.

        The wrapper is unusable afterwards: calling it raises instead of silently computing nothing.
        """
        self._flags.released = True
        unmark_wrapped_parameters(self._module)
        self._consumer = None
        self._independence.end_loss_monitor()
        self._detach()
        if self._hf_losses is not None:
            self._hf_losses.remove()
        for param in self._module.parameters():
            if hasattr(param, "grad_sample"):
                del param.grad_sample
        return self._module

    # ------------------------------------------------------------------ forward
    @forward_with_model_signature
    def forward(self, *args, **kwargs):
        """Run the wrapped module with its per-sample gradient hooks, and return its output.

        Raises before the model runs: ``RuntimeError`` after ``to_standard_module()``;
        ``UnsupportedModuleError`` for a BatchNorm in training mode with gradients on (``strict``). When bound
        to a private optimizer in training mode with gradients on, the independence checks run around the
        forward (``IndependenceGuard``: ``InteractingExamplesError`` before the output is returned) and the
        forward's batch is identified for the step contract. Unbound, or in eval mode / under ``no_grad``,
        nothing is tied to a step."""
        if self._flags.released:
            raise RuntimeError(
                "this GradSampleModule was unwrapped by to_standard_module(); call the returned module, "
                "or wrap it again for per-sample gradients"
            )
        independence = self._independence
        independence.end_loss_monitor()
        tables = self._tables
        # (Grad mode and training mode are read once: nothing below, before the model runs, changes them.)
        grad_enabled = torch.is_grad_enabled()
        training = self.training and grad_enabled
        if tables.batchnorms and grad_enabled and self.strict:
            for path, batchnorm in tables.batchnorms:
                if batchnorm.training:
                    raise UnsupportedModuleError(batchnorm_problem(path, batchnorm))
        # Examples must not interact (capture.independence): buffers written, batch statistics, coupled losses.
        # Only a wrapper bound to a private optimizer releases anything; an unbound one is a per-sample
        # gradient tool and keeps its forward count and side effects.
        bound = training and self._consumer is not None
        if bound:
            independence.before_training_forward()
        if self._usage.phase in ("pending", "armed"):
            if training:
                self._arm_usage_check()
            elif self._usage.phase == "armed":
                # A training forward that never reached backward must not judge this one, which computes
                # no per-sample gradients by design.
                self._finish_usage_check()
                self._usage.phase = "pending"
        self._batch_sizes.forward_batch = None
        if bound:
            self._before_bound_forward()
        if training and tables.unowned:
            self._check_unowned_frozen()
        module = self._modules["_module"]  # (self._module, without two Python __getattr__ calls)
        flags = self._flags
        flags.in_forward = True
        try:
            # (No trainable-root bookkeeping at all for a model whose root owns no parameters: the usual case.)
            if training and tables.root_parameters:
                with self._root_parameter_forward() as root_pass:
                    output = module(*args, **kwargs)
            else:
                root_pass = None
                output = module(*args, **kwargs)
        finally:
            flags.in_forward = False
        if root_pass is not None:  # (None: no trainable root parameter, the output is returned as it is)
            output = self._attach_root_parameter_grads(root_pass, args, kwargs, output)
        if bound:
            independence.after_training_forward(self, args, kwargs, output)
            self._after_bound_forward(args, kwargs)
        return output

    def _check_unowned_frozen(self) -> None:
        """A parameter frozen at wrapping that no module took as owner (``_plan``) and is trainable now would
        train without per-sample gradients: refuse the forward."""
        for name, param in self._tables.unowned:
            if param.requires_grad:
                raise RuntimeError(
                    f"parameter {name!r} was frozen when the model was wrapped, so no per-sample gradient is computed "
                    f"for it, and it is trainable now. Unfreeze it before wrapping (make_private), or wrap the model "
                    f"again."
                )

    # ------------------------------------------------------------------ the step contract: training/'s calls
    def forget_forward_batch(self) -> None:
        """The bound optimizer released a step: the last forward's batch is spent, so a later backward
        must come from a new forward (``_check_live`` refuses one that reaches the old forward)."""
        set_binding_fields(self, _forward_ticket=None)

    def discard_unflushed_passes(self) -> None:
        """The bound optimizer dropped its open step (``zero_grad`` outside a logical step,
        ``discard_logical_step``): the completed backward passes waiting in ``grad_sample`` are never
        handed to its clipper."""
        set_binding_fields(self, _grad_sample_ticket=None)

    @property
    def has_unflushed_passes(self) -> bool:
        """Whether completed backward passes wait in ``grad_sample`` for ``flush_grad_samples``."""
        return self._grad_sample_ticket is not None

    # ------------------------------------------------------------------ names read by other files
    # Views of the state objects, read-only: the step binding (step_binding.py) and tests read these names.
    @property
    def _check_state(self) -> str:
        return self._usage.phase

    # ------------------------------------------------------------------ utilities
    def _forwarding(self) -> bool:
        return self._flags.in_forward

    @contextlib.contextmanager
    def _forward_replay(self) -> Iterator[None]:
        """Run extra forwards of the wrapped module as if inside this wrapper's forward (the independence
        row check's), then put back the running forward's batch sizes and flags as they were."""
        saved_sizes, saved_in_forward = dataclasses.replace(self._batch_sizes), self._flags.in_forward
        self._flags.in_forward = True
        try:
            yield
        finally:
            self._batch_sizes, self._flags.in_forward = saved_sizes, saved_in_forward

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of the wrapped module's parameters with ``requires_grad``, in ``named_parameters``
        order (names without the ``_module.`` prefix)."""
        return [(n, p) for n, p in self._module.named_parameters() if p.requires_grad]


def _root_parameters_by_tangents(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The root's own parameters, when they take the forward-mode path (``capture.root_parameters``): the root
    has no grad sampler, owns at most ``ROOT_PARAMETER_ELEMENTS`` elements itself, and some descendant owns
    parameters (otherwise the root is one fallback module, as before). Empty otherwise."""
    own = list(module.named_parameters(recurse=False))
    if not own or grad_sampler_for(module) is not None:
        return []
    if sum(p.numel() for _, p in own) > ROOT_PARAMETER_ELEMENTS:
        return []
    if not any(next(m.parameters(recurse=False), None) is not None for m in module.modules() if m is not module):
        return []
    return own


def _check_hooks_mode(grad_sample_mode: str) -> None:
    """``GradSampleModule`` computes per-sample gradients with hooks only: the caller picks fast clipping
    by building ``GhostClippingModule``, never through this class."""
    if grad_sample_mode == "ghost":
        raise ValueError(
            "GradSampleModule(..., grad_sample_mode='ghost') is not supported: fast clipping is its own wrapper. "
            "Build GhostClippingModule(module, clipper=PerSampleGradientClipper(params, max_grad_norm)) "
            "(from privacy_engine import GhostClippingModule), or PrivacyEngine.make_private(grad_sample_mode='ghost')."
        )
    if grad_sample_mode != "hooks":
        raise ValueError(
            f"grad_sample_mode must be 'hooks' for GradSampleModule (fast clipping: GhostClippingModule); "
            f"got {grad_sample_mode!r}"
        )


def _check_wrappable(module: nn.Module, loss_reduction: str, strict: bool) -> None:
    """Refuse, before anything is hooked, what the wrapper cannot serve (warn only for the model's
    problems when ``strict=False``)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"GradSampleModule wraps an nn.Module; got {type(module).__name__}")
    if isinstance(module, GradSampleModule):
        raise ValueError("module is already a GradSampleModule; wrap the original module once")  # noqa: TRY004
    check_loss_reduction(loss_reduction)
    for path, submodule in module.named_modules():
        if submodule in HOOKED_MODULES:
            raise ValueError(
                f"{module_label(path, submodule)} is already hooked by another GradSampleModule; call "
                f"to_standard_module() on that wrapper first"
            )
    problems = find_problems(module)
    if problems and strict:
        raise UnsupportedModuleError("cannot compute per-sample gradients:\n- " + "\n- ".join(problems))
    for problem in problems:
        warnings.warn(f"strict=False: {problem}")
