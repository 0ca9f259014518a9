"""Fast ("ghost") clipping: per-example clipped gradient sums in ONE backward pass, without
materialising per-example gradients where a layer allows it.

``GhostClippingModule`` (built explicitly by the caller: ``PrivacyEngine.make_private(grad_sample_mode="ghost")``
builds it; ``GradSampleModule`` never turns into it) changes how each layer that owns parameters takes
part in training. One file per part: the gate (``gate.py``), the attention decomposition
(``attention.py``), the backward pass and its end (``backward.py``, ``uses.py``); this file holds the
wrapper and its clipper.

- A layer with a registered sampler runs its forward with *detached* parameters, and its output goes
  through a small autograd function (the *gate*) that returns it unchanged (and takes the parameters
  as inputs where the layer's input needs no gradient, to be in the graph). In backward the gate hands
  the output gradient ``G`` to this module and returns nothing
  for the parameters: the graph still reaches earlier layers through the input, but the ordinary
  weight-gradient product is never computed (it would be done twice otherwise: once by autograd,
  once for the clipped sum).
- When ``G`` arrives, the layer's *norm sampler* turns inputs and ``G`` into per-example squared
  gradient norms (``grad_samplers.registry``; for ``nn.Linear`` the rank-one, Gram or direct form,
  whichever is cheapest), and the inputs and ``G`` are kept for the sum. Where the layer's per-example
  gradients take at most ``per_sample_memory_ratio`` times the memory of its inputs and ``G``, they are
  formed instead (the grad sampler), reduced to norms and kept, and the inputs and ``G`` freed: forming
  them costs about one weight-gradient product, which the sum then no longer needs (conv layers with
  few input channels, LayerNorm, short-sequence projections). A weight shared only by whole-weight
  ``nn.Embedding`` and ``nn.Linear`` uses, one of them an embedding (tied input embedding and LM head), gets
  its norm from each use's own form plus the cross terms between the uses and its sum from each use's own
  weighted sum, never its per-example gradients (``clipping.ghost.tied``). Any other parameter used more than
  once in the forward (a layer called twice, row blocks of attention) has its per-example gradients formed,
  summed over the uses, and reduced. A layer with a grad sampler but
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

User-level DP (``privacy_unit="user"``): a pass whose batch is a user-level draw (its ticket names the user of
each row, ``k`` consecutive rows per user) clips each user's summed gradient once: the norm of the sum, cross
terms between the user's examples included, from each layer's norm form on the user's rows stacked where the
form allows it and from its per-example gradients summed per user otherwise (``backward.py``).

Not supported: arbitrary ``group_ids`` (``clip_and_accumulate(group_ids=...)`` needs materialised per-sample
gradients; user-level batches are the supported grouping), a forward during a backward pass other than
activation checkpointing's recomputation
(``capture.recompute``; with ``use_reentrant=True`` a parameter used both inside a recomputed region and
elsewhere, found only as the nested backward reaches it, raises: use ``use_reentrant=False``).

The one difference from the materialised path: with ``nan_safe=True`` the materialised path zeroes only
the non-finite *entries* of a per-example gradient and clips the rest; here the entries are never formed,
so an example whose (group) norm is non-finite is dropped whole (factor 0; its rows are zeroed before
the weighted sums, since ``0 * NaN`` is NaN). The bound holds either way.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from collections.abc import Callable
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from grad_samplers.registry import GradSampler
from privacy_engine.capture.common import HOOKED_MODULES, ParameterUsageError, forward_with_model_signature
from privacy_engine.capture.compiled_code import stale_compilation_note
from privacy_engine.capture.module import GradSampleModule
from privacy_engine.clipping.ghost.attention import AttentionDecomposition
from privacy_engine.clipping.ghost.backward import BackwardPasses
from privacy_engine.clipping.ghost.gate import GatedLayers
from privacy_engine.clipping.ghost.uses import ClipperLink, GhostPasses, Use

__all__ = ["GhostClippingModule"]


class GhostClippingModule(GatedLayers, AttentionDecomposition, BackwardPasses, GradSampleModule):
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
    weight tied by embedding(s) and   each use's own norm form plus the cross terms between the
    linear head(s)                    uses, each use's own sum: never materialised (``tied``)
    other parameter shared by layers  its per-example gradients are materialised over all uses
    / layer called twice              (exact cross terms), then reduced
    two backward calls through one    the second refused (``RuntimeError``) before anything of it
    forward (two heads, two losses)   is kept: it would clip the examples again
    layer without norm sampler        its per-example gradients materialised, reduced (kept or
                                      freed by ``per_sample_memory_ratio``)
    module without any sampler        ``torch.func`` fallback, materialised
    parameter owned by the root       forward-mode tangents (``capture.root_parameters``),
                                      materialised
    activation checkpointing          same norms and sums as without it (``capture.recompute``)
    norm NaN/Inf                      factor 0: the example contributes exactly zero (whole;
                                      the materialised path with nan_safe keeps finite entries)
    user-level batch (ticket with     norms, factors and statistics per user: each user's summed
    users)                            gradient clipped once (``clipping.per_user.user_rows``);
                                      a slice cutting a user: ``UserSplitError`` in backward
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

    Attributes:
        last_per_sample_norms: the unclipped per-example norms ``(batch, num_groups)`` of the last
            backward pass (diagnostics; computed from the data, not private).

    State: the base wrapper's (``capture.state``) plus ``_passes`` (``GhostPasses``: pending calls, the pass
    in progress, the next pass's padding mask) and ``_clipping`` (``ClipperLink``: where the sums go), both
    declared in ``clipping.ghost.uses`` with which part writes and reads them. The parts: ``GatedLayers``
    (gate.py) and ``AttentionDecomposition`` (attention.py) install the forwards (through ``_attach``, the
    base's construction extension point), ``BackwardPasses`` (backward.py) handles the passes.
    """

    #: Backward never writes ``.grad`` here, so the base's first-backward check has nothing to compare;
    #: instead a hook per trainable parameter refuses any gradient (``_reject_gradient``).
    checks_parameter_usage: ClassVar[bool] = False

    def __init__(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        clipper=None,
        per_sample_memory_ratio: float = 2.0,
    ) -> None:
        ratio = float(per_sample_memory_ratio)
        if math.isnan(ratio) or ratio < 0:
            raise ValueError(f"per_sample_memory_ratio must be >= 0 (inf: always keep); got {per_sample_memory_ratio!r}")
        super().__init__(module, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict)
        self.per_sample_memory_ratio = ratio
        self._passes = GhostPasses()
        self._clipping: ClipperLink | None = None  # until attach_clipper
        self.last_per_sample_norms: torch.Tensor | None = None
        for name, param in module.named_parameters():
            if param.requires_grad:
                self._tables.handles.append(param.register_hook(partial(self._reject_gradient, name)))
        if clipper is not None:
            self.attach_clipper(clipper)

    def __getstate__(self) -> dict:
        """Pickle (``torch.save(model)``) without what belongs to the training run, as the base wrapper leaves
        out its binding: the passes (weak references to live graphs, the pass in progress) and the clipper
        link (the optimizer's clipper and padding-mask source). A loaded wrapper has no clipper: its eval and
        no-grad forwards run, a training forward asks for ``attach_clipper``."""
        state = super().__getstate__()
        state.update(_passes=None, _clipping=None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._passes = GhostPasses()

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
        self._clipping = ClipperLink(
            clipper=clipper,
            param_ids=frozenset(known),
            takes_ownership=_takes_ownership(clipper),
            padding_mask_source=padding_mask_source,
        )

    @property
    def clipper(self):
        """The ``PerSampleGradientClipper`` each backward pass's clipped sums go to (None before
        ``attach_clipper``)."""
        return None if self._clipping is None else self._clipping.clipper

    @property
    def padding_mask_source(self) -> Callable[[], torch.Tensor | None] | None:
        """The ``padding_mask_source`` given to ``attach_clipper`` (kept when the optimizer attaches a new
        clipper after ``requires_grad`` changed)."""
        return None if self._clipping is None else self._clipping.padding_mask_source

    @property
    def _pending(self) -> weakref.WeakSet[Use]:
        # Read by tests: the calls whose backward has not run (``_passes.pending``).
        return self._passes.pending

    def set_padding_mask(self, padding_mask: torch.Tensor | None) -> None:
        """Mark padding examples (bool ``(batch,)``, True = padding) of the NEXT backward pass: they
        contribute exactly zero and are not counted. Cleared after that pass."""
        if padding_mask is not None and (
            not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool or padding_mask.dim() != 1
        ):
            raise TypeError(f"padding_mask must be a 1-D bool tensor (one flag per example); got {padding_mask!r}")
        self._passes.padding_mask = padding_mask

    # ------------------------------------------------------------------ wrapping
    def _attach(self, path: str, layer: nn.Module, sampler: GradSampler | None) -> None:
        # Called by the base's __init__ (its construction extension point), before this class's __init__
        # goes on: the forwards installed here read this class's state only when they run.
        for param in layer.parameters(recurse=sampler is None):
            self._tables.owner_paths.setdefault(param, path)
        if sampler is not None:
            self._patch_gated(path, layer, sampler)
            self._tables.patched.append(layer)
        elif type(layer) is nn.MultiheadAttention:
            self._patch_attention(path, layer)
            self._tables.patched.append(layer)
        else:
            self._patch_forward(path, layer)  # the core's fallback patch, calling this class's _fallback_call
        HOOKED_MODULES.add(layer)

    @forward_with_model_signature
    def forward(self, *args, **kwargs):
        """Run the wrapped module with the fast-clipping gates, as ``GradSampleModule.forward`` does (same
        checks and step binding), and return its output.

        ``RuntimeError`` before the model runs if a training forward (training mode, gradients on) comes
        before ``attach_clipper``: without a clipper nothing could be clipped. A backward pass left over
        from one that raised is dropped (its norms are never used)."""
        if self.training and torch.is_grad_enabled() and self._clipping is None:
            raise RuntimeError(
                "GhostClippingModule has no clipper: call attach_clipper(PerSampleGradientClipper(params, "
                "max_grad_norm)) first (PrivacyEngine.make_private(grad_sample_mode='ghost') does)"
            )
        if self._passes.current is not None:
            self._passes.drop_pass()  # left over from a backward pass that raised
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

    def _fallback_call(self, path: str, module: nn.Module, original, args, kwargs, params: dict[str, nn.Parameter]):
        # Stand-in leaves: the fallback's autograd then ends at them, never at the real parameters'
        # .grad (which would receive the unclipped sum).
        stand_ins = {name: p.detach().requires_grad_() for name, p in params.items()}
        real_of = {id(stand_ins[name]): p for name, p in params.items()}
        use = Use(path=path, layer=module, parts=tuple((p, None) for p in params.values()),
                   generation=self._generation)  # fmt: skip
        self._passes.pending.add(use)

        def on_per_sample_grad(stand_in: torch.Tensor, grads: torch.Tensor) -> None:
            self._on_fallback_grad(use, real_of[id(stand_in)], grads)

        return self._run_fallback(path, module, original, args, kwargs, stand_ins, on_per_sample_grad)

    @contextlib.contextmanager
    def _root_parameters_in_forward(self, trainable: list[tuple[str, nn.Parameter]]):
        # Detached for the real forward, as a gated layer's: no gradient reaches them (``.grad`` would get the
        # unclipped sum); their per-sample gradients come from the tangents (capture.root_parameters).
        own = self._module._parameters
        try:
            for name, param in trainable:
                own[name] = param.detach()
            yield
        finally:
            for name, param in trainable:
                own[name] = param

    def _root_parameter_sink(self, params: list[nn.Parameter]):
        # One materialised use of this forward, like a fallback call's.
        use = Use(path="", layer=self._module, parts=tuple((p, None) for p in params), generation=self._generation)
        self._passes.pending.add(use)
        return partial(self._on_fallback_grad, use)

    def _reject_gradient(self, name: str, grad: torch.Tensor | None) -> None:
        if grad is None or not self.training:
            return
        self._passes.drop_pass()
        owner = next((self._tables.owner_paths.get(p) for n, p in self._module.named_parameters() if n == name), None)
        raise ParameterUsageError(
            f"parameter {name!r} received a gradient outside ghost clipping (it is used outside the forward of "
            f"the module that owns it, e.g. read directly or in a loss term): that gradient would bypass "
            f"per-example clipping. Route every use through the owning module's forward."
            + stale_compilation_note(self._module, owner)
        )

    def _check_known(self, squared: dict[nn.Parameter, torch.Tensor]) -> None:
        param_ids = self._clipping.param_ids
        if all(id(param) in param_ids for param in squared):
            return
        unknown = [name for name, p in self._module.named_parameters() if p in squared and id(p) not in param_ids]
        raise ValueError(
            f"parameters {unknown} were trained but are not held by the clipper (unfrozen after "
            f"attach_clipper?); attach a clipper over every trainable parameter"
        )


def _takes_ownership(clipper) -> bool:
    """Whether ``clipper.accumulate_clipped_sums_`` can keep the sums without copying them (they are
    fresh tensors nobody else holds)."""
    try:
        return "take_ownership" in inspect.signature(clipper.accumulate_clipped_sums_).parameters
    except (TypeError, ValueError):
        return False
