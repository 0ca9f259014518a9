"""Fast ("ghost") clipping: per-example clipped gradient sums in ONE backward pass, without
materialising per-example gradients where a layer allows it.

``GhostClippingModule`` (``GradSampleModule(..., grad_sample_mode="ghost")``) changes how each layer
that owns parameters takes part in training:

- A layer with a registered sampler runs its forward with *detached* parameters, and its output goes
  through a small autograd function (the *gate*) that returns it unchanged and takes the parameters
  as inputs. In backward the gate hands the output gradient ``G`` to this module and returns nothing
  for the parameters: the graph still reaches earlier layers through the input, but the ordinary
  weight-gradient product is never computed (it would be done twice otherwise: once by autograd,
  once for the clipped sum).
- When ``G`` arrives, the layer's *norm sampler* turns inputs and ``G`` into per-example squared
  gradient norms (``grad_samplers.registry``; for ``nn.Linear`` the rank-one, Gram or direct form,
  whichever is cheapest), and the inputs and ``G`` are kept for the sum. Where the layer's per-example
  gradients take at most ``per_sample_memory_ratio`` times the memory of its inputs and ``G``, they are
  formed instead (the grad sampler), reduced to norms and kept, and the inputs and ``G`` freed: forming
  them costs about one weight-gradient product, which the sum then no longer needs (conv layers with
  few input channels, LayerNorm, short-sequence projections). A parameter used more than once in the
  forward (tied weights, a layer called twice: its norm needs cross terms between the uses) always has
  its per-example gradients formed, summed over the uses, and reduced. A layer with a grad sampler but
  no norm sampler forms them, reduces them and, if they are large, frees them (its sum is formed again
  at the end from the kept inputs and ``G``).
- At the end of backward (a callback queued on the autograd engine), every norm is known: the
  clipper's rule (``PerSampleGradientClipper.clip_factors_for_norms``, i.e. ``clip_factors``) gives
  each example's factor, and each layer's clipped sum ``sum_i f_i g_i`` is one per-example-weighted
  product of its stored output gradients and inputs (the *weighted-sum sampler*). The sums go to the
  clipper's accumulator (``accumulate_clipped_sums_``); ``pre_step`` / the optimizer writes them into
  ``.grad`` and adds the noise, exactly as for materialised per-example gradients.
- ``nn.MultiheadAttention`` (no bias_k/bias_v, no add_zero_attn) is decomposed: its input and output
  projections run as gated linear maps (the three row blocks of ``in_proj_weight`` are disjoint, so
  their norms add), the attention itself as in ``F.multi_head_attention_forward``.
- Any other module owning parameters runs through the ``torch.func`` fallback with stand-in copies of
  its parameters; its per-example gradients are materialised and kept until the end of backward.

Memory: the inputs and output gradients of the layers that keep them are held until the end of the
backward pass instead of being freed layer by layer; each is freed as soon as its layer's sum is formed.

Not supported: per-user clipping (``group_ids``: an example group's norm would need cross terms between
its examples), activation checkpointing or any forward that runs during a backward pass.

The one difference from the materialised path: with ``nan_safe=True`` the materialised path zeroes only
the non-finite *entries* of a per-example gradient and clips the rest; here the entries are never formed,
so an example whose (group) norm is non-finite is dropped whole (factor 0; its rows are zeroed before
the weighted sums, since ``0 * NaN`` is NaN). The bound holds either way.
"""

from __future__ import annotations

import inspect
import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from grad_samplers import norm_sampler_for, weighted_sum_sampler_for
from grad_samplers.functorch_fallback import per_sample_forward
from grad_samplers.linear import linear_squared_norms, linear_weighted_sums
from grad_samplers.registry import GradSampler
from privacy_engine.grad_sample_module import (
    _HOOKED_MODULES,
    GradSampleModule,
    ParameterUsageError,
    _expand_batch,
)
from privacy_engine.step_contract import register_wrapper
from privacy_engine.validation import module_label

__all__ = ["GRAD_SAMPLE_MODES", "GhostClippingModule"]

GRAD_SAMPLE_MODES = ("hooks", "ghost")

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

Rows = slice | None


class _OutputGate(torch.autograd.Function):
    """Identity on ``output``; in backward, reports the output gradient and gives the parameters none.

    The parameters are inputs only so that the graph contains this node even when the layer's input
    needs no gradient (the first layer).
    """

    @staticmethod
    def forward(ctx, on_output_grad, in_place, output, *params):
        ctx.on_output_grad = on_output_grad
        ctx.num_params = len(params)
        if in_place:
            # Same tensor, new history: later in-place ops on it (ReLU(inplace=True)) stay legal,
            # which they are not on a view returned by a custom Function.
            ctx.mark_dirty(output)
            return output
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.on_output_grad(grad)
        return (None, None, grad) + (None,) * ctx.num_params


