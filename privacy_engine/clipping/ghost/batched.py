"""Fast clipping's rank-one linear calls, done across layers at the end of a pass.

An ``nn.Linear`` called on a batch of vectors (inputs ``A`` of shape ``(B, in)``, output gradient ``G`` of shape
``(B, out)``) has per-example gradients ``G_i (x) A_i`` and ``G_i``: squared norms ``||G_i||^2 ||A_i||^2`` and
``||G_i||^2``, clipped sum ``(w G)^T A`` and ``sum_i w_i G_i``. Per layer these are a handful of torch calls on
small tensors, and on a deep narrow model that dispatch is most of the step. Here such calls are only
*kept* during backward (``RankOneLinear``), and at the end of the pass the calls of one shape, dtype, device and
set of trained parameters are stacked (``(L, B, in)``, ``(L, B, out)``) and handled together: one norm per
operand for all of them, one scaling, one transpose, then one ``mm`` per layer on views of the stacks.

Bit-identical to the per-layer samplers (``grad_samplers.linear``'s rank-one norm and weighted-sum forms): each
operation reduces each example's row exactly as the per-layer call does (a norm over the last, contiguous dim;
``mm`` on views laid out as the per-layer call's operands; elementwise products), and
``tests/test_ghost_batched.py`` checks the equality bit for bit. Only contiguous float32/float64 operands are
kept here; anything else (half precision, a non-contiguous gradient, inputs of rank > 2, user-level passes, a
layer whose weight and bias are clipped in different groups) goes through the per-layer samplers.

Layers larger than ``STACK_ELEMENTS`` per call are not copied into a stack (their dispatch cost is small next to
their arithmetic): they are handled one by one, through the same code on ``unsqueeze(0)`` views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from privacy_engine.clipping.ghost.uses import Use

__all__ = ["RankOneLinear", "RankOneLinearLayers", "rank_one_linear"]

#: A call with more than this many elements in ``A`` and ``G`` together is not copied into a stack.
STACK_ELEMENTS = 1 << 15

_DTYPES = (torch.float32, torch.float64)


@dataclass(eq=False)
class RankOneLinear:
    """One rank-one ``nn.Linear`` call reached in backward: its use, inputs ``(B, in)``, output gradient
    ``(B, out)`` (both contiguous, one float dtype, unscaled), and its trained weight and bias (None: frozen)."""

    use: Use
    inputs: torch.Tensor
    grads: torch.Tensor
    weight: nn.Parameter | None
    bias: nn.Parameter | None


def rank_one_linear(use: Use, activations: tuple, grads: torch.Tensor) -> RankOneLinear | None:
    """``use``'s call as a ``RankOneLinear`` when this module computes it exactly as the per-layer samplers
    would (see the module docstring), else None."""
    if len(activations) != 1:
        return None
    inputs = activations[0]
    if not (
        isinstance(inputs, torch.Tensor)
        and inputs.dim() == 2
        and grads.dim() == 2
        and inputs.dtype == grads.dtype
        and grads.dtype in _DTYPES
        and inputs.device == grads.device
        and inputs.is_contiguous()
        and grads.is_contiguous()
    ):
        return None
    # The layer's registered weight and bias from its parameter dict (``layer.weight`` is nn.Module.__getattr__, a
    # Python call, here up to three per call); the parts are the layer's trainable registered parameters.
    own = use.layer._parameters
    layer_weight, layer_bias = own.get("weight"), own.get("bias")
    weight = bias = None
    for param, rows in use.parts:
        if rows is not None:
            return None
        if param is layer_weight:
            weight = param
        elif param is layer_bias:
            bias = param
        else:
            return None
    return RankOneLinear(use, inputs, grads, weight, bias)


class _Stack:
    """Calls of one shape, dtype, device and set of trained parameters, stacked: ``inputs`` ``(L, B, in)``,
    ``grads`` ``(L, B, out)``; a single call's own ``(B, in)`` and ``(B, out)`` (no copy, no per-layer views)."""

    def __init__(self, calls: list[RankOneLinear]) -> None:
        self.calls = calls
        self.single = len(calls) == 1
        if self.single:
            self.inputs, self.grads = calls[0].inputs, calls[0].grads
        else:
            self.inputs = torch.stack([call.inputs for call in calls])
            self.grads = torch.stack([call.grads for call in calls])

    def _each(self, stacked: torch.Tensor):
        """The calls' slices of ``stacked`` (views), in the order of ``calls``."""
        return (stacked,) if self.single else stacked.unbind(0)

    def squared_norms(self, squared_norms: dict) -> None:
        """Write each call's weight and bias squared norms ``(B,)`` into ``squared_norms`` (unscaled)."""
        first = self.calls[0]
        # As linear_squared_norms' one-position form: ||G||^2 serves the bias and, times ||A||^2, the weight.
        grad_squares = torch.linalg.vector_norm(self.grads, dim=-1).square()
        if first.weight is not None:
            input_squares = torch.linalg.vector_norm(self.inputs, dim=-1).square()
            for call, value in zip(self.calls, self._each(grad_squares * input_squares)):
                squared_norms[call.weight] = value
        if first.bias is not None:
            for call, value in zip(self.calls, self._each(grad_squares)):
                squared_norms[call.bias] = value

    def weighted_sums(
        self,
        weights: torch.Tensor | None,
        columns: list[torch.Tensor] | None,
        sums: dict,
        flat: torch.Tensor | None = None,
    ) -> None:
        """Add each call's ``sum_i weights[l, i] g_i`` into ``sums`` (``weights``: ``(L, B)`` or ``(1, B)``, the
        calls' clipping columns (``(B,)`` for a single call); ``columns``: each call's column as the clipper's
        factors hold it (a strided view under per-layer clipping, which ``mv`` may round differently from a
        contiguous copy); rows to drop already zero in the operands). ``flat``: instead of both, the pass's
        ``(B, 1)`` weights when every call is in their one column: they scale the operands as they are (the same
        products as the column's ``(1, B, 1)`` view) and the column is their ``select(1, 0)``."""
        first = self.calls[0]
        inputs, grads = self.inputs, self.grads
        in_features, out_features = inputs.shape[-1], grads.shape[-1]
        if flat is None:
            per_example = (weights if weights.dtype == grads.dtype else weights.to(grads.dtype)).unsqueeze(-1)
        else:
            per_example = flat if flat.dtype == grads.dtype else flat.to(grads.dtype)
        has_weight = first.weight is not None
        # As linear_weighted_sums: scale whichever operand is narrower (same products, same rounding).
        scale_grads = out_features <= in_features or not has_weight
        if scale_grads:
            grads = grads * per_example
        else:
            inputs = inputs * per_example
        transposed = grads.transpose(-2, -1)  # each call's slice laid out as the per-layer G^T
        # add_rows(sums, param, None, value) inlined (twice per call, every pass): the same dict update, with one
        # lookup (a parameter's hash is a Python call) when the parameter has no sum yet (the usual case).
        if has_weight:
            mm = torch.mm
            for call, left, right in zip(self.calls, self._each(transposed), self._each(inputs)):
                param, value = call.weight, mm(left, right)
                previous = sums.setdefault(param, value)
                if previous is not value:
                    sums[param] = previous + value
        if first.bias is not None:
            if scale_grads:
                bias_sums = self._each(transposed.sum(dim=-1))
            else:  # the gradients were left unscaled: weight each example's row, as the per-layer form does
                if flat is not None:
                    columns = [flat.select(1, 0)] * len(self.calls)
                bias_sums = [
                    torch.mv(left, column if column.dtype == grads.dtype else column.to(grads.dtype))
                    for left, column in zip(self._each(transposed), columns)
                ]
            for call, value in zip(self.calls, bias_sums):
                param = call.bias
                previous = sums.setdefault(param, value)
                if previous is not value:
                    sums[param] = previous + value


