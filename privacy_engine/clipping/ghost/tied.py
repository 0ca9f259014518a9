"""Fast clipping of a weight shared by an embedding and linear maps (a language model's input embedding tied to
its output head: GPT-2's ``wte`` / ``lm_head``, any Hugging Face model with ``tie_word_embeddings``) without
its per-example gradients.

Each such use's per-example gradient of the weight ``W`` (``V x d``) is a sum of outer products over the use's
positions, ``P_i = sum_t l_t r_t^T``:

================  ==============================  ==================================================
use               ``l_t`` (rows, in ``R^V``)       ``r_t`` (columns, in ``R^d``)
================  ==============================  ==================================================
``nn.Embedding``  one-hot of the token ``tok_t``  the output gradient ``e_t`` (0 at ``padding_idx``)
``nn.Linear``     the output gradient ``g_t``     the input ``a_t``
================  ==============================  ==================================================

so the per-example inner product of two uses is ``<P_i, Q_i> = sum_{t,u} <l_t, l'_u> <r_t, r'_u>``: the
entrywise product of a ``T x T'`` row Gram and a ``T x T'`` column Gram, summed. The row Gram is
``[tok_t == tok'_u]`` for two embeddings, ``g'_u[tok_t]`` (a gather) for an embedding and a linear map,
``<g_t, g'_u>`` for two linear maps. The example's squared norm over the weight's ``k`` uses is then

    ||sum_k P^k_i||^2 = sum_k ||P^k_i||^2 + 2 sum_{k<m} <P^k_i, P^m_i>,

each use's own squared norm from its own norm form (the embedding's equal-token form, the linear map's Gram
or direct form), and the clipped sum ``sum_i f_i sum_k P^k_i`` is each use's own weighted sum (a weighted
scatter-add, a weighted matmul), added. Nothing ``(B, V, d)`` is formed.

Which parameters take this form (``tied_uses``): those whose every use in the pass is a whole-weight use of an
``nn.Embedding`` or ``nn.Linear`` with the registered samplers of ``grad_samplers.embedding`` / ``.linear``, at
least one of them an embedding, and none of those uses reading another parameter that is materialised. Any
other sharing (a linear map called twice, attention's row blocks, a fallback module) keeps the materialising
path (``uses.BackwardPass.add_materialised``): where no embedding is involved the per-example gradients are no
larger than the layers' inputs, and forming them is the cheaper exact form.

``TiedUses`` is the pass's state for them (``uses.BackwardPass.tied``): each reached use's factors (the tensors
the use's deferred weighted sum keeps anyway), and the cross terms so far. It lives as long as its pass;
``add_cross_terms`` drops the factors once the norms are known.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from grad_samplers.embedding import embedding_gradient_factors, embedding_norm_sample, embedding_weighted_sum
from grad_samplers.linear import linear_gradient_factors, linear_norm_sample, linear_weighted_sum
from grad_samplers.registry import layer_sampler_for
from privacy_engine.clipping.ghost.uses import Use
from privacy_engine.models.validation import module_label

__all__ = ["TiedUses", "tied_uses"]

# The (examples x T x T') Gram blocks of one cross term are formed for this many elements at a time at most.
_CROSS_BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True, eq=False)
class _Factors:
    """One use's per-example gradient of a tied weight as ``sum_t l_t r_t^T``: ``tokens`` ``(B, T)`` (one-hot
    rows: an embedding) or ``row_grads`` ``(B, T, V)`` (a linear map's output gradient), and ``columns``
    ``(B, T, d)``."""

    tokens: torch.Tensor | None
    row_grads: torch.Tensor | None
    columns: torch.Tensor


def _embedding_factors(layer: nn.Module, activations: tuple, grads: torch.Tensor) -> _Factors:
    tokens, columns = embedding_gradient_factors(layer, activations, grads)
    return _Factors(tokens=tokens, row_grads=None, columns=columns)


def _linear_factors(layer: nn.Module, activations: tuple, grads: torch.Tensor) -> _Factors:
    row_grads, columns = linear_gradient_factors(activations[0], grads)
    return _Factors(tokens=None, row_grads=row_grads, columns=columns)


def _factor_form(use: Use, param: nn.Parameter):
    """The function giving ``use``'s factors of ``param`` (``_embedding_factors`` / ``_linear_factors``), or None
    when ``use`` is not a whole-weight use of an embedding or a linear map with the registered samplers (whose
    norm and weighted-sum forms the tied form adds to)."""
    layer = use.layer
    if use.norms is None or use.sums is None or getattr(layer, "weight", None) is not param:
        return None
    if any(rows is not None for _, rows in use.parts):
        return None
    sampler = layer_sampler_for(layer)
    if sampler is None:
        return None
    if isinstance(layer, nn.Embedding) and (sampler.norm_sample, sampler.weighted_sum) == (
        embedding_norm_sample,
        embedding_weighted_sum,
    ):
        return _embedding_factors
    if isinstance(layer, nn.Linear) and (sampler.norm_sample, sampler.weighted_sum) == (
        linear_norm_sample,
        linear_weighted_sum,
    ):
        return _linear_factors
    return None


def tied_uses(uses: Sequence[Use], shared: set) -> TiedUses | None:
    """The ``TiedUses`` of a pass whose live calls are ``uses`` and whose shared parameters are ``shared``
    (``uses.shared_parameters``), or None when no shared parameter takes the tied form.

    Guarantee: a parameter is returned only if every use of it among ``uses`` has a factor form
    (``_factor_form``), at least one is an embedding, and no such use reads a shared parameter that is not
    returned (that use's per-example gradients would be materialised, the tied weight's among them).

    ==========================================  ===========================================
    case                                        result
    ==========================================  ===========================================
    embedding + linear head on one weight       that weight
    the same, model run twice before backward   that weight (cross terms between all uses)
    a linear map called twice                   not returned (materialised)
    a use through the fallback / row blocks     not returned (materialised)
    ==========================================  ===========================================
    """
    if not shared:
        return None
    # Membership by id, as ``TiedUses._ids``: once per parameter of every live call, at the start of each pass.
    shared_ids = {id(param) for param in shared}
    uses_of: dict[nn.Parameter, list[Use]] = {}
    for use in uses:
        for param, _ in use.parts:
            if id(param) in shared_ids:
                uses_of.setdefault(param, []).append(use)
    candidates = set()
    for param, param_uses in uses_of.items():
        forms = [_factor_form(use, param) for use in param_uses]
        if all(form is not None for form in forms) and any(form is _embedding_factors for form in forms):
            candidates.add(param)
    # A use that also reads a materialised shared parameter is materialised whole: its tied weight cannot be.
    changed = True
    while changed:
        changed = False
        for param in list(candidates):
            if any(other in shared and other not in candidates for use in uses_of[param] for other, _ in use.parts):
                candidates.discard(param)
                changed = True
    return TiedUses(frozenset(candidates)) if candidates else None


class TiedUses:
    """The tied weights of one backward pass (``tied_uses``): each reached use's factors and the cross terms
    between the uses reached so far, per example (unscaled, as the pass keeps its norms)."""

    def __init__(self, parameters: frozenset) -> None:
        self.parameters = parameters
        # Membership by id: what ``param in parameters`` decides (a tensor hashes to its id, and a live object's id
        # is its own), without Tensor.__hash__'s Python call per parameter of every use the pass reaches.
        self._ids = frozenset(map(id, parameters))
        self._factors: dict[nn.Parameter, list[_Factors]] = {}
        self._cross: dict[nn.Parameter, torch.Tensor] = {}

    def touches(self, use: Use) -> bool:
        """Whether ``use`` reads a tied weight (then its norms and sums run as an unshared use's, and ``add``
        gives the cross terms)."""
        ids = self._ids
        for param, _ in use.parts:
            if id(param) in ids:
                return True
        return False

    def add(self, use: Use, activations: tuple, grads: torch.Tensor, users=None) -> None:
        """Record ``use``'s factors of its tied weight (inputs and output gradient batch first, as the pass
        keeps them) and add its cross terms with the uses reached before it. In a user-level pass (``users``:
        ``clipping.per_user.UserRows``) each user's rows are stacked as one example, as the use's norm form
        takes them, so the cross terms are per user."""
        if users is not None:
            activations = tuple(users.stack(a) for a in activations)
            grads = users.stack(grads)
        for param, _ in use.parts:
            if id(param) not in self._ids:
                continue
            form = _factor_form(use, param)
            if form is None:  # the pass decided from the same uses: only a changed model gets here
                raise RuntimeError(
                    f"ghost clipping: {module_label(use.path, use.layer)} changed during a backward pass"
                )
            # Kept in the operands' own dtypes (the use's deferred sum holds the same tensors); promoted to float32
            # at least a block at a time in ``_inner_products``, as the norm forms are (``uses.in_float32``).
            factors = form(use.layer, activations, grads)
            earlier = self._factors.setdefault(param, [])
            for other in earlier:
                cross = _inner_products(other, factors)
                previous = self._cross.get(param)
                self._cross[param] = cross if previous is None else previous + cross
            earlier.append(factors)

    def check_recomputed(self, uses: Iterable[Use]) -> None:
        """``RuntimeError`` if a call recomputed by a reentrant checkpoint reads a tied weight without a factor
        form: the weight's other uses were reduced as tied, so its per-example gradients cannot be formed."""
        for use in uses:
            for param, _ in use.parts:
                if param in self.parameters and _factor_form(use, param) is None:
                    raise RuntimeError(
                        f"ghost clipping with reentrant activation checkpointing: {module_label(use.path, use.layer)} "
                        f"uses a weight tied to an embedding in a recomputed region, with no tied-weight form; use "
                        f"checkpoint(..., use_reentrant=False) (Hugging Face's default), or grad_sample_mode='hooks'."
                    )

    def add_cross_terms(self, squared: dict[nn.Parameter, torch.Tensor]) -> None:
        """Add ``2 sum_{k<m} <P^k_i, P^m_i>`` to each tied weight's summed squared norms in ``squared`` (the
        uses' own squares), clamped at 0 (the exact value is a squared norm; rounding of a sum that cancels
        could go below), and drop the factors: nothing per-example is kept past the norms."""
        self._factors.clear()
        cross, self._cross = self._cross, {}
        for param, value in cross.items():
            total = squared[param] + 2 * value.to(squared[param].dtype)
            squared[param] = total.clamp(min=0)