@dataclass(eq=False)
class _Use:
    """One gated call (or one fallback call) of one forward: what its backward needs.

    ``parts``: the trainable parameters the call reads, each with the rows it reads (None: all).
    ``norms`` / ``sums`` / ``grads``: ``(activations, G) -> {param: squared norms (B,)}``,
    ``(activations, G, weights) -> {param: weighted sum}``, ``(activations, G) -> {param: (B, ...)}``;
    ``norms``/``sums`` None when only materialising is possible. A fallback call has no functions:
    its per-example gradients arrive through hooks.
    """

    path: str
    layer: nn.Module
    parts: tuple[tuple[nn.Parameter, Rows], ...]
    activations: tuple | None = None
    norms: Callable | None = None
    sums: Callable | None = None
    grads: Callable | None = None
    consumed: bool = False
    grad_shape: torch.Size | None = None
    generation: int = 0  # the training forward this call belongs to (see GradSampleModule._check_live)


def _shared_parameters(uses: Sequence[_Use]) -> set:
    """Parameters whose uses overlap (a whole-parameter use twice, or overlapping row blocks): their
    per-example norm needs cross terms, so they are materialised."""
    spans: dict[nn.Parameter, list[Rows]] = {}
    for use in uses:
        for param, rows in use.parts:
            spans.setdefault(param, []).append(rows)
    shared = set()
    for param, rows_list in spans.items():
        if len(rows_list) < 2:
            continue
        if any(rows is None for rows in rows_list):
            shared.add(param)
            continue
        ordered = sorted((rows.start, rows.stop) for rows in rows_list)
        if any(later[0] < earlier[1] for earlier, later in itertools.pairwise(ordered)):
            shared.add(param)
    return shared


class _BackwardPass:
    """What one backward pass has gathered, until its end-of-backward callback."""

    def __init__(self, shared: set) -> None:
        self.shared = shared
        self.batch: tuple[str, int] | None = None
        self.squared_norms: dict[nn.Parameter, torch.Tensor] = {}  # unscaled, summed over disjoint rows
        self.deferred: list[tuple[_Use, Callable, tuple, torch.Tensor]] = []  # (use, sums, activations, G)
        self.materialised: dict[nn.Parameter, torch.Tensor] = {}  # (B, *param.shape), unscaled

    def note_batch(self, path: str, batch_size: int) -> None:
        if self.batch is None:
            self.batch = (path, batch_size)
        elif self.batch[1] != batch_size:
            raise ValueError(
                f"ghost clipping: one backward pass reached {module_label(path)} with {batch_size} examples but "
                f"{module_label(self.batch[0])} with {self.batch[1]}; every layer must see the same batch"
            )

    def add_squared(self, param: nn.Parameter, squared: torch.Tensor) -> None:
        previous = self.squared_norms.get(param)
        self.squared_norms[param] = squared if previous is None else previous + squared

    def add_materialised(self, param: nn.Parameter, rows: Rows, grads: torch.Tensor) -> None:
        previous = self.materialised.get(param)
        if rows is None:
            # Out of place: `grads` may alias an autograd buffer (a Linear's bias gradient is G itself).
            self.materialised[param] = grads if previous is None else previous + grads
            return
        if previous is None:
            previous = grads.new_zeros((grads.shape[0], *param.shape))
        else:
            previous = previous.clone()
        previous[:, rows] += grads
        self.materialised[param] = previous


def _check_sampler_result(kind: str, use: _Use, result: dict, expected: Callable[[nn.Parameter, Rows], tuple]) -> None:
    for param, rows in use.parts:
        value = result.get(param)
        if value is None:
            raise RuntimeError(
                f"{kind} sampler for {module_label(use.path)} ({type(use.layer).__name__}) returned nothing for a "
                f"trainable parameter of shape {tuple(param.shape)}"
            )
        if tuple(value.shape) != expected(param, rows):
            raise RuntimeError(
                f"{kind} sampler for {module_label(use.path)} ({type(use.layer).__name__}) returned shape "
                f"{tuple(value.shape)} for a parameter of shape {tuple(param.shape)}; expected {expected(param, rows)}"
            )


def _row_shape(param: nn.Parameter, rows: Rows) -> tuple:
    return tuple(param.shape) if rows is None else tuple(param[rows].shape)