class RankOneLinearLayers:
    """The rank-one linear calls of one backward pass (``BackwardPass.rank_one_linear``): kept during backward,
    their norms and clipped sums formed at its end. Holds per-example data until ``weighted_sums`` has run (or
    the pass is dropped)."""

    def __init__(self) -> None:
        self.calls: list[RankOneLinear] = []
        self._stacks: list[_Stack] = []

    def add(self, call: RankOneLinear, squared_norms: dict) -> None:
        """Keep ``call``; its parameters' entries in ``squared_norms`` are reserved now (None), so that the
        end of the pass reads every parameter's norm in the order backward reached it."""
        self.calls.append(call)
        for param, _ in call.use.parts:
            squared_norms[param] = None

    def squared_norms(self, squared_norms: dict) -> None:
        """Fill the reserved entries of ``squared_norms`` with the kept calls' per-example squared norms."""
        groups: dict[tuple, list[RankOneLinear]] = {}
        for call in self.calls:
            inputs, grads = call.inputs, call.grads
            if inputs.numel() + grads.numel() > STACK_ELEMENTS:
                self._stacks.append(_Stack([call]))
                continue
            key = (inputs.shape, grads.shape, grads.dtype, grads.device, call.weight is None, call.bias is None)
            groups.setdefault(key, []).append(call)
        self.calls = []
        self._stacks.extend(_Stack(calls) for calls in groups.values())
        for stack in self._stacks:
            stack.squared_norms(squared_norms)

    def weighted_sums(
        self,
        column_weights,
        sums: dict,
        group_of: dict,
        fallback: list,
        single_column: int | None = None,
        flat: torch.Tensor | None = None,
    ) -> None:
        """Add every call's clipped sum into ``sums``. ``column_weights(column) -> (weights (B,), keep (B,) or
        None)``: a clipping column's weights and, when rows must be dropped, the rows to keep. A call whose
        weight and bias sit in different columns is appended to ``fallback`` as ``(use, inputs, grads)`` for the
        per-layer samplers. ``single_column``: the column of every parameter in ``group_of`` when the caller
        knows they all share one (flat clipping): each stack is then taken whole, without a lookup per call.
        ``flat``: the weights ``(B, 1)`` when, besides, they have that one column and no row is dropped: each stack
        is then scaled by them as they are (``_Stack.weighted_sums``), without a column taken and reshaped per stack."""
        stacks, self._stacks = self._stacks, []
        if flat is not None:
            while stacks:
                stack = stacks.pop()
                stack.weighted_sums(None, None, sums, flat)
                del stack
            return
        while stacks:
            stack = stacks.pop()
            if single_column is not None:
                column, keep = column_weights(single_column)
                weights = column
                if not stack.single:
                    weights = column.unsqueeze(0)
                    keep = None if keep is None else keep.unsqueeze(0)
                if keep is not None:
                    mask = keep.unsqueeze(-1)  # as below
                    stack.inputs = torch.where(mask, stack.inputs, 0.0)
                    stack.grads = torch.where(mask, stack.grads, 0.0)
                stack.weighted_sums(weights, [column] * len(stack.calls), sums)
                del stack
                continue
            calls = []
            for call in stack.calls:
                columns = {group_of[param] for param, _ in call.use.parts}
                if len(columns) == 1:
                    calls.append((call, columns.pop()))
                else:
                    fallback.append((call.use, (call.inputs,), call.grads))
            if not calls:
                continue
            if len(calls) < len(stack.calls):
                stack = _Stack([call for call, _ in calls])
            columns = [column for _, column in calls]
            pairs = [column_weights(column) for column in columns]
            if all(column == columns[0] for column in columns):
                weights, keep = pairs[0]
                if not stack.single:
                    weights = weights.unsqueeze(0)
                    keep = None if keep is None else keep.unsqueeze(0)
            else:
                weights = torch.stack([weights for weights, _ in pairs])
                keep = None if pairs[0][1] is None else torch.stack([keep for _, keep in pairs])
            if keep is not None:
                # As zero_rows: a zero factor does not cancel a NaN/Inf in the example's rows.
                mask = keep.unsqueeze(-1)
                stack.inputs = torch.where(mask, stack.inputs, 0.0)
                stack.grads = torch.where(mask, stack.grads, 0.0)
            stack.weighted_sums(weights, [weights for weights, _ in pairs], sums)
            del stack