def _inner_products(first: _Factors, second: _Factors) -> torch.Tensor:
    """``<P_i, Q_i>`` per example ``(B,)``, from the two uses' factors, a block of examples at a time."""
    dtype = _at_least_float32(first.columns.dtype, second.columns.dtype)
    batch_size, first_length = first.columns.shape[:2]
    second_length = second.columns.shape[1]
    block = max(1, _CROSS_BLOCK_ELEMENTS // max(1, first_length * second_length))
    if 0 < batch_size <= block:  # one block (the usual case): the same values, without slices and cat's copy
        return _block_inner_products(first, second, None, dtype)
    results = [
        _block_inner_products(first, second, slice(start, start + block), dtype)
        for start in range(0, batch_size, block)
    ]
    return torch.cat(results) if results else first.columns.new_zeros(0, dtype=dtype)


def _at_least_float32(first: torch.dtype, second: torch.dtype) -> torch.dtype:
    """The wider of two dtypes, float32 at least (``torch.promote_types`` twice, without its dispatches when
    both are float32 or both float64)."""
    if first is second and (first is torch.float32 or first is torch.float64):
        return first
    return torch.promote_types(torch.promote_types(first, second), torch.float32)


def _as(tensor: torch.Tensor, rows: slice | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor[rows].to(dtype)`` (rows None: all; dtype None: its own), each step only when it changes something
    (a full slice and a ``.to`` to the tensor's own dtype return the same values, through one more dispatch)."""
    if rows is not None:
        tensor = tensor[rows]
    if dtype is not None and tensor.dtype is not dtype:
        tensor = tensor.to(dtype)
    return tensor


def _block_inner_products(first: _Factors, second: _Factors, rows: slice | None, dtype: torch.dtype) -> torch.Tensor:
    """``<P_i, Q_i>`` ``(examples,)`` for the examples ``rows`` (None: all), computed in ``dtype``."""
    column_gram = torch.bmm(_as(first.columns, rows, dtype), _as(second.columns, rows, dtype).transpose(1, 2))
    row_gram = _as(_row_gram(first, second, rows), None, dtype)
    if row_gram.is_contiguous():  # a fresh tensor (gather, bmm, or a conversion) laid out as the product would be
        return row_gram.mul_(column_gram).sum(dim=(1, 2))
    return (row_gram * column_gram).sum(dim=(1, 2))


def _row_gram(first: _Factors, second: _Factors, rows: slice | None) -> torch.Tensor:
    """``<l_t, l'_u>`` ``(examples, T, T')`` for the examples ``rows`` (None: all): token equality, a gather of the
    linear map's output gradient at the embedding's tokens, or a batched matmul."""
    if first.tokens is not None and second.tokens is not None:
        return _as(first.tokens, rows).unsqueeze(2) == _as(second.tokens, rows).unsqueeze(1)
    if first.tokens is not None:
        row_grads, tokens = _as(second.row_grads, rows), _as(first.tokens, rows)
        # row_grads[b, u, tokens[b, t]] -> (examples, T', T): transposed to (T, T').
        return torch.gather(row_grads, 2, tokens.unsqueeze(1).expand(-1, row_grads.shape[1], -1)).transpose(1, 2)
    if second.tokens is not None:
        row_grads, tokens = _as(first.row_grads, rows), _as(second.tokens, rows)
        return torch.gather(row_grads, 2, tokens.unsqueeze(1).expand(-1, row_grads.shape[1], -1))
    dtype = _at_least_float32(first.row_grads.dtype, second.row_grads.dtype)
    return torch.bmm(_as(first.row_grads, rows, dtype), _as(second.row_grads, rows, dtype).transpose(1, 2))
