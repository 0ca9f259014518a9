"""The bridge to the ``torch.func`` fallback: a module owning parameters that no grad sampler covers has
its forward replaced by one that runs the real forward under ``vmap``, with one view of its parameters
per example (``grad_samplers.functorch_fallback``); its per-sample gradients arrive during backward and
are added like the hooks' ones. The replacement claims the module's whole subtree.

``FallbackBridge`` is a mixin of ``GradSampleModule``; ``GhostClippingModule`` overrides
``_fallback_call`` (stand-in parameters, so that ``.grad`` is never written). It writes
``_flags.inside_fallback`` (around the ``vmap`` forward) and the patched modules in ``_tables``
(``patched``, ``instance_forwards``); it reads the module's batch dim (``_layer_dim``), ``loss_reduction``, ``_generation`` and
``_batch_sizes``, and hands per-sample gradients to ``_accumulate`` (``hooks.py``). Under activation
checkpointing (``capture.recompute``, ``_recompute_kind``) a reentrant recomputation runs the fallback as a
forward (after ``_prepare_recompute_pass``), a non-reentrant one reruns it and keeps nothing.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from grad_samplers.functorch_fallback import per_sample_forward, per_sample_forward_for
from privacy_engine.capture.patched_forward import PatchedForward
from privacy_engine.capture.recompute import NON_REENTRANT, REENTRANT
from privacy_engine.models.validation import UnsupportedModuleError, module_label

__all__ = ["FallbackBridge"]


class FallbackBridge:
    """Mixin: per-sample gradients of modules without a grad sampler, through ``torch.func``."""

    def _patch_forward(self, path: str, module: nn.Module) -> None:
        if "forward" in module.__dict__:
            self._tables.instance_forwards[module] = module.__dict__["forward"]
        # A PatchedForward, not a closure: the wrapped model stays picklable (torch.save).
        module.forward = PatchedForward(self._fallback_forward, path, module, module.forward)
        self._tables.patched.append(module)

    def _fallback_forward(self, patched: PatchedForward, args: tuple, kwargs: dict):
        """The forward of a fallback module (``patched.module``): under ``vmap`` in training mode."""
        path, module, original = patched.path, patched.module, patched.original
        if self._flags.inside_fallback or not (self.training and torch.is_grad_enabled()):
            output = original(*args, **kwargs)
            if self.training and not self._flags.inside_fallback:
                first = next((t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)), None)
                self._note_batch_without_grad(first, path)
            return output
        if patched.derived is None:
            patched.derived = list(module.named_parameters())
        params = {name: p for name, p in patched.derived if p.requires_grad}
        if not params:
            return original(*args, **kwargs)
        recompute = self._recompute_kind()
        try:
            if recompute == NON_REENTRANT:
                # The same forward as the first one (the checkpoint checks what it saves), nothing kept:
                # backward runs through the first forward's graph (capture.recompute).
                return self._run_fallback(path, module, original, args, kwargs, params, _discard_per_sample_grad)
            if recompute == REENTRANT:
                self._prepare_recompute_pass()
            return self._fallback_call(path, module, original, args, kwargs, params)
        except RuntimeError as error:
            if _is_function_without_vmap(error):
                raise UnsupportedModuleError(_function_without_vmap_message(path, module, error)) from error
            raise

    def _fallback_call(self, path: str, module: nn.Module, original, args, kwargs, params: dict[str, nn.Parameter]):
        """One training-mode call of a fallback module: its real forward under ``vmap``, with
        per-sample gradients delivered to ``_fallback_backward`` during backward."""
        on_per_sample_grad = partial(self._fallback_backward_of, self._generation)
        return self._run_fallback(path, module, original, args, kwargs, params, on_per_sample_grad)

    def _run_fallback(self, path: str, module: nn.Module, original, args, kwargs, params: dict, on_per_sample_grad):
        """``module``'s real forward under ``vmap`` with ``params`` (one view per example), handing each
        parameter's per-sample gradients to ``on_per_sample_grad(param, grads)`` during backward."""
        self._flags.inside_fallback = True
        try:
            output = per_sample_forward(
                module,
                original,
                args,
                kwargs,
                params=params,
                batch_dim=self._layer_dim(path),
                module_path=path,
                on_per_sample_grad=on_per_sample_grad,
            )
        finally:
            self._flags.inside_fallback = False
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
        output_batch_dim = self._layer_dim(path)
        if type(module) is nn.MultiheadAttention:
            output_batch_dim = 0 if module.batch_first else 1
        if self._note_batch_size(path, first.shape[output_batch_dim]) is not None:
            # Its per-sample gradients were taken over its own single example; they cannot be split
            # after the fact (only layers with a grad sampler are expanded to the batch).
            raise ValueError(
                f"{module_label(path)} ({type(module).__name__}, per-sample gradients through torch.func) got 1 "
                f"example in a forward of {self._batch_sizes.forward_batch[1]}: its output is shared by every "
                f"example. Give its input the batch size (expand it to the batch before calling the module)."
            )

    def _fallback_backward_of(self, generation: int, param: nn.Parameter, grads: torch.Tensor) -> None:
        self._check_live(generation)
        self._fallback_backward(param, grads)

    def _fallback_backward(self, param: nn.Parameter, grads: torch.Tensor) -> None:
        batch_size = grads.shape[0]
        if self.loss_reduction == "mean":
            grads = grads * batch_size
        self._accumulate(param, grads, batch_size)


def _discard_per_sample_grad(param: nn.Parameter, grads: torch.Tensor) -> None:
    """The per-sample gradient callback of a replayed forward, whose graph is never differentiated."""


def _is_function_without_vmap(error: RuntimeError) -> bool:
    """torch's errors for a custom ``autograd.Function`` that ``vmap`` cannot run."""
    message = str(error)
    return ("autograd.Function" in message and "setup_context" in message) or "does not have vmap support" in message


def _function_without_vmap_message(path: str, module: nn.Module, error: RuntimeError) -> str:
    kind = type(module).__name__
    return (
        f"{module_label(path, module)} has no grad sampler, so its per-sample gradients come from torch.func "
        f"(its forward under vmap), and its forward calls a custom torch.autograd.Function that vmap cannot "
        f"run ({error}). Either give that Function vmap support: a forward without ctx plus a setup_context "
        f"staticmethod, and generate_vmap_rule = True or a vmap staticmethod "
        f"(https://pytorch.org/docs/stable/notes/extending.func.html); or register a grad sampler for {kind} "
        f"(grad_samplers.register_grad_sampler({kind}))."
    )