def _zero_rows(value, keep: torch.Tensor):
    """``value`` with the rows of dropped examples set to 0 (floating tensors with a batch axis only)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0 and value.shape[0] == keep.shape[0]:
        mask = keep.to(value.device).view(-1, *([1] * (value.dim() - 1)))
        return torch.where(mask, value, torch.zeros((), dtype=value.dtype, device=value.device))
    return value


class GhostClippingModule(GradSampleModule):
    """Wraps ``module`` so that each backward pass adds the per-example *clipped* gradient sum to a
    clipper's accumulator, in that one pass, without materialising per-example gradients where a layer
    has a norm sampler. ``.grad`` is not written by backward (the optimizer writes the clipped sums).

    Guarantee: after each backward pass, the clipper holds ``sum_i f_i g_i`` added to what it held, with
    ``g_i`` example ``i``'s exact gradient (its own loss term; ``loss_reduction`` undone as in
    ``GradSampleModule``) and ``f = clipper.clip_factors_for_norms(norms)`` computed from the exact
    per-example norms (flat or per group): the same sum as ``GradSampleModule`` +
    ``clip_and_accumulate`` up to float rounding (for finite gradients; see the NaN row), so each
    example's contribution has norm at most the clipper's bound, whatever the data. A gradient reaching a parameter any other way (the parameter used outside its
    module's forward) raises ``ParameterUsageError`` during that backward, before ``.grad`` changes.

    ================================  ==========================================================
    case                              behaviour
    ================================  ==========================================================
    parameter shared by layers /      its per-example gradients are materialised over all uses
    layer called twice                (exact cross terms), then reduced
    layer without norm sampler        its per-example gradients materialised, reduced (kept or
                                      freed by ``per_sample_memory_ratio``)
    module without any sampler        ``torch.func`` fallback, materialised
    norm NaN/Inf                      factor 0: the example contributes exactly zero (whole;
                                      the materialised path with nan_safe keeps finite entries)
    ``set_padding_mask(mask)``        masked examples contribute zero (next backward only)
    several backward passes           each adds to the clipper (virtual steps)
    frozen parameter                  not gated, no norm, no sum
    eval mode / ``torch.no_grad``     plain forward, nothing kept
    no clipper attached               ``RuntimeError`` at the training-mode forward
    clipper lacks a trainable param   ``ValueError`` at ``attach_clipper``
    batch sizes differ in backward    ``ValueError`` naming both modules
    backward twice on one forward     ``RuntimeError`` (inputs were freed after the first)
    gradient reaches a parameter      ``ParameterUsageError`` (training mode)
    ================================  ==========================================================

    Args:
        module, batch_first, loss_reduction, strict: as for ``GradSampleModule``.
        clipper: a ``PerSampleGradientClipper`` over the module's trainable parameters (or attach
            one later with ``attach_clipper``; ``PrivacyEngine.make_private`` does).
        per_sample_memory_ratio: a layer keeps its per-example gradients (instead of its inputs and
            output gradient) when they need at most this many times the memory; 0: only where
            needed, ``inf``: always. Changes speed and memory, never the result.
        grad_sample_mode: must be ``"ghost"`` (accepted so that ``GradSampleModule(...,
            grad_sample_mode="ghost")`` can construct this class).

    Attributes:
        last_per_sample_norms: the unclipped per-example norms ``(batch, num_groups)`` of the last
            backward pass (diagnostics; computed from the data, not private).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        clipper=None,
        per_sample_memory_ratio: float = 2.0,
        grad_sample_mode: str = "ghost",
    ) -> None:
        if grad_sample_mode != "ghost":
            raise ValueError(f"GhostClippingModule needs grad_sample_mode='ghost'; got {grad_sample_mode!r}")
        ratio = float(per_sample_memory_ratio)
        if math.isnan(ratio) or ratio < 0:
            raise ValueError(f"per_sample_memory_ratio must be >= 0 (inf: always keep); got {per_sample_memory_ratio!r}")
        self.per_sample_memory_ratio = ratio
        # Set before the base class attaches (it calls self._attach for every layer).
        self._pending: weakref.WeakSet[_Use] = weakref.WeakSet()
        self._pass: _BackwardPass | None = None
        self._clipper = None
        self._padding_mask: torch.Tensor | None = None
        self._padding_mask_source: Callable[[], torch.Tensor | None] | None = None
        self.last_per_sample_norms: torch.Tensor | None = None
        super().__init__(module, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict)
        # The base class's first-backward usage check compares .grad with per-sample sums; here .grad
        # is never written by backward, so a hook per parameter rejects any gradient instead.
        self._check_state = "done"
        for name, param in module.named_parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(partial(self._reject_gradient, name)))
        if clipper is not None:
            self.attach_clipper(clipper)

    # ------------------------------------------------------------------ configuration
    def attach_clipper(self, clipper, *, padding_mask_source: Callable[[], torch.Tensor | None] | None = None) -> None:
        """Send each backward pass's clipped sums to ``clipper`` (a ``PerSampleGradientClipper``).

        ``padding_mask_source``: called at the end of each backward pass for the padding mask of its
        batch (e.g. ``lambda: dp_optimizer.padding_mask_source()``, which ``VirtualSteps`` redirects to
        the micro-batch's slice); ``set_padding_mask`` overrides it for one pass.

        Raises ``ValueError`` (changing nothing) if a trainable parameter of the module is not among
        the clipper's parameters: its gradient would be silently dropped.
        """
        for attribute in ("params", "group_index", "group_norms_from_squared", "clip_factors_for_norms", "accumulate_clipped_sums_"):
            if not hasattr(clipper, attribute):
                raise TypeError(f"clipper must be a PerSampleGradientClipper (no {attribute!r}); got {type(clipper).__name__}")
        known = {id(p) for p in clipper.params}
        missing = [name for name, p in self._module.named_parameters() if p.requires_grad and id(p) not in known]
        if missing:
            raise ValueError(
                f"the clipper does not hold the trainable parameters {missing}; build it over every trainable "
                f"parameter of the module (or freeze those with requires_grad_(False))"
            )
        if padding_mask_source is not None and not callable(padding_mask_source):
            raise TypeError("padding_mask_source must be a callable returning a bool tensor or None")
        self._clipper = clipper
        self._clipper_param_ids = known
        self._clipper_takes_ownership = _takes_ownership(clipper)
        self._padding_mask_source = padding_mask_source
        register_wrapper(self)  # binds the private optimizer that owns this clipper, if any

    @property
    def clipper(self):
        return self._clipper

    def set_padding_mask(self, padding_mask: torch.Tensor | None) -> None:
        """Mark padding examples (bool ``(batch,)``, True = padding) of the NEXT backward pass: they
        contribute exactly zero and are not counted. Cleared after that pass."""
        if padding_mask is not None and (
            not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool or padding_mask.dim() != 1
        ):
            raise TypeError(f"padding_mask must be a 1-D bool tensor (one flag per example); got {padding_mask!r}")
        self._padding_mask = padding_mask

    # ------------------------------------------------------------------ wrapping
    def _attach(self, path: str, layer: nn.Module, sampler: GradSampler | None) -> None:
        for param in layer.parameters(recurse=sampler is None):
            self._owner_paths.setdefault(param, path)
        if sampler is not None:
            self._patch_gated(path, layer, sampler)
            self._patched.append(layer)
        elif type(layer) is nn.MultiheadAttention:
            self._patch_attention(path, layer)
            self._patched.append(layer)
        else:
            self._patch_forward(path, layer)  # the core's fallback patch, calling this class's _fallback_call
        _HOOKED_MODULES.add(layer)

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled() and self._clipper is None:
            raise RuntimeError(
                "GhostClippingModule has no clipper: call attach_clipper(PerSampleGradientClipper(params, "
                "max_grad_norm)) first (PrivacyEngine.make_private(grad_sample_mode='ghost') does)"
            )
        if self._pass is not None:
            self._pass = None  # left over from a backward pass that raised
        return super().forward(*args, **kwargs)

    def _check_second_pass(self, ticket) -> None:
        # Norms of two passes over the same examples cannot be added (cross terms): refuse before the
        # second backward instead of clipping each example twice.
        if self._consumer.contract.already_contributed(ticket):
            raise RuntimeError(
                "ghost clipping: a second backward pass over the same batch before optimizer.step(): each "
                "example would be clipped twice. Add the losses and call backward once per batch, or use "
                "grad_sample_mode='hooks' (which sums the passes per example before clipping)."
            )

    def _gate(self, use: _Use, output: torch.Tensor, in_place: bool) -> torch.Tensor:
        use.generation = self._generation
        self._pending.add(use)
        params = tuple(param for param, _ in use.parts)
        return _OutputGate.apply(partial(self._on_output_grad, use), in_place, output, *params)

    def _gate_output(self, use: _Use, output: torch.Tensor, safe_type: bool, args: tuple) -> torch.Tensor:
        """Gate ``output`` in place when that is safe, through its base when it is a plain reshape of
        a fresh tensor, otherwise a copy of it."""
        if safe_type and not any(output is a for a in args):
            base = output._base
            if base is None and not (output.is_leaf and output.requires_grad):
                return self._gate(use, output, True)
            if (
                base is not None
                and base.numel() == output.numel()
                and base.is_contiguous()
                and output.is_contiguous()
                and not (base.is_leaf and base.requires_grad)
                and not any(base is a for a in args)
            ):
                use.grad_shape = output.shape  # G then arrives in the base's shape
                return self._gate(use, base, True).view(output.shape)
        return self._gate(use, output, False)

    def _patch_gated(self, path: str, layer: nn.Module, sampler: GradSampler) -> None:
        original = layer.forward
        norm_sampler = norm_sampler_for(layer)
        sum_sampler = weighted_sum_sampler_for(layer)
        plain_linear = type(layer) is nn.Linear
        safe_type = type(layer) in _OUTPUT_NOT_SAVED
        has_norm_form = norm_sampler is not None and sum_sampler is not None
        # Norms, sums and materialised gradients in float32 at least (see _in_float32).
        norms = _in_float32(partial(norm_sampler, layer)) if has_norm_form else None
        sums = _in_float32(partial(sum_sampler, layer)) if has_norm_form else None
        grads = _in_float32(partial(sampler, layer))

        def forward(*args, **kwargs):
            if self._inside_fallback or not (layer.training and torch.is_grad_enabled()):
                return original(*args, **kwargs)
            own = layer._parameters
            trainable = [(name, p) for name, p in own.items() if p is not None and p.requires_grad]
            if not trainable:
                return original(*args, **kwargs)
            if kwargs:
                bound = inspect.signature(original).bind(*args, **kwargs)
                bound.apply_defaults()
                args, kwargs = tuple(bound.arguments.values()), {}
            if plain_linear and len(args) == 1:
                bias = layer.bias
                output = F.linear(args[0], layer.weight.detach(), None if bias is None else bias.detach())
            else:
                try:
                    for name, param in trainable:
                        own[name] = param.detach()
                    output = original(*args)
                finally:
                    for name, param in trainable:
                        own[name] = param
            if not isinstance(output, torch.Tensor):
                raise TypeError(
                    f"ghost clipping: {module_label(path)} ({type(layer).__name__}) returned "
                    f"{type(output).__name__}; a layer with a grad sampler must return one tensor"
                )
            self._check_called_through_wrapper(path)
            broadcast_to = self._note_batch_size(path, output.shape[self._batch_dim])
            activations = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            if broadcast_to is not None:
                # Shared by every example (see GradSampleModule._note_batch_size): expanded before the
                # gate, so that G arrives per example.
                activations = self._broadcast_activations(path, layer, activations, broadcast_to)
                output = _expand_batch(output, self._batch_dim, broadcast_to)
            use = _Use(
                path=path,
                layer=layer,
                parts=tuple((param, None) for _, param in trainable),
                activations=activations,
                norms=norms,
                sums=sums,
                grads=grads,
            )
            return self._gate_output(use, output, safe_type, args)

        layer.forward = forward

    def _fallback_call(self, path: str, module: nn.Module, original, args, kwargs, params: dict[str, nn.Parameter]):
        # Stand-in leaves: the fallback's autograd then ends at them, never at the real parameters'
        # .grad (which would receive the unclipped sum).
        stand_ins = {name: p.detach().requires_grad_() for name, p in params.items()}
        real_of = {id(stand_ins[name]): p for name, p in params.items()}
        use = _Use(path=path, layer=module, parts=tuple((p, None) for p in params.values()),
                   generation=self._generation)  # fmt: skip
        self._pending.add(use)

        def on_per_sample_grad(stand_in: torch.Tensor, grads: torch.Tensor) -> None:
            self._on_fallback_grad(use, real_of[id(stand_in)], grads)

        self._inside_fallback = True
        try:
            output = per_sample_forward(
                module,
                original,
                args,
                kwargs,
                params=stand_ins,
                batch_dim=self._batch_dim,
                module_path=path,
                on_per_sample_grad=on_per_sample_grad,
            )
        finally:
            self._inside_fallback = False
        self._note_output_batch_size(path, module, output)
        return output

    # ------------------------------------------------------------------ multi-head attention
    def _patch_attention(self, path: str, attention: nn.MultiheadAttention) -> None:
        original = attention.forward

        def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                    average_attn_weights=True, is_causal=False):
            call = (query, key, value)
            options = {
                "key_padding_mask": key_padding_mask,
                "need_weights": need_weights,
                "attn_mask": attn_mask,
                "average_attn_weights": average_attn_weights,
                "is_causal": is_causal,
            }
            if self._inside_fallback or not (attention.training and torch.is_grad_enabled()):
                return original(*call, **options)
            params = {name: p for name, p in attention.named_parameters() if p.requires_grad}
            if not params:
                return original(*call, **options)
            if not _attention_decomposable(attention, query, key, value, key_padding_mask, attn_mask):
                return self._fallback_call(path, attention, original, call, options, params)
            return self._attention_call(path, attention, query, key, value, **options)

        attention.forward = forward

    def _gated_linear(self, path: str, layer: nn.Module, inputs: torch.Tensor, weight: nn.Parameter,
                      bias: nn.Parameter | None, weight_rows: Rows, bias_rows: Rows) -> torch.Tensor:
        """``F.linear(inputs, weight[rows], bias[rows])`` (batch first), gated: a piece of a layer."""
        weight_part = weight.detach() if weight_rows is None else weight.detach()[weight_rows]
        bias_part = None
        if bias is not None:
            bias_part = bias.detach() if bias_rows is None else bias.detach()[bias_rows]
        output = F.linear(inputs, weight_part, bias_part)
        train_weight = weight.requires_grad
        train_bias = bias is not None and bias.requires_grad
        if not (train_weight or train_bias):
            return output
        parts = []
        if train_weight:
            parts.append((weight, weight_rows))
        if train_bias:
            parts.append((bias, bias_rows))

        def keyed(weight_value, bias_value):
            result = {}
            if train_weight:
                result[weight] = weight_value
            if train_bias:
                result[bias] = bias_value
            return result

        def norms(activations, grads):
            return keyed(*linear_squared_norms(activations[0], grads, weight=train_weight, bias=train_bias))

        def sums(activations, grads, weights):
            return keyed(*linear_weighted_sums(activations[0], grads, weights, weight=train_weight, bias=train_bias))

        def per_sample(activations, grads):
            sequences = activations[0].reshape(grads.shape[0], -1, activations[0].shape[-1])
            flat_grads = grads.reshape(grads.shape[0], -1, grads.shape[-1])
            weight_value = torch.bmm(flat_grads.transpose(1, 2), sequences) if train_weight else None
            return keyed(weight_value, flat_grads.sum(dim=1) if train_bias else None)

        use = _Use(path=path, layer=layer, parts=tuple(parts), activations=(inputs.detach(),),
                   norms=norms, sums=sums, grads=per_sample)
        return self._gate_output(use, output, True, (inputs,))

    def _attention_call(self, path, attention: nn.MultiheadAttention, query, key, value, *, key_padding_mask,
                        need_weights, attn_mask, average_attn_weights, is_causal):
        if not attention.batch_first:
            # Batch first from here on: the gated projections need the example axis in front.
            same_kv = key is value
            same_qk = query is key
            query = query.transpose(0, 1)
            key = query if same_qk else key.transpose(0, 1)
            value = key if same_kv else value.transpose(0, 1)
        batch_size, target_length, embed_dim = query.shape
        source_length = key.shape[1]
        heads, head_dim = attention.num_heads, attention.head_dim
        self._note_batch_size(path, batch_size)
        bias = attention.in_proj_bias
        rows = [slice(i * embed_dim, (i + 1) * embed_dim) for i in range(3)]
        if attention._qkv_same_embed_dim:
            weight = attention.in_proj_weight
            if query is key and key is value:
                projected = self._gated_linear(path, attention, query, weight, bias, None, None)
                q, k, v = projected.chunk(3, dim=-1)
            else:
                q, k, v = (
                    self._gated_linear(path, attention, x, weight, bias, r, r)
                    for x, r in zip((query, key, value), rows)
                )
        else:
            weights = (attention.q_proj_weight, attention.k_proj_weight, attention.v_proj_weight)
            q, k, v = (
                self._gated_linear(path, attention, x, w, bias, None, r)
                for x, w, r in zip((query, key, value), weights, rows)
            )
        q = q.reshape(batch_size, target_length, heads, head_dim).transpose(1, 2)
        k = k.reshape(batch_size, source_length, heads, head_dim).transpose(1, 2)
        v = v.reshape(batch_size, source_length, heads, head_dim).transpose(1, 2)

        mask, causal = _attention_mask(
            key_padding_mask, attn_mask, is_causal, need_weights, query.dtype, batch_size, heads, target_length, source_length
        )
        dropout_p = attention.dropout
        weights_out = None
        if need_weights:
            scores = torch.matmul(q * math.sqrt(1.0 / head_dim), k.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            probabilities = torch.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                probabilities = F.dropout(probabilities, p=dropout_p)
            context = torch.matmul(probabilities, v)
            weights_out = probabilities.mean(dim=1) if average_attn_weights else probabilities
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)
        context = context.transpose(1, 2).reshape(batch_size, target_length, embed_dim)
        out_proj = attention.out_proj
        output = self._gated_linear(f"{path}.out_proj" if path else "out_proj", out_proj, context,
                                    out_proj.weight, out_proj.bias, None, None)
        if not attention.batch_first:
            output = output.transpose(0, 1)
        return output, weights_out

    # ------------------------------------------------------------------ backward
    def _current_pass(self) -> _BackwardPass:
        if self._pass is None:
            live = [use for use in list(self._pending) if not use.consumed]
            self._pass = _BackwardPass(_shared_parameters(live))
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)
        return self._pass

    def _on_output_grad(self, use: _Use, grads: torch.Tensor) -> None:
        self._check_live(use.generation)
        activations = use.activations
        if activations is None:
            raise RuntimeError(
                f"{module_label(use.path)}: a second backward pass ran through the same forward "
                f"(retain_graph=True). Its inputs were freed after the first; run a new forward for each backward."
            )
        state = self._current_pass()
        use.activations, use.consumed = None, True
        if use.grad_shape is not None:
            grads = grads.reshape(use.grad_shape)
        if self._batch_dim != 0:
            grads = grads.movedim(self._batch_dim, 0)
            activations = tuple(
                a.movedim(self._batch_dim, 0) if isinstance(a, torch.Tensor) and a.dim() > self._batch_dim else a
                for a in activations
            )
        batch_size = grads.shape[0]
        state.note_batch(use.path, batch_size)
        if batch_size == 0:
            # An empty (Poisson) batch: no norms, nothing to sum; samplers need not handle it.
            for param, _ in use.parts:
                state.add_squared(param, grads.new_zeros(0))
            return
        # Keep per-example gradients or (inputs, output gradient) until the end of backward, whichever
        # is smaller: when the per-example gradients are the smaller, forming them also costs no more
        # than a norm plus a second weight-gradient product for the sum (the direct form).
        shared = any(param in state.shared for param, _ in use.parts)
        per_sample_bytes = batch_size * grads.element_size() * sum(math.prod(_row_shape(p, r)) for p, r in use.parts)
        held_bytes = sum(_tensor_bytes(value) for value in (grads, *activations))
        keep_per_sample = per_sample_bytes <= self.per_sample_memory_ratio * held_bytes
        if shared or use.norms is None or keep_per_sample:
            per_sample = use.grads(activations, grads)
            _check_sampler_result("grad", use, per_sample, lambda p, r: (batch_size, *_row_shape(p, r)))
            if shared or keep_per_sample:
                for param, rows in use.parts:
                    state.add_materialised(param, rows, per_sample[param])
                return
            # No norm-only form and large per-example gradients: reduce them to norms, free them, and
            # form the sum later from the kept inputs and output gradient.
            for param, _ in use.parts:
                state.add_squared(param, torch.linalg.vector_norm(per_sample[param].reshape(batch_size, -1), dim=1).square())
            del per_sample
            state.deferred.append((use, partial(_weighted_sum_by_materialising, use.grads), activations, grads))
            return
        squared = use.norms(activations, grads)
        _check_sampler_result("norm", use, squared, lambda p, r: (batch_size,))
        for param, _ in use.parts:
            state.add_squared(param, squared[param])
        state.deferred.append((use, use.sums, activations, grads))

    def _on_fallback_grad(self, use: _Use, param: nn.Parameter, grads: torch.Tensor) -> None:
        self._check_live(use.generation)
        state = self._current_pass()
        use.consumed = True
        state.note_batch(use.path, grads.shape[0])
        state.add_materialised(param, None, grads)

    def _reject_gradient(self, name: str, grad: torch.Tensor | None) -> None:
        if grad is None or not self.training:
            return
        self._pass = None
        raise ParameterUsageError(
            f"parameter {name!r} received a gradient outside ghost clipping (it is used outside the forward of "
            f"the module that owns it, e.g. read directly or in a loss term): that gradient would bypass "
            f"per-example clipping. Route every use through the owning module's forward."
        )

    def _finish_pass(self) -> None:
        self._awaiting_backward = False
        state, self._pass = self._pass, None
        padding_mask, self._padding_mask = self._padding_mask, None
        if state is None or state.batch is None:
            return
        ticket = self._forward_ticket if self._consumer is not None else None
        if padding_mask is None and ticket is not None and ticket.tracked:
            padding_mask = ticket.mask()  # the mask travels with this pass's own batch
        elif padding_mask is None and self._padding_mask_source is not None:
            padding_mask = self._padding_mask_source()
        clipper = self._clipper
        batch_size = state.batch[1]
        if padding_mask is not None and tuple(padding_mask.shape) != (batch_size,):
            raise ValueError(
                f"padding_mask has shape {tuple(padding_mask.shape)}; expected ({batch_size},), one flag per example"
            )
        # The output gradients were kept unscaled: fold the loss reduction's factor into norms and weights.
        scale = float(batch_size) if self.loss_reduction == "mean" else 1.0
        # fp16 loss scaling (an attached GradScaler): the output gradients are S times the true ones.
        scale /= clipper.loss_scale() if hasattr(clipper, "loss_scale") else 1.0
        with torch.no_grad():
            squared = dict(state.squared_norms)
            for param, grads in state.materialised.items():
                # Added, not assigned: other (disjoint) row blocks of the parameter may have norms already.
                # reshape, not flatten(1): a 0-dim parameter's per-example gradients are 1-D. Float32 at least.
                materialised_squared = torch.linalg.vector_norm(
                    grads.reshape(grads.shape[0], param.numel()), dim=1, dtype=torch.promote_types(grads.dtype, torch.float32)
                ).square()
                previous = squared.get(param)
                squared[param] = materialised_squared if previous is None else previous + materialised_squared
            self._check_known(squared)
            # Summed per clipping group first (one stacked sum, not one indexed add per parameter) and
            # handed over under one member of each group: the clipper adds a group's squares anyway.
            by_group: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
            for param, value in squared.items():
                by_group.setdefault(clipper.group_index(param), []).append((param, value))
            group_squares = {
                members[0][0]: members[0][1] if len(members) == 1 else torch.stack([v for _, v in members]).sum(dim=0)
                for members in by_group.values()
            }
            # Norms are homogeneous: scaling the (unscaled-gradient) norms once equals scaling every G.
            norms = clipper.group_norms_from_squared(group_squares)
            if scale != 1.0:
                norms = norms * scale
            factors = clipper.clip_factors_for_norms(norms, padding_mask=padding_mask)
            # A zero factor does not cancel a NaN/Inf in that example's rows: zero them (only needed
            # when some norm is non-finite, as every entry then shows in its norm).
            drop_non_finite = not bool(torch.isfinite(norms).all())
            weights = factors * scale
            sums: dict[nn.Parameter, torch.Tensor] = {}
            deferred, state.deferred = state.deferred, []
            deferred.reverse()
            while deferred:
                # Popped one at a time so each layer's inputs and output gradient are freed as soon as
                # its sum exists: the peak stays near the larger of "all of them" and "all the sums".
                use, weighted_sums, activations, grads = deferred.pop()
                columns: dict[int, list[tuple[nn.Parameter, Rows]]] = {}
                for param, rows in use.parts:
                    columns.setdefault(clipper.group_index(param), []).append((param, rows))
                for column, parts in columns.items():
                    column_weights = weights[:, column]
                    column_activations, column_grads = activations, grads
                    if drop_non_finite:
                        keep = column_weights != 0
                        column_activations = tuple(_zero_rows(a, keep) for a in activations)
                        column_grads = _zero_rows(grads, keep)
                    result = weighted_sums(column_activations, column_grads, column_weights)
                    _check_sampler_result("weighted-sum", use, result, _row_shape)
                    for param, rows in parts:
                        _add_rows(sums, param, rows, result[param])
                del use, weighted_sums, activations, grads, column_activations, column_grads, result
            materialised, state.materialised = state.materialised, {}
            while materialised:
                param, grads = materialised.popitem()
                column_weights = weights[:, clipper.group_index(param)]
                if drop_non_finite:
                    grads = _zero_rows(grads, column_weights != 0)
                _add_rows(sums, param, None, torch.tensordot(column_weights.to(grads.dtype), grads, dims=1))
                del grads
            self.last_per_sample_norms = norms
            if self._clipper_takes_ownership:
                clipper.accumulate_clipped_sums_(sums, norms, padding_mask=padding_mask, take_ownership=True)
            else:
                clipper.accumulate_clipped_sums_(sums, norms, padding_mask=padding_mask)
            if ticket is not None:
                self._consumer.contract.contributed(ticket)

    def _check_known(self, squared: dict[nn.Parameter, torch.Tensor]) -> None:
        if all(id(param) in self._clipper_param_ids for param in squared):
            return
        unknown = [name for name, p in self._module.named_parameters() if p in squared and id(p) not in self._clipper_param_ids]
        raise ValueError(
            f"parameters {unknown} were trained but are not held by the clipper (unfrozen after "
            f"attach_clipper?); attach a clipper over every trainable parameter"
        )


