"""GradSampleModule: wrap an ``nn.Module`` so that every backward pass also yields exact per-sample
gradients in ``param.grad_sample``.

How it works, per submodule that directly owns parameters:

- a layer with a registered grad sampler (``grad_samplers``) gets a forward hook that keeps its
  (detached) inputs and puts a gradient hook on its output; when the output's gradient arrives the
  sampler turns inputs and output gradient into per-sample gradients, and the inputs are dropped;
- any other module is handed to the ``torch.func`` fallback, which runs its forward under ``vmap``
  with one view of its parameters per example (it claims the module's whole subtree).

Per-sample gradients add up: over several calls of a module in one forward, over modules sharing a
parameter (tied embeddings), and over several backward passes until ``clear_grad_sample()``.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections import OrderedDict
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from grad_samplers import grad_sampler_for, norm_sampler_for, register_optional_samplers
from grad_samplers.functorch_fallback import per_sample_forward, per_sample_forward_for
from grad_samplers.registry import GradSampler
from privacy_engine.step_contract import BatchTicket, forget_wrapper, register_wrapper
from privacy_engine.validation import UnsupportedModuleError, batchnorm_problem, find_problems, module_label

LOSS_REDUCTIONS = ("mean", "sum")

# Every module currently hooked by some GradSampleModule: wrapping one twice would count twice.
_HOOKED_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class ParameterUsageError(RuntimeError):
    """A parameter received gradient that its owning module's per-sample gradients do not explain."""


