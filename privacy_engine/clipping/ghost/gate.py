"""The gate of fast clipping: a layer with a registered sampler runs its forward with *detached*
parameters, and its output goes through ``_OutputGate``, which returns it unchanged and takes the
parameters as inputs. In backward the gate hands the output gradient ``G`` to the wrapper
(``GhostClippingModule._on_output_grad``) and returns nothing for the parameters: the graph still
reaches earlier layers through the input, but the ordinary weight-gradient product is never computed.

``GatedLayers`` is a mixin of ``GhostClippingModule``. Its forwards read ``_flags.inside_fallback``,
each layer's batch dim (``_layer_dim``) and ``_generation``, feed the batch-size bookkeeping, and add each gated call to
``_passes.pending`` (not a non-reentrant checkpoint's recomputed call: backward runs through the first
forward's gate, ``capture.recompute``); it keeps no state of its own.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from grad_samplers import norm_sampler_for, weighted_sum_sampler_for
from grad_samplers.linear import linear_norm_sample, linear_weighted_sum
from grad_samplers.registry import GradSampler
from privacy_engine.capture.batch_size import expand_batch
from privacy_engine.capture.patched_forward import PatchedForward
from privacy_engine.capture.recompute import NON_REENTRANT, REENTRANT
from privacy_engine.clipping.ghost.uses import Use, in_float32
from privacy_engine.clipping.per_user import stacks_users
from privacy_engine.models.validation import module_label

__all__ = ["GatedLayers"]

# Layer types whose forward output is saved by no autograd node of their own, so the gate may hand the
# output back as is (``mark_dirty``) instead of copying it. Marking an output dirty bumps its version:
# for a layer whose last operation saves its result (tanh, softmax) backward would then fail.
_OUTPUT_NOT_SAVED = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Embedding,
    nn.EmbeddingBag,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)


class _OutputGate(torch.autograd.Function):
    """Identity on ``output``; in backward, hands the output gradient to ``wrapper._on_output_grad(use, G)``
    and gives the parameters none.

    The parameters are inputs so that the graph contains this node even when the layer's input needs no
    gradient (the first layer), and so that ``backward(inputs=[param])`` reaches it. The wrapper and its
    call travel as two inputs, not as a ``partial`` built per call.
    """

    @staticmethod
    def forward(ctx, wrapper, use, in_place, output, *params):
        ctx.wrapper = wrapper
        ctx.use = use
        ctx.nones = (None,) * len(params)
        if in_place:
            # Same tensor, new history: later in-place ops on it (ReLU(inplace=True)) stay legal,
            # which they are not on a view returned by a custom Function.
            ctx.mark_dirty(output)
            return output
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.wrapper._on_output_grad(ctx.use, grad)
        return (None, None, None, grad, *ctx.nones)


# ``Function.apply``'s own Python (binding default arguments, functorch's unwrapping of dead wrappers) costs a few
# microseconds per gated call. Outside functorch transforms ``_apply_gate`` calls the C entry point it ends in,
# after the same unwrapping; inside them (or on a torch without that entry point), ``Function.apply`` itself.
try:
    _apply_directly = torch._C._FunctionBase.__dict__["apply"].__get__(None, _OutputGate)
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
except (AttributeError, KeyError):  # pragma: no cover (torch internals moved)
    _apply_directly = _unwrap_if_dead = None


def _apply_gate(wrapper, use: Use, in_place: bool, output: torch.Tensor, params: list) -> torch.Tensor:
    """``output`` through ``_OutputGate`` (``params``: the layer's trainable parameters, inputs of the gate).

    The parameters are inputs of every gate, also where the layer's input needs a gradient (which alone would put
    the gate in the graph): ``loss.backward(inputs=[a later layer's weight])`` then reaches that layer's gate and
    clips what it reaches, as hooks mode does, instead of releasing nothing for it. Measured cost: ~7 us per layer
    and step (backward visits each parameter's ``AccumulateGrad`` with no gradient)."""
    if _apply_directly is None or torch._C._are_functorch_transforms_active():
        return _OutputGate.apply(wrapper, use, in_place, output, *params)
    return _apply_directly(wrapper, use, in_place, _unwrap_if_dead(output), *map(_unwrap_if_dead, params))


def _is_among(value: torch.Tensor, args: tuple) -> bool:
    """Whether ``value`` is one of ``args`` (identity; a loop, not ``any`` over a generator: once per gated call)."""
    for arg in args:
        if arg is value:
            return True
    return False


class GatedLayers:
    """Mixin: replace a sampled layer's forward by its gated form."""

    def _gate(self, use: Use, output: torch.Tensor, in_place: bool, params: list | None = None) -> torch.Tensor:
        """``output`` through the gate of ``use`` (``params``: its parameters, those of ``use.parts`` when None)."""
        use.generation = self._generation
        # Inside the wrapper's own forward (every call but a checkpoint's recomputation) there is no recomputation
        # to look for: ``_recompute_kind`` would return None.
        recompute = None if self._flags.in_forward else self._recompute_kind()
        if recompute == NON_REENTRANT:
            # A non-reentrant checkpoint's recomputation: the same gated output as the first forward (the
            # checkpoint checks what it saves), but backward runs through the first forward's gate, whose
            # call is the pending one (capture.recompute). Nothing of this call is kept.
            use.activations = None
        else:
            if recompute == REENTRANT:
                self._prepare_recompute_pass()
            self._passes.pending.add(use)
        if params is None:
            params = [param for param, _ in use.parts]
        return _apply_gate(self, use, in_place, output, params)

    def _gate_output(
        self, use: Use, output: torch.Tensor, safe_type: bool, args: tuple, params: list | None = None
    ) -> torch.Tensor:
        """Gate ``output`` in place when that is safe, through its base when it is a plain reshape of
        a fresh tensor, otherwise a copy of it."""
        if safe_type and not _is_among(output, args):
            base = output._base
            if base is None:
                if not (output.is_leaf and output.requires_grad):
                    return self._gate(use, output, True, params)
            elif (
                base.numel() == output.numel()
                and base.is_contiguous()
                and output.is_contiguous()
                and not (base.is_leaf and base.requires_grad)
                and not _is_among(base, args)
            ):
                use.grad_shape = output.shape  # G then arrives in the base's shape
                return self._gate(use, base, True, params).view(output.shape)
        return self._gate(use, output, False, params)

    def _patch_gated(self, path: str, layer: nn.Module, sampler: GradSampler) -> None:
        # A PatchedForward, not a closure: the wrapped model stays picklable (torch.save).
        layer.forward = PatchedForward(self._gated_forward, path, layer, layer.forward, sampler=sampler)

    @staticmethod
    def _gate_samplers(layer: nn.Module, sampler: GradSampler) -> tuple:
        """(norms, sums, grads, stacked, rank_one) of ``layer``: its samplers bound to it, in float32 at least
        (see in_float32); norms and sums None without a norm form; ``stacked``: its norm form gives a user's norm
        from the user's rows stacked (``clipping.per_user.stacks_users``); ``rank_one``: an ``nn.Linear`` with the
        built-in norm and weighted-sum forms, whose rank-one calls ``clipping.ghost.batched`` may do instead."""
        norm_sampler = norm_sampler_for(layer)
        sum_sampler = weighted_sum_sampler_for(layer)
        has_norm_form = norm_sampler is not None and sum_sampler is not None
        norms = in_float32(partial(norm_sampler, layer)) if has_norm_form else None
        sums = in_float32(partial(sum_sampler, layer)) if has_norm_form else None
        stacked = has_norm_form and stacks_users(layer, norm_sampler)
        rank_one = type(layer) is nn.Linear and norm_sampler is linear_norm_sample and sum_sampler is linear_weighted_sum
        return norms, sums, in_float32(partial(sampler, layer)), stacked, rank_one

    def _gated_forward(self, patched: PatchedForward, args: tuple, kwargs: dict):
        """The forward of a sampled layer (``patched.module``): its output through the gate.

        Run once per layer and forward, so kept to few calls: the trainable parameters are read afresh at every
        call (a parameter frozen, unfrozen or replaced between calls is seen at the next one), only the samplers
        bound to the layer are cached (``patched.derived``)."""
        layer = patched.module
        flags = self._flags
        if flags.inside_fallback or not (layer.training and torch.is_grad_enabled()):
            output = patched.original(*args, **kwargs)
            if layer.training and not flags.inside_fallback:
                self._note_batch_without_grad(output, patched.path)  # a reentrant checkpoint's first forward
            return output
        own = layer._parameters
        params = [param for param in own.values() if param is not None and param.requires_grad]
        if not params:
            return patched.original(*args, **kwargs)
        path = patched.path
        derived = patched.derived
        if derived is None:
            derived = patched.derived = self._gate_samplers(layer, patched.context["sampler"])
        norms, sums, grads, stacked, rank_one = derived
        if kwargs:
            bound = inspect.signature(patched.original).bind(*args, **kwargs)
            bound.apply_defaults()
            args, kwargs = tuple(bound.arguments.values()), {}
        if type(layer) is nn.Linear and len(args) == 1:
            # ``layer.weight`` and ``layer.bias`` without nn.Module.__getattr__ when they are registered parameters
            # (not ``own.get(name, layer.<name>)``, which would look the attribute up every time).
            weight = own["weight"] if "weight" in own else layer.weight  # noqa: SIM401
            bias = own["bias"] if "bias" in own else layer.bias  # noqa: SIM401
            output = F.linear(args[0], weight.detach(), None if bias is None else bias.detach())
        else:
            trainable = [(name, param) for name, param in own.items() if param is not None and param.requires_grad]
            try:
                for name, param in trainable:
                    own[name] = param.detach()
                output = patched.original(*args)
            finally:
                for name, param in trainable:
                    own[name] = param
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"ghost clipping: {module_label(path, layer)} returned "
                f"{type(output).__name__}; a layer with a grad sampler must return one tensor"
            )
        if not flags.in_forward:  # inside the wrapper's forward the check has nothing to refuse (it returns None)
            self._check_called_through_wrapper(path)
        dim = self._layer_dim(path)
        broadcast_to = self._note_batch_size(path, output.shape[dim])
        if len(args) == 1 and isinstance(args[0], torch.Tensor):
            activations = (args[0].detach(),)
        else:
            activations = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        if broadcast_to is not None:
            # Shared by every example (see GradSampleModule._note_batch_size): expanded before the
            # gate, so that G arrives per example.
            activations = self._broadcast_activations(path, layer, activations, broadcast_to)
            output = expand_batch(output, dim, broadcast_to)
        use = Use(path, layer, tuple([(param, None) for param in params]), activations, norms, sums, grads,
                  batch_dim=dim, stacks_users=stacked, rank_one_linear=rank_one)  # fmt: skip
        return self._gate_output(use, output, type(layer) in _OUTPUT_NOT_SAVED, args, params)
