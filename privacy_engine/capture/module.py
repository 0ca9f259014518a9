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
independence of the examples (``capture.independence``, ``capture.loss_coupling``).
Fast clipping (``privacy_engine.clipping.ghost``) subclasses this wrapper; this module never imports it.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from grad_samplers import grad_sampler_for, register_optional_samplers
from grad_samplers.registry import GradSampler
from privacy_engine.capture.batch_size import BatchSizeTracking
from privacy_engine.capture.common import HOOKED_MODULES, LOSS_REDUCTIONS, ParameterUsageError, WrappedModuleAccess
from privacy_engine.capture.fallback_bridge import FallbackBridge
from privacy_engine.capture.hooks import LayerHooks
from privacy_engine.capture.independence import IndependenceGuard
from privacy_engine.capture.step_binding import StepContractBinding
from privacy_engine.capture.usage_check import UsageCheck
from privacy_engine.integrations.hf_losses import install_per_example_losses
from privacy_engine.models.validation import UnsupportedModuleError, batchnorm_problem, find_problems, module_label
from privacy_engine.training.step_contract import forget_wrapper, register_wrapper

__all__ = ["GradSampleModule", "ParameterUsageError"]


class GradSampleModule(
    UsageCheck, LayerHooks, FallbackBridge, StepContractBinding, BatchSizeTracking, WrappedModuleAccess, nn.Module
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
    sampler returns a wrong shape   ``RuntimeError`` naming the sampler and module
    backward twice on one forward   ``RuntimeError`` (inputs were freed after use)
    empty batch (Poisson sampling)  ``grad_sample`` of shape ``(0, *p.shape)``
    called after unwrapping         ``RuntimeError`` (see ``to_standard_module``)
    ==============================  ==================================================

    Args:
        module: the model. It is not copied; ``to_standard_module()`` gives it back unchanged.
        batch_first: whether the batch is dim 0 (True) or dim 1 (False) of inputs and outputs.
        loss_reduction: ``"mean"`` if the loss averages over the batch (its 1/B is undone),
            ``"sum"`` if it sums.
        grad_sample_mode: only ``"hooks"``. Fast clipping (per-sample norms and the clipped sum inside
            backward, no ``grad_sample``) is another wrapper, built explicitly: ``GhostClippingModule``
            (``"ghost"`` raises ``ValueError`` saying so).
        strict: raise on the wrap-time problems above (True) or only warn (False: the per-sample
            gradients of the offending modules are then not trustworthy).
    """

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
        self._param_names: dict[nn.Parameter, str] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            self._param_names.setdefault(param, name)
        self._batchnorms = [(p, m) for p, m in module.named_modules() if isinstance(m, _BatchNorm)]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._patched: list[nn.Module] = []
        # forward overrides set on an instance before wrapping: put back on unwrapping, not deleted
        self._instance_forwards: dict[nn.Module, object] = {}
        self._released = False
        # The step contract (privacy_engine.training.step_contract), set when a DPOptimizer binds this wrapper:
        # which batch each forward ran on, and per-pass clipping of the per-sample gradients.
        self._consumer = None  # the DPOptimizer whose clipper takes this wrapper's backward passes
        self._generation = 0  # training forwards so far; a backward checks its forward is still live
        self._generation_tickets: dict[int, object] = {}
        self._forward_ticket = None  # the batch of the newest training forward
        self._grad_sample_ticket = None  # the batch whose completed backward passes fill grad_sample
        self._backward_running = False
        self._awaiting_backward = False  # a forward on a drawn batch ran and its backward has not
        self._owner_paths: dict[nn.Parameter, str] = {}
        self._in_forward = False
        self._inside_fallback = False
        self._forward_batch: tuple[str, int] | None = None
        # Broadcast layers (batch 1 in a forward of batch B): see _note_batch_size. Reset per forward
        # by the pre-hook on the wrapped module.
        self._input_batch: int | None = None  # the batch size the wrapper's inputs suggest, if unambiguous
        self._forward_single: str | None = None  # first layer left at batch 1 while no batch was known
        self._forward_broadcast: tuple[str, int] | None = None  # first layer expanded to the batch
        self._reset_usage_check_state()
        self._independence = IndependenceGuard(module, batch_dim=self._batch_dim, strict=strict)
        try:
            for path, layer, sampler in self._plan(module):
                self._attach(path, layer, sampler)
            self._handles.append(module.register_forward_pre_hook(self._note_input_batch, with_kwargs=True))
        except BaseException:
            self._detach()
            raise
        # Hugging Face models called with labels= through this wrapper return per-example losses (issue 18).
        self._hf_losses = install_per_example_losses(module, loss_reduction=loss_reduction, is_active=self._forwarding)
        register_wrapper(self)

    # ------------------------------------------------------------------ wrapping
    @staticmethod
    def _plan(root: nn.Module) -> list[tuple[str, nn.Module, GradSampler | None]]:
        """(path, module, sampler or None for the fallback) for each module owning parameters."""
        register_optional_samplers()  # samplers for layers of libraries imported since (HF Conv1D)
        plan: list[tuple[str, nn.Module, GradSampler | None]] = []

        def visit(path: str, module: nn.Module) -> None:
            owns_parameters = next(module.parameters(recurse=False), None) is not None
            sampler = grad_sampler_for(module)
            if owns_parameters:
                plan.append((path, module, sampler))
                if sampler is None:
                    return  # the fallback differentiates the whole subtree
            for name, child in module.named_children():
                visit(f"{path}.{name}" if path else name, child)

        visit("", root)
        return plan

    def _attach(self, path: str, layer: nn.Module, sampler: GradSampler | None) -> None:
        owned = layer.parameters(recurse=sampler is None)
        for param in owned:
            self._owner_paths.setdefault(param, path)
        if sampler is not None:
            handle = layer.register_forward_hook(partial(self._capture, path, sampler), with_kwargs=True)
            self._handles.append(handle)
        else:
            self._patch_forward(path, layer)
        HOOKED_MODULES.add(layer)

    def _detach(self) -> None:
        for handle in self._handles + self._check_handles:
            handle.remove()
        self._handles, self._check_handles = [], []
        for module in self._patched:
            del module.forward
            if module in self._instance_forwards:
                module.forward = self._instance_forwards.pop(module)
        self._patched = []
        for module in self._module.modules():
            HOOKED_MODULES.discard(module)

    def to_standard_module(self) -> nn.Module:
        """Remove every hook and attribute this wrapper added and return the original module.

        The wrapper is unusable afterwards: calling it raises instead of silently computing nothing.
        """
        self._released = True
        forget_wrapper(self)
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
    def forward(self, *args, **kwargs):
        if self._released:
            raise RuntimeError(
                "this GradSampleModule was unwrapped by to_standard_module(); call the returned module, "
                "or wrap it again for per-sample gradients"
            )
        self._independence.end_loss_monitor()
        for path, batchnorm in self._batchnorms:
            if batchnorm.training and torch.is_grad_enabled() and self.strict:
                raise UnsupportedModuleError(batchnorm_problem(path, batchnorm))
        # Examples must not interact (capture.independence): buffers written, batch statistics, coupled losses.
        # Only a wrapper bound to a private optimizer releases anything; an unbound one is a per-sample
        # gradient tool and keeps its forward count and side effects.
        bound = self._consumer is not None and self.training and torch.is_grad_enabled()
        if bound:
            self._independence.before_training_forward()
        if self._check_state != "done":
            if self.training and torch.is_grad_enabled():
                self._arm_usage_check()
            elif self._check_state == "armed":
                # A training forward that never reached backward must not judge this one, which computes
                # no per-sample gradients by design.
                self._finish_usage_check()
                self._check_state = "pending"
        self._forward_batch = None
        if bound:
            self._before_bound_forward()
        self._in_forward = True
        try:
            output = self._module(*args, **kwargs)
        finally:
            self._in_forward = False
        if bound:
            self._independence.after_training_forward(self, args, kwargs, output)
            self._after_bound_forward(args, kwargs)
        return output

    # ------------------------------------------------------------------ utilities
    def _forwarding(self) -> bool:
        return self._in_forward

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self._module.named_parameters() if p.requires_grad]


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
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}; got {loss_reduction!r}")
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