class GradSampleModule(nn.Module):
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
        grad_sample_mode: ``"hooks"`` materialises ``grad_sample``; ``"ghost"`` returns a
            ``GhostClippingModule`` (fast clipping: per-sample norms and the clipped sum inside
            backward, no ``grad_sample``; see ``privacy_engine.ghost_clipping``).
        strict: raise on the wrap-time problems above (True) or only warn (False: the per-sample
            gradients of the offending modules are then not trustworthy).
    """

    def __new__(cls, *args, grad_sample_mode: str = "hooks", **kwargs):
        # grad_sample_mode="ghost" builds the fast-clipping subclass (privacy_engine.ghost_clipping).
        if grad_sample_mode not in ("hooks", "ghost"):
            raise ValueError(f"grad_sample_mode must be 'hooks' or 'ghost'; got {grad_sample_mode!r}")
        if grad_sample_mode == "ghost" and cls is GradSampleModule:
            from privacy_engine.ghost_clipping import GhostClippingModule

            return super().__new__(GhostClippingModule)
        return super().__new__(cls)

    def __init__(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        grad_sample_mode: str = "hooks",  # dispatched in __new__
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"GradSampleModule wraps an nn.Module; got {type(module).__name__}")
        if isinstance(module, GradSampleModule):
            raise ValueError("module is already a GradSampleModule; wrap the original module once")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}; got {loss_reduction!r}")
        for path, submodule in module.named_modules():
            if submodule in _HOOKED_MODULES:
                raise ValueError(
                    f"{module_label(path)} is already hooked by another GradSampleModule; call "
                    f"to_standard_module() on that wrapper first"
                )
        problems = find_problems(module)
        if problems and strict:
            raise UnsupportedModuleError("cannot compute per-sample gradients:\n- " + "\n- ".join(problems))
        for problem in problems:
            warnings.warn(f"strict=False: {problem}")

        super().__init__()
        self._module = module
        self.batch_first = batch_first
        self.loss_reduction = loss_reduction
        self.strict = strict
        self._batch_dim = 0 if batch_first else 1
        self._param_names: Dict[nn.Parameter, str] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            self._param_names.setdefault(param, name)
        self._batchnorms = [(p, m) for p, m in module.named_modules() if isinstance(m, _BatchNorm)]
        self._handles: List[torch.utils.hooks.RemovableHandle] = []
        self._patched: List[nn.Module] = []
        # forward overrides set on an instance before wrapping: put back on unwrapping, not deleted
        self._instance_forwards: Dict[nn.Module, object] = {}
        self._released = False
        # The step contract (privacy_engine.step_contract), set when a DPOptimizer binds this wrapper:
        # which batch each forward ran on, and per-pass clipping of the per-sample gradients.
        self._consumer = None  # the DPOptimizer whose clipper takes this wrapper's backward passes
        self._generation = 0  # training forwards so far; a backward checks its forward is still live
        self._generation_tickets: Dict[int, object] = {}
        self._forward_ticket = None  # the batch of the newest training forward
        self._grad_sample_ticket = None  # the batch whose completed backward passes fill grad_sample
        self._backward_running = False
        self._awaiting_backward = False  # a forward on a drawn batch ran and its backward has not
        self._owner_paths: Dict[nn.Parameter, str] = {}
        self._in_forward = False
        self._inside_fallback = False
        self._forward_batch: Optional[Tuple[str, int]] = None
        # Broadcast layers (batch 1 in a forward of batch B): see _note_batch_size. Reset per forward
        # by the pre-hook on the wrapped module.
        self._input_batch: Optional[int] = None  # the batch size the wrapper's inputs suggest, if unambiguous
        self._forward_single: Optional[str] = None  # first layer left at batch 1 while no batch was known
        self._forward_broadcast: Optional[Tuple[str, int]] = None  # first layer expanded to the batch
        self._check_state = "pending"  # -> "armed" at the first forward, "done" after the first backward
        self._check_sums: Dict[nn.Parameter, torch.Tensor] = {}
        self._check_magnitudes: Dict[nn.Parameter, float] = {}  # sum_i ||g_i||: the scale of rounding errors
        self._check_term_scales: Dict[nn.Parameter, float] = {}  # ||sum |terms| ||: see _record_term_scales
        self._check_dtypes: Dict[nn.Parameter, torch.dtype] = {}  # least precise dtype of the computation
        self._check_autocast_dtype: Optional[torch.dtype] = None
        self._check_handles: List[torch.utils.hooks.RemovableHandle] = []
        try:
            for path, layer, sampler in self._plan(module):
                self._attach(path, layer, sampler)
            self._handles.append(module.register_forward_pre_hook(self._note_input_batch, with_kwargs=True))
        except BaseException:
            self._detach()
            raise
        register_wrapper(self)

    # ------------------------------------------------------------------ wrapping
    @staticmethod
    def _plan(root: nn.Module) -> List[Tuple[str, nn.Module, Optional[GradSampler]]]:
        """(path, module, sampler or None for the fallback) for each module owning parameters."""
        register_optional_samplers()  # samplers for layers of libraries imported since (HF Conv1D)
        plan: List[Tuple[str, nn.Module, Optional[GradSampler]]] = []

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

    def _attach(self, path: str, layer: nn.Module, sampler: Optional[GradSampler]) -> None:
        owned = layer.parameters(recurse=sampler is None)
        for param in owned:
            self._owner_paths.setdefault(param, path)
        if sampler is not None:
            handle = layer.register_forward_hook(partial(self._capture, path, sampler), with_kwargs=True)
            self._handles.append(handle)
        else:
            self._patch_forward(path, layer)
        _HOOKED_MODULES.add(layer)

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
            _HOOKED_MODULES.discard(module)

    def to_standard_module(self) -> nn.Module:
        """Remove every hook and attribute this wrapper added and return the original module.

        The wrapper is unusable afterwards: calling it raises instead of silently computing nothing.
        """
        self._released = True
        forget_wrapper(self)
        self._consumer = None
        self._detach()
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
        for path, batchnorm in self._batchnorms:
            if batchnorm.training and torch.is_grad_enabled():
                if self.strict:
                    raise UnsupportedModuleError(batchnorm_problem(path, batchnorm))
        if self._check_state != "done":
            if self.training and torch.is_grad_enabled():
                self._arm_usage_check()
            elif self._check_state == "armed":
                # A training forward that never reached backward must not judge this one, which computes
                # no per-sample gradients by design.
                self._finish_usage_check()
                self._check_state = "pending"
        self._forward_batch = None
        bound = self._consumer is not None and self.training and torch.is_grad_enabled()
        if bound:
            self._before_bound_forward()
        self._in_forward = True
        try:
            output = self._module(*args, **kwargs)
        finally:
            self._in_forward = False
        if bound:
            self._after_bound_forward(args, kwargs)
        return output

    # ------------------------------------------------------------------ the step contract
    def bind(self, consumer) -> None:
        """Send each backward pass's per-sample gradients to ``consumer`` (a ``DPOptimizer``): a pass is
        clipped on its own unless the previous pass ran on the same batch (then they are summed per
        example first). ``DPOptimizer`` binds the wrappers of its parameters itself."""
        self._consumer = consumer

    def _before_bound_forward(self) -> None:
        if self._backward_running:
            # The last backward raised part-way: its per-sample gradients are incomplete.
            self._discard_grad_samples()
        self._consumer.sync_private_parameters()
        self._generation += 1

    def _after_bound_forward(self, args, kwargs) -> None:
        contract = self._consumer.contract
        batch_size = self._forward_batch_size()
        if batch_size is None:
            return  # nothing trainable ran (every layer frozen): no per-sample gradients to tie
        previous = self._forward_ticket
        ticket = contract.resolve(args, kwargs, batch_size, join_pending=self._awaiting_backward)
        self._awaiting_backward = ticket.tracked
        self._check_second_pass(ticket)
        if previous is not None and not ticket.same_rows(previous):
            if self._grad_sample_ticket is None and not contract.already_contributed(previous):
                contract.abandon(previous)  # its backward never ran; a later forward may use the batch
            self._generation_tickets = {}
        if self._grad_sample_ticket is not None and not ticket.same_rows(self._grad_sample_ticket):
            self.flush_grad_samples()
        self._generation_tickets[self._generation] = ticket
        self._forward_ticket = ticket
        contract.check_parameters_unchanged(self._consumer.params, where="a forward")

    def _forward_batch_size(self) -> Optional[int]:
        """The batch size the last forward's layers saw (None if no trainable layer ran)."""
        if self._forward_batch is not None:
            return self._forward_batch[1]
        if getattr(self, "_forward_broadcast", None) is not None:
            return self._forward_broadcast[1]
        if getattr(self, "_forward_single", None) is not None:
            return 1
        return None

    def _check_second_pass(self, ticket) -> None:
        """Hooks mode sums a second backward pass over the same examples into the first (see ``_accumulate``)."""

    def _check_live(self, generation: int) -> None:
        """Raise if a backward reaches the forward of a batch that a later forward replaced."""
        if self._consumer is None:
            return
        ticket = self._generation_tickets.get(generation)
        if ticket is None or not ticket.same_rows(self._forward_ticket):
            raise RuntimeError(
                "a backward pass reached the forward of an earlier batch after the model ran on another batch: "
                "the per-sample gradients of two batches would be mixed. Run backward for each forward before "
                "the next batch's forward (or use VirtualSteps for gradient accumulation)."
            )

    def flush_grad_samples(self) -> None:
        """Hand the completed backward passes' per-sample gradients to the bound optimizer's clipper."""
        ticket, self._grad_sample_ticket = self._grad_sample_ticket, None
        if ticket is not None and self._consumer is not None and not self._backward_running:
            self._consumer.accumulate_pass(ticket)

    def _discard_grad_samples(self) -> None:
        self.clear_grad_sample()
        self._grad_sample_ticket = None
        self._backward_running = False

    def _backward_done(self) -> None:
        self._backward_running = False
        self._awaiting_backward = False
        if self._consumer is not None:
            # No wrapper forward since the last step (the inner module was called directly): an untracked
            # batch, which the optimizer refuses to release when it has a private loader.
            self._grad_sample_ticket = self._forward_ticket or BatchTicket(loader_step=None, size=0)

    def _note_input_batch(self, module: nn.Module, args, kwargs) -> None:
        """Forward pre-hook on the wrapped module: start a forward's batch bookkeeping."""
        self._input_batch = _input_batch_size(args, kwargs, self._batch_dim)
        self._forward_single = None
        self._forward_broadcast = None

    def _note_batch_size(self, path: str, batch_size: int) -> Optional[int]:
        """Check a layer's output batch size against the forward's; return the size to expand the
        output to when the layer is a broadcast (None otherwise).

        The forward's batch size B is that of the first layer output whose batch size is not 1, or,
        before any such output, the batch size most of the wrapper's tensor inputs have (no tie).
        A layer output with 1 example while B != 1 is shared by every example (position embeddings
        looked up with ``position_ids`` of shape (1, T), a learned prefix): it is expanded to B so
        that its output gradient arrives per example. Any other difference is an error.
        """
        if not self._in_forward:
            return None
        dim = self._batch_dim
        established = self._forward_batch
        if established is None:
            target = self._input_batch if batch_size == 1 else None
            if target is None or target == 1:
                self._forward_batch = (path, batch_size)
                if batch_size == 1:
                    self._forward_single = path  # batch 1 for now; a later layer may show a larger batch
                return None
            self._forward_batch = self._forward_broadcast = (path, target)
            return target
        if batch_size == established[1]:
            return None
        if batch_size == 1:
            if self._forward_broadcast is None:
                self._forward_broadcast = (path, established[1])
            return established[1]
        if established[0] == self._forward_single:
            raise ValueError(
                f"the batch size differs between layers of one forward: {module_label(established[0])} got 1 "
                f"example (dim {dim}) but {module_label(path)}, later, got {batch_size}. A layer whose output is "
                f"shared by every example (broadcast) can only be separated per example once the batch size is "
                f"known: from an earlier layer, or from the inputs (most tensor inputs of the wrapper having the "
                f"batch size). Pass that layer's input with the batch size (e.g. position_ids of shape "
                f"(batch, seq_len)) or give every input the same batch size (batch_first={self.batch_first})."
            )
        if self._forward_broadcast is not None and established[0] == self._forward_broadcast[0]:
            raise ValueError(
                f"the batch size differs between layers of one forward: {module_label(established[0])} got 1 "
                f"example and was treated as shared by the {established[1]} examples the inputs suggest, but "
                f"{module_label(path)} got {batch_size} examples (dim {dim}). Give the wrapper's inputs the "
                f"batch size of the model (batch_first={self.batch_first})."
            )
        raise ValueError(
            f"the batch size differs between inputs of one forward: {module_label(path)} got "
            f"{batch_size} examples (dim {dim}) but {module_label(established[0])} got "
            f"{established[1]}. Give every input the same batch size (batch_first={self.batch_first})."
        )

    def _check_called_through_wrapper(self, path: str) -> None:
        """A training forward of a hooked layer must come through this wrapper's forward: otherwise the
        model was called directly (a training framework holding the unwrapped model, e.g. a plain HF
        Trainer), and that forward's batch is not the one the private loader drew and accounted for."""
        if not self._in_forward and not self._released:
            if torch._C._current_autograd_node() is not None:
                raise RuntimeError(
                    f"{module_label(path)} ran a forward during a backward pass: activation checkpointing (which "
                    f"recomputes forwards in backward) is not supported with per-sample gradients. Turn it off "
                    f"(Hugging Face: model.gradient_checkpointing_disable())."
                )
            raise RuntimeError(
                f"{module_label(path)} ran a training forward (training mode, gradients on) without going through "
                f"its {type(self).__name__}: the wrapped model was called directly. Call the wrapper make_private "
                f"returned (with Hugging Face Trainer, use privacy_engine.integrations.hf_trainer.DPTrainer, which "
                f"also draws the batches the accountant records), or call model.eval() / torch.no_grad() for "
                f"forwards that are not training steps."
            )

    def _broadcast_activations(self, path: str, layer: nn.Module, args: tuple, batch_size: int) -> tuple:
        """A broadcast layer's inputs with their batch dimension of 1 expanded to ``batch_size`` (views):
        every example saw the same input."""
        dim = self._batch_dim
        if isinstance(layer, nn.EmbeddingBag) and isinstance(args[0], torch.Tensor) and args[0].dim() == 1:
            raise ValueError(
                f"{module_label(path)} (EmbeddingBag with 1-D input and offsets) returned 1 bag in a forward of "
                f"{batch_size} examples; a bag shared by every example needs 2-D input (1, bag_size)"
            )
        return tuple(
            _expand_batch(a, dim, batch_size) if isinstance(a, torch.Tensor) and a.dim() > dim and a.shape[dim] == 1 else a
            for a in args
        )

    def _capture(self, path: str, sampler: GradSampler, layer: nn.Module, args, kwargs, output):
        # The wrapper's mode decides, not the layer's: a layer kept in eval mode while the model trains
        # (BatchNorm with frozen statistics, trainable affine) still needs its per-sample gradients.
        if not (self.training and torch.is_grad_enabled()):
            return None
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return None
        if not any(p.requires_grad for p in layer.parameters(recurse=False)):
            return None
        self._check_called_through_wrapper(path)
        broadcast_to = self._note_batch_size(path, output.shape[self._batch_dim])
        if kwargs:
            bound = inspect.signature(layer.forward).bind(*args, **kwargs)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        held = [tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)]
        if broadcast_to is not None:
            held[0] = self._broadcast_activations(path, layer, held[0], broadcast_to)

        generation = self._generation

        def on_output_grad(backprops: torch.Tensor) -> None:
            self._check_live(generation)
            activations = held[0]
            if activations is None:
                raise RuntimeError(
                    f"{module_label(path)}: a second backward pass ran through the same forward "
                    f"(retain_graph=True). Its inputs were freed after the first; run a new forward "
                    f"for each backward."
                )
            held[0] = None  # free the inputs as soon as their backward has run
            if self._check_state == "armed":
                self._record_term_scales(layer, activations, backprops)
            self._layer_backward(path, layer, sampler, activations, backprops)

        if broadcast_to is not None:
            # Shared by every example: handed on expanded (a view, no copy) so that each example's
            # output gradient arrives separately. An expanded tensor cannot be modified in place, so
            # the hook on it cannot be lost.
            output = _expand_batch(output, self._batch_dim, broadcast_to)
            output.register_hook(on_output_grad)
            return output
        hooked, reshape_to = output, None
        if output._base is not None:
            # A hook on a view is lost if the view is later modified in place (ReLU(inplace=True)
            # after a Linear on 3-D input): hook its base instead when the view is a plain reshape,
            # otherwise hand back a copy that owns its storage.
            base = output._base
            if base.numel() == output.numel() and base.is_contiguous() and output.is_contiguous():
                hooked, reshape_to = base, output.shape
            else:
                output = hooked = output.clone()
        if reshape_to is None:
            hooked.register_hook(on_output_grad)
        else:
            hooked.register_hook(lambda grad: on_output_grad(grad.view(reshape_to)))
        return output

    def _patch_forward(self, path: str, module: nn.Module) -> None:
        original = module.forward
        if "forward" in module.__dict__:
            self._instance_forwards[module] = module.__dict__["forward"]
        named_params = list(module.named_parameters())

        def forward(*args, **kwargs):
            if self._inside_fallback or not (self.training and torch.is_grad_enabled()):
                return original(*args, **kwargs)
            params = {name: p for name, p in named_params if p.requires_grad}
            if not params:
                return original(*args, **kwargs)
            try:
                return self._fallback_call(path, module, original, args, kwargs, params)
            except RuntimeError as error:
                if _is_function_without_vmap(error):
                    raise UnsupportedModuleError(_function_without_vmap_message(path, module, error)) from error
                raise

        module.forward = forward
        self._patched.append(module)

    def _fallback_call(self, path: str, module: nn.Module, original, args, kwargs, params: Dict[str, nn.Parameter]):
        """One training-mode call of a fallback module: its real forward under ``vmap``, with
        per-sample gradients delivered to ``_fallback_backward`` during backward."""
        self._inside_fallback = True
        try:
            output = per_sample_forward(
                module,
                original,
                args,
                kwargs,
                params=params,
                batch_dim=self._batch_dim,
                module_path=path,
                on_per_sample_grad=partial(self._fallback_backward_of, self._generation),
            )
        finally:
            self._inside_fallback = False
        self._note_output_batch_size(path, module, output)
        return output

    def _note_output_batch_size(self, path: str, module: nn.Module, output) -> None:
        own = per_sample_forward_for(module)
        if own is not None:
            # A layer with its own per-sample forward says where its examples are (a PackedSequence's
            # examples are its sequences, not the rows of its data).
            batch_size = own.output_batch_size(module, output)
            if batch_size is not None:
                self._note_batch_size(path, batch_size)
            return
        first = next((t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)), None)
        if first is None:
            return
        # An attention module has its own layout (a sequence-first attention may sit in a batch-first
        # model); its first output is laid out like its query.
        output_batch_dim = self._batch_dim
        if type(module) is nn.MultiheadAttention:
            output_batch_dim = 0 if module.batch_first else 1
        if self._note_batch_size(path, first.shape[output_batch_dim]) is not None:
            # Its per-sample gradients were taken over its own single example; they cannot be split
            # after the fact (only layers with a grad sampler are expanded to the batch).
            raise ValueError(
                f"{module_label(path)} ({type(module).__name__}, per-sample gradients through torch.func) got 1 "
                f"example in a forward of {self._forward_batch[1]}: its output is shared by every example. Give "
                f"its input the batch size (expand it to the batch before calling the module)."
            )

    # ------------------------------------------------------------------ backward
    def _layer_backward(self, path: str, layer: nn.Module, sampler: GradSampler, activations, backprops) -> None:
        if self._batch_dim != 0:
            backprops = backprops.movedim(self._batch_dim, 0)
            activations = tuple(
                a.movedim(self._batch_dim, 0) if isinstance(a, torch.Tensor) and a.dim() > self._batch_dim else a
                for a in activations
            )
        batch_size = backprops.shape[0]
        if self.loss_reduction == "mean":
            backprops = backprops * batch_size
        if batch_size == 0:
            # Poisson sampling can draw an empty batch; samplers need not handle that case themselves.
            per_sample = {
                param: torch.zeros((0, *param.shape), dtype=param.dtype, device=param.device)
                for param in layer.parameters(recurse=False)
                if param.requires_grad
            }
        else:
            per_sample = sampler(layer, activations, backprops)
        for param, grads in per_sample.items():
            expected = (batch_size, *param.shape)
            if tuple(grads.shape) != expected:
                raise RuntimeError(
                    f"grad sampler {getattr(sampler, '__qualname__', sampler)!r} for {module_label(path)} "
                    f"({type(layer).__name__}) returned shape {tuple(grads.shape)} for parameter "
                    f"{self._param_names.get(param, '?')!r}; expected {expected} (batch, *param.shape)"
                )
            self._accumulate(param, grads, batch_size)

    def _fallback_backward_of(self, generation: int, param: nn.Parameter, grads: torch.Tensor) -> None:
        self._check_live(generation)
        self._fallback_backward(param, grads)

    def _fallback_backward(self, param: nn.Parameter, grads: torch.Tensor) -> None:
        batch_size = grads.shape[0]
        if self.loss_reduction == "mean":
            grads = grads * batch_size
        self._accumulate(param, grads, batch_size)

    def _accumulate(self, param: nn.Parameter, grads: torch.Tensor, batch_size: int) -> None:
        if self._check_state == "armed":
            self._record_for_usage_check(param, grads, batch_size)
        if self._consumer is not None and not self._backward_running:
            self._backward_running = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        existing = getattr(param, "grad_sample", None)
        if existing is not None and existing.shape[0] != grads.shape[0]:
            # Row i of each must be the same example for a per-example sum; never broadcast.
            raise RuntimeError(
                f"parameter {self._param_names.get(param, '?')!r} holds per-sample gradients of {existing.shape[0]} "
                f"examples from an earlier backward pass, and this pass has {grads.shape[0]}: they are different "
                f"examples and cannot be added row by row. Call optimizer.step() (or clip_and_accumulate()) "
                f"between batches, or use VirtualSteps for gradient accumulation."
            )
        # Out of place: `grads` may alias the autograd buffer still in use by this backward.
        param.grad_sample = grads if existing is None else existing + grads

    # ------------------------------------------------------------------ first-backward check
    def _arm_usage_check(self) -> None:
        """Hook every trainable parameter so the first backward can verify sum_i grad_sample[i] == grad."""
        for handle in self._check_handles:
            handle.remove()
        trainable = [p for p in self._owner_paths if p.requires_grad]
        self._check_sums, self._check_magnitudes = {}, {}
        self._check_term_scales, self._check_dtypes = {}, {}
        # Ops under autocast ran in its dtype (bf16/fp16): the check's tolerance must follow it.
        self._check_autocast_dtype = _autocast_dtype()
        # A hook on the leaf sees exactly the gradient this backward delivers. Diffing .grad against a
        # snapshot taken at forward time would break when gradients are zeroed between forward and
        # backward (optimizer.zero_grad() just before loss.backward()), and would copy every gradient.
        self._check_handles = [param.register_hook(partial(self._verify_parameter, param)) for param in trainable]
        self._check_state = "armed"

    def _record_for_usage_check(self, param: nn.Parameter, grads: torch.Tensor, batch_size: int) -> None:
        if not self._check_sums:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_usage_check)
        grads = grads.detach()
        self._note_check_dtype(param, grads.dtype)
        # Summed in float32 at least: a half-precision sum would add its own rounding to the comparison.
        total = grads.sum(0, dtype=_at_least_float32(grads.dtype))
        if self.loss_reduction == "mean":
            total = total / batch_size
        previous = self._check_sums.get(param)
        self._check_sums[param] = total if previous is None else previous + total
        # reshape, not flatten(1): a 0-dim parameter's per-sample gradients are 1-D.
        per_example = grads.reshape(grads.shape[0], param.numel())
        magnitude = float(torch.linalg.vector_norm(per_example, dim=1, dtype=_at_least_float32(grads.dtype)).sum())
        if self.loss_reduction == "mean":
            magnitude /= max(batch_size, 1)
        self._check_magnitudes[param] = self._check_magnitudes.get(param, 0.0) + magnitude

    def _note_check_dtype(self, param: nn.Parameter, dtype: torch.dtype) -> None:
        """Keep the least precise floating dtype a parameter's per-sample computation went through."""
        if not dtype.is_floating_point:
            return
        previous = self._check_dtypes.get(param)
        if previous is None or torch.finfo(dtype).eps > torch.finfo(previous).eps:
            self._check_dtypes[param] = dtype

    def _record_term_scales(self, layer: nn.Module, activations: tuple, backprops: torch.Tensor) -> None:
        """For the first-backward check: the size of the terms each per-sample gradient sums.

        A per-sample gradient sums products of output gradients and inputs over positions; when they
        cancel (a conv bias followed by InstanceNorm: the normalisation removes every per-channel
        shift, so the exact gradient is 0), the computed sum is pure rounding, of the order of
        ``eps * sum |terms|``, however small the sum itself. The same sampler evaluated on ``|inputs|``
        and ``|output gradient|`` gives ``sum |terms|`` (exactly for linear maps, convolutions and
        embeddings; in order of magnitude for normalisation layers), through its norm sampler (layers with
        none, e.g. plugins' with only a grad sampler, get no term scale: their sampler is not run twice).
        """
        if self._batch_dim != 0:
            backprops = backprops.movedim(self._batch_dim, 0)
            activations = tuple(
                a.movedim(self._batch_dim, 0) if isinstance(a, torch.Tensor) and a.dim() > self._batch_dim else a
                for a in activations
            )
        if backprops.shape[0] == 0:
            return
        floating = [a for a in activations if isinstance(a, torch.Tensor) and a.is_floating_point()]
        trainable = [p for p in layer.parameters(recurse=False) if p.requires_grad]
        for param in trainable:
            for tensor in (backprops, *floating):
                self._note_check_dtype(param, tensor.dtype)
        norm_sampler = norm_sampler_for(layer)
        if norm_sampler is None:
            return  # only the cheap norm form is used (a layer without one keeps the strict check)
        absolute = tuple(a.abs() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in activations)
        with torch.no_grad():
            try:
                scales = {
                    p: squared.to(_at_least_float32(squared.dtype)).clamp(min=0).sqrt()
                    for p, squared in norm_sampler(layer, absolute, backprops.abs()).items()
                }
            except Exception:  # noqa: BLE001  (a sampler that rejects these values: no term scale, the check stays strict)
                return
        for param, per_example in scales.items():
            self._check_term_scales[param] = self._check_term_scales.get(param, 0.0) + float(per_example.sum())

    def _verify_parameter(self, param: nn.Parameter, received: torch.Tensor) -> None:
        if self._check_state != "armed":
            return
        name = self._param_names.get(param, "?")
        owner = module_label(self._owner_paths.get(param, "?"))
        received = received.detach()
        explained = self._check_sums.get(param)
        if explained is None:
            self._check_state = "done"
            raise ParameterUsageError(
                f"parameter {name!r} received a gradient but its owner {owner} produced no per-sample "
                f"gradient: it is used outside the forward of the module that owns it. Call the owning "
                f"module instead of reading its parameter directly (or move the computation into a "
                f"module that owns the parameter)."
            )
        # The least precise dtype the gradient went through: the parameter's, its per-sample
        # computation's, or autocast's (bf16/fp16 autocast computes in half precision what a float32
        # parameter receives).
        dtypes = [received.dtype, self._check_dtypes.get(param, received.dtype)]
        if self._check_autocast_dtype is not None:
            dtypes.append(self._check_autocast_dtype)
        eps = max(torch.finfo(d).eps if d.is_floating_point else 0.0 for d in dtypes)
        # Relative to the per-sample magnitudes, not only to the result: when examples' gradients
        # cancel, the rounding of their sum is far larger than the (near-zero) sum itself. 1e-3 is far
        # above float32 rounding and far below what a second use of a parameter adds; half precision
        # rounds each product to 2^-8 (bf16), so its bound grows with eps.
        tolerance = max(1e-3, 4 * eps)
        # Plus the rounding of sums that cancel within an example (see _record_term_scales): at most a
        # few units of rounding (log2 of the number of terms, for float32 blocked sums) of sum |terms|.
        term_tolerance = max(32 * torch.finfo(torch.float32).eps, 2 * eps)
        scale = max(float(received.norm()), float(explained.norm()), self._check_magnitudes.get(param, 0.0))
        term_scale = self._check_term_scales.get(param, 0.0)  # from the unscaled output gradients: as received
        difference = float(torch.linalg.vector_norm(received - explained.to(received.dtype), dtype=_at_least_float32(received.dtype)))
        if difference > tolerance * scale + term_tolerance * term_scale + 1e-12:
            self._check_state = "done"
            raise ParameterUsageError(
                f"parameter {name!r}: its gradient is not the sum of its per-sample gradients computed in "
                f"{owner}: it is also used outside the forward of that module. Route every use through "
                f"the owning module."
            )

    def _finish_usage_check(self) -> None:
        for handle in self._check_handles:
            handle.remove()
        self._check_handles = []
        self._check_sums, self._check_magnitudes = {}, {}
        self._check_term_scales, self._check_dtypes = {}, {}
        if self._check_state == "armed":
            self._check_state = "done"

    # ------------------------------------------------------------------ utilities
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

    def trainable_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self._module.named_parameters() if p.requires_grad]