def _in_float32(function: Callable) -> Callable:
    """``function(activations, grads, *rest)`` with half-precision floating tensors promoted to float32.

    Under autocast (or for a model held in bf16/fp16) a layer's inputs and output gradient are half
    precision. A per-example norm computed in bf16 is off by up to 2^-8 relative, so an example's
    clipped contribution could exceed the clipping bound by that much; a clipped sum rounded to bf16
    moves by an ulp of the whole batch's sum. Promoting the operands (kept in half precision until
    this call, so memory does not grow) keeps norms and sums as exact as float32 makes them.
    """

    def promoted(activations, grads, *rest):
        if _is_half(grads) or any(_is_half(a) for a in activations):
            activations = tuple(a.float() if _is_half(a) else a for a in activations)
            grads = grads.float() if _is_half(grads) else grads
        return function(activations, grads, *rest)

    return promoted


def _is_half(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.element_size() < 4


def _tensor_bytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _weighted_sum_by_materialising(grad_sampler: Callable, activations: tuple, grads: torch.Tensor, weights: torch.Tensor):
    """``sum_i weights[i] g_i`` through a grad sampler: per-example gradients are linear in the output
    gradient, so those of ``weights[i] * G_i`` summed over examples are the weighted sum."""
    scaled = grads * weights.to(grads.dtype).view(-1, *([1] * (grads.dim() - 1)))
    return {param: per_sample.sum(dim=0) for param, per_sample in grad_sampler(activations, scaled).items()}


def _takes_ownership(clipper) -> bool:
    """Whether ``clipper.accumulate_clipped_sums_`` can keep the sums without copying them (they are
    fresh tensors nobody else holds)."""
    try:
        return "take_ownership" in inspect.signature(clipper.accumulate_clipped_sums_).parameters
    except (TypeError, ValueError):
        return False


def _add_rows(sums: dict[nn.Parameter, torch.Tensor], param: nn.Parameter, rows: Rows, value: torch.Tensor) -> None:
    if rows is None:
        previous = sums.get(param)
        sums[param] = value if previous is None else previous + value
        return
    total = sums.get(param)
    if total is None:
        total = value.new_zeros(param.shape)
        sums[param] = total
    total[rows] += value


# ---------------------------------------------------------------------- attention helpers
def _attention_decomposable(attention: nn.MultiheadAttention, query, key, value, key_padding_mask, attn_mask) -> bool:
    """Whether the gated decomposition covers this call; otherwise the fallback runs it (and raises
    torch's own errors for malformed inputs)."""
    if attention.bias_k is not None or attention.bias_v is not None or attention.add_zero_attn:
        return False
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (query, key, value)):
        return False
    batch_axis = 0 if attention.batch_first else 1
    sequence_axis = 1 - batch_axis
    batch_size = query.shape[batch_axis]
    if key.shape[batch_axis] != batch_size or value.shape[batch_axis] != batch_size:
        return False
    if key.shape[sequence_axis] != value.shape[sequence_axis] or query.shape[-1] != attention.embed_dim:
        return False
    if key.shape[-1] != attention.kdim or value.shape[-1] != attention.vdim:
        return False
    for mask in (key_padding_mask, attn_mask):
        if mask is not None and not (mask.dtype == torch.bool or mask.is_floating_point()):
            return False
    source_length, target_length = key.shape[sequence_axis], query.shape[sequence_axis]
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch_size, source_length):
        return False
    allowed_mask_shapes = ((target_length, source_length), (batch_size * attention.num_heads, target_length, source_length))
    return attn_mask is None or tuple(attn_mask.shape) in allowed_mask_shapes


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def _attention_mask(key_padding_mask, attn_mask, is_causal, need_weights, dtype, batch_size, heads, target_length,
                    source_length):
    """The additive mask ``(B or 1, H or 1, L, S)`` and causal flag, merged as ``F.multi_head_attention_forward``
    merges them."""
    key_padding_mask = _additive_mask(key_padding_mask, dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        return None, True
    attn_mask = _additive_mask(attn_mask, dtype)
    if key_padding_mask is not None:
        is_causal = False
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            attn_mask = attn_mask.view(1, 1, target_length, source_length)
        else:
            attn_mask = attn_mask.view(batch_size, heads, target_length, source_length)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(batch_size, 1, 1, source_length)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    return attn_mask, is_causal and attn_mask is None
