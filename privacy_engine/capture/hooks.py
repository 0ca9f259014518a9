"""The hooks of the materialising path: a forward hook on each layer with a registered grad sampler keeps
its (detached) inputs and puts a gradient hook on its output; when the output gradient arrives, the
sampler turns inputs and output gradient into per-sample gradients, which are added to
``param.grad_sample`` and the inputs dropped.

``LayerHooks`` is a mixin of ``GradSampleModule``. It reads each layer's batch dim (``_layer_dim``), ``loss_reduction``,
``_tables.param_names`` (error messages) and ``_usage.phase``; it feeds the usage check while armed
(``_record_term_scales``, ``_record_for_usage_check``), the batch-size bookkeeping (``_note_batch_size``)
and the step binding (reads ``_generation`` and ``_consumer``, calls ``_check_live``; when bound, sets
``_backward_running`` and queues ``_backward_done`` at the first per-sample gradient of a backward, or
earlier, at a reentrant checkpoint's recomputed forward: ``_prepare_recompute_pass``); it writes
``param.grad_sample``. Under activation checkpointing (``capture.recompute``) a reentrant recomputation is
captured like a forward, a non-reentrant one replayed (same output, nothing captured).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from grad_samplers.registry import GradSampler
from privacy_engine.capture.batch_size import expand_batch
from privacy_engine.capture.recompute import NON_REENTRANT, REENTRANT
from privacy_engine.models.validation import module_label

__all__ = ["LayerHooks"]


class LayerHooks:
    """Mixin: capture a layer's inputs in forward, form its per-sample gradients in backward."""

    def _capture(self, path: str, sampler: GradSampler, layer: nn.Module, args, kwargs, output):
        # The wrapper's mode decides, not the layer's: a layer kept in eval mode while the model trains
        # (BatchNorm with frozen statistics, trainable affine) still needs its per-sample gradients.
        if not (self.training and torch.is_grad_enabled()):
            if self.training:
                self._note_batch_without_grad(output, path)
            return None
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return None
        if not any(p.requires_grad for p in layer.parameters(recurse=False)):
            return None
        recompute = self._check_called_through_wrapper(path)
        dim = self._layer_dim(path)
        broadcast_to = self._note_batch_size(path, output.shape[dim])
        if recompute == NON_REENTRANT:
            # Backward runs through the first forward's graph and hooks: hand back the same output,
            # capture nothing (capture.recompute).
            return self._replayed_output(output, broadcast_to, dim)
        if recompute == REENTRANT:
            self._prepare_recompute_pass()
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
                    f"{module_label(path, layer)}: a second backward pass ran through the same forward "
                    f"(retain_graph=True). Its inputs were freed after the first; run a new forward "
                    f"for each backward."
                )
            held[0] = None  # free the inputs as soon as their backward has run
            backprops, activations = self._batch_first(backprops, activations, dim)
            if self._usage.phase == "armed":
                self._record_term_scales(layer, activations, backprops)
            self._layer_backward(path, layer, sampler, activations, backprops)

        if broadcast_to is not None:
            # Shared by every example: handed on expanded (a view, no copy) so that each example's
            # output gradient arrives separately. An expanded tensor cannot be modified in place, so
            # the hook on it cannot be lost.
            output = expand_batch(output, dim, broadcast_to)
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

    def _replayed_output(self, output: torch.Tensor, broadcast_to: int | None, dim: int) -> torch.Tensor | None:
        """What ``_capture`` hands back for ``output``, without capturing anything: a non-reentrant
        checkpoint's recomputation must save the same tensors as its first forward (torch checks their
        shapes), so the output is expanded or copied exactly as ``_capture`` did then."""
        if broadcast_to is not None:
            return expand_batch(output, dim, broadcast_to)
        base = output._base
        if base is not None and not (base.numel() == output.numel() and base.is_contiguous() and output.is_contiguous()):
            return output.clone()
        return None

    def _prepare_recompute_pass(self) -> None:
        """A reentrant checkpoint is recomputing a forward (``capture.recompute``): its per-sample gradients
        arrive in a nested backward, whose queued callbacks would run at the nested backward's end. Queue
        this backward's end-of-pass callbacks now, on the outer backward (the recomputed forward runs in it),
        so that they run once, when the whole backward is over."""
        if self._consumer is not None and not self._backward_running:
            self._backward_running = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if self._usage.phase == "armed":
            self._queue_usage_check_end()

    def _layer_backward(self, path: str, layer: nn.Module, sampler: GradSampler, activations, backprops) -> None:
        # activations and backprops batch-first (``_batch_first``)
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
                    f"grad sampler {getattr(sampler, '__qualname__', sampler)!r} for {module_label(path, layer)} "
                    f"returned shape {tuple(grads.shape)} for parameter "
                    f"{self._tables.param_names.get(param, '?')!r}; expected {expected} (batch, *param.shape)"
                )
            self._accumulate(param, grads, batch_size)

    def _accumulate(self, param: nn.Parameter, grads: torch.Tensor, batch_size: int) -> None:
        if self._usage.phase == "armed":
            self._record_for_usage_check(param, grads, batch_size)
        if self._consumer is not None and not self._backward_running:
            self._backward_running = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        existing = getattr(param, "grad_sample", None)
        if existing is not None and existing.shape[0] != grads.shape[0]:
            # Row i of each must be the same example for a per-example sum; never broadcast.
            raise RuntimeError(
                f"parameter {self._tables.param_names.get(param, '?')!r} holds per-sample gradients of {existing.shape[0]} "
                f"examples from an earlier backward pass, and this pass has {grads.shape[0]}: they are different "
                f"examples and cannot be added row by row. Call optimizer.step() (or clip_and_accumulate()) "
                f"between batches, or use VirtualSteps for gradient accumulation."
            )
        # Out of place: `grads` may alias the autograd buffer still in use by this backward.
        param.grad_sample = grads if existing is None else existing + grads