def _input_batch_size(args: tuple, kwargs: dict, batch_dim: int) -> Optional[int]:
    """The size at ``batch_dim`` that most tensor inputs of 2 or more dims have; None on a tie or none.

    1-D tensors do not vote: their one dim is as often a list of things (EmbeddingBag indices and offsets,
    lengths) as a batch. A tie is left undecided on purpose: ``(mask of shape (T, T), x of shape (1, T, E))``
    and ``(input_ids (B, T), position_ids (1, T))`` look alike, and guessing wrong would copy one example
    T times. Layers' outputs decide then (see ``GradSampleModule._note_batch_size``). (With a private
    loader, a forward whose batch exceeds the drawn batch is refused by the step contract as well.)
    """
    counts: Dict[int, int] = {}
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.dim() > batch_dim:
            counts[leaf.shape[batch_dim]] = counts.get(leaf.shape[batch_dim], 0) + 1
    if not counts:
        return None
    ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return None
    return ranked[0][0]


def _is_function_without_vmap(error: RuntimeError) -> bool:
    """torch's errors for a custom ``autograd.Function`` that ``vmap`` cannot run."""
    message = str(error)
    return ("autograd.Function" in message and "setup_context" in message) or "does not have vmap support" in message


def _function_without_vmap_message(path: str, module: nn.Module, error: RuntimeError) -> str:
    kind = type(module).__name__
    return (
        f"{module_label(path)} ({kind}) has no grad sampler, so its per-sample gradients come from torch.func "
        f"(its forward under vmap), and its forward calls a custom torch.autograd.Function that vmap cannot "
        f"run ({error}). Either give that Function vmap support: a forward without ctx plus a setup_context "
        f"staticmethod, and generate_vmap_rule = True or a vmap staticmethod "
        f"(https://pytorch.org/docs/stable/notes/extending.func.html); or register a grad sampler for {kind} "
        f"(grad_samplers.register_grad_sampler({kind}))."
    )


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def _autocast_dtype() -> Optional[torch.dtype]:
    """The dtype autocast computes in right now (the least precise of the enabled devices), or None."""
    found = None
    for device_type in ("cpu", "cuda", "xpu", "mps"):
        try:
            enabled = torch.is_autocast_enabled(device_type)
        except (TypeError, RuntimeError):  # older torch: no per-device query, or an unknown device type
            continue
        if enabled:
            dtype = torch.get_autocast_dtype(device_type)
            if found is None or torch.finfo(dtype).eps > torch.finfo(found).eps:
                found = dtype
    return found


def _expand_batch(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = size
    return tensor.expand(shape)


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


def per_sample_gradients(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Name -> ``grad_sample`` for every parameter that has one (a convenience for inspection)."""
    return {n: p.grad_sample for n, p in model.named_parameters() if getattr(p, "grad_sample", None) is not None}


__all__ = ["GradSampleModule", "ParameterUsageError", "per_sample_gradients", "LOSS_REDUCTIONS"]
