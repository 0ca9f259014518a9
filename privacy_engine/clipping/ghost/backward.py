"""The backward side of fast clipping: each gated layer's output gradient turned into per-example
squared norms (and its inputs and ``G`` kept for the sum, or its per-example gradients formed and
kept, whichever is smaller), and at the end of the pass (a callback queued on the autograd engine)
the clip factors from the clipper's rule and each layer's clipped sum ``sum_i f_i g_i``, handed to the
clipper's accumulator.

``BackwardPasses`` is a mixin of ``GhostClippingModule``. It reads and writes ``_passes``
(``uses.GhostPasses``: takes the pending calls, keeps the pass in progress, consumes the padding mask),
reads ``_clipping`` (``uses.ClipperLink``), ``per_sample_memory_ratio``, ``loss_reduction``, ``_module``
and the step binding (``_consumer``, ``_forward_ticket``, ``_check_live``); it tells the
binding that the forward's backward has run (``_backward_finished_by_clipping``), writes ``last_per_sample_norms``
and hands the sums to the clipper. A reentrant checkpoint's recomputation (``capture.recompute``) starts the
pass from the outer backward (``_prepare_recompute_pass``) and adds the recomputed calls' shared parameters
when the nested backward reaches them (``_pass_for_backward``).

User-level passes (``privacy_unit="user"``: the pass's ticket says which ``k`` consecutive rows are one user's,
``clipping.per_user.user_rows``): every norm, clip factor and materialised gradient is per user. A layer whose
norm form accepts stacked users (``Use.stacks_users``: linear maps, embeddings, LayerNorm, attention's
projections) gets the norm of each user's summed gradient from its norm form on the ``(U, k, ...)`` view of its
inputs and output gradient (the cross terms between a user's examples included); any other layer (convolutions,
GroupNorm, the ``torch.func`` fallback, shared parameters, root parameters) forms its per-example gradients and
sums each user's ``k`` rows before the norm. The weighted sums then weight each row by its user's factor:
``sum_u f_u sum_{i in u} g_i``, the users' clipped gradients summed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from privacy_engine.clipping.ghost.batched import STACK_ELEMENTS, RankOneLinearLayers, rank_one_linear
from privacy_engine.clipping.ghost.tied import tied_uses
from privacy_engine.clipping.ghost.uses import (
    BackwardPass,
    Rows,
    Use,
    add_rows,
    check_sampler_result,
    row_numel,
    row_shape,
    shared_parameters,
    zero_rows,
)
from privacy_engine.clipping.per_user import UserRows, user_rows
from privacy_engine.models.validation import module_label

__all__ = ["BackwardPasses"]


class BackwardPasses:
    """Mixin: per-example norms during backward, clipped sums at its end."""

    def _current_pass(self) -> BackwardPass:
        passes = self._passes
        if passes.current is None:
            users = self._users_of_pass()  # raises before the pass starts
            live = passes.unconsumed()
            shared = shared_parameters(live)
            # A weight tied between an embedding and linear maps takes the cross-term form (tied.py), not the
            # materialising one: its (B, V, d) per-example gradients are never formed.
            tied = tied_uses(live, shared)
            if tied is not None:
                shared = shared - tied.parameters
            # Buffers of parameters no longer shared are dropped (the model or its uses changed).
            passes.buffers = {param: buffer for param, buffer in passes.buffers.items() if param in shared}
            passes.current = BackwardPass(shared, passes.buffers)
            passes.current.users = users
            passes.current.tied = tied
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)
        return passes.current

    def _users_of_pass(self) -> UserRows | None:
        """The user layout of the pass about to start (its forward's ticket; None: examples). ``ValueError``
        when the bound optimizer is user-level and the batch is not a user-level draw (each row would be
        clipped alone: a user's rows could add up to ``k`` times the bound), ``UserSplitError`` for a slice
        that cuts a user; both before anything of the pass is kept."""
        ticket = self._forward_ticket if self._consumer is not None else None
        users = user_rows(ticket)
        if users is None and getattr(self._consumer, "privacy_unit", "example") == "user":
            raise ValueError(
                "ghost clipping: a backward pass of no user-level batch reached a user-level optimizer "
                "(privacy_unit='user'): clipped per example, one user's rows could add up to examples_per_user * "
                "max_grad_norm. Nothing was clipped. Run the model (the module make_private returned) on the "
                "batches of its private loader."
            )
        return users

    @staticmethod
    def _per_user(state: BackwardPass, use: Use, per_example: torch.Tensor) -> torch.Tensor:
        """``per_example`` ``(B, ...)`` as the pass keeps it: unchanged for examples, each user's rows summed
        ``(U, ...)`` in a user-level pass (``ValueError`` if the layer saw other rows than the ticket's)."""
        users = state.users
        if users is None:
            return per_example
        if per_example.shape[0] != users.num_rows:
            raise ValueError(
                f"ghost clipping: {module_label(use.path, use.layer)} saw {per_example.shape[0]} examples but the "
                f"user-level batch has {users.num_rows} rows ({users.num_users} users of {users.rows_per_user})"
            )
        return users.sum_rows(per_example)

    def _prepare_recompute_pass(self) -> None:
        """A reentrant checkpoint is recomputing a forward (``capture.recompute``): its gated calls' output
        gradients arrive in a nested backward, whose queued callbacks would run at the nested backward's end.
        Start the pass now, in the outer backward (its end-of-pass callback is queued there), and have the
        recomputed calls' shared parameters added before the nested backward reaches them."""
        self._current_pass()
        self._passes.recomputed = True

    def _pass_for_backward(self) -> BackwardPass:
        """The pass in progress, with the parameters shared by calls a reentrant checkpoint recomputed since
        the last call added to its ``shared`` set (they were not pending when the pass started)."""
        state = self._current_pass()
        if self._passes.recomputed:
            self._passes.recomputed = False
            live = self._passes.unconsumed()
            tied = state.tied
            if tied is not None:
                tied.check_recomputed(live)  # a tied weight's recomputed use must have its factor form too
            newly_shared = shared_parameters([*state.reached, *live]) - state.shared - (tied.parameters if tied else set())
            reduced = [param for param in newly_shared if param in state.squared_norms]
            if reduced:
                names = {p: n for n, p in self._module.named_parameters()}
                raise RuntimeError(
                    f"ghost clipping with reentrant activation checkpointing: parameter(s) "
                    f"{sorted(names.get(p, '?') for p in reduced)} are used by a recomputed checkpoint region and by "
                    f"another use whose backward already ran as unshared (their per-example norms need the cross "
                    f"terms between the uses). Use checkpoint(..., use_reentrant=False) (Hugging Face's default), "
                    f"or grad_sample_mode='hooks'."
                )
            state.shared |= newly_shared
        return state

    def _on_output_grad(self, use: Use, grads: torch.Tensor) -> None:
        # Run once per gated call in every backward: the checks below take their cheap form where their outcome
        # is known (each still runs in full whenever it could refuse).
        self._check_live(use.generation)
        if use.forward_clipped:
            self._refuse_second_pass(use)  # raises
        activations = use.activations
        if activations is None:
            raise RuntimeError(
                f"{module_label(use.path, use.layer)}: a second backward pass ran through the same forward "
                f"(retain_graph=True). Its inputs were freed after the first; run a new forward for each backward."
            )
        passes = self._passes
        state = passes.current
        if state is None or passes.recomputed:  # else _pass_for_backward would return passes.current as it is
            state = self._pass_for_backward()
        use.activations, use.consumed = None, True
        state.reached.append(use)
        if use.grad_shape is not None:
            grads = grads.reshape(use.grad_shape)
        if use.batch_dim != 0:
            grads, activations = self._batch_first(grads, activations, use.batch_dim)
        batch_size = grads.shape[0]
        noted = state.batch
        if noted is None or noted[1] != batch_size:  # else note_batch has nothing to record or refuse
            state.note_batch(use, batch_size)
        if batch_size == 0:
            # An empty (Poisson) batch: no norms, nothing to sum; samplers need not handle it.
            for param, _ in use.parts:
                state.add_squared(param, grads.new_zeros(0))
            return
        # Keep per-example gradients or (inputs, output gradient) until the end of backward, whichever
        # is smaller: when the per-example gradients are the smaller, forming them also costs no more
        # than a norm plus a second weight-gradient product for the sum (the direct form).
        shared = bool(state.shared) and any(param in state.shared for param, _ in use.parts)
        users = state.users
        # Rows kept per materialised gradient: a user-level pass keeps each user's sum.
        kept_rows = batch_size if users is None else users.num_users
        # Loops, not sums over generators (once per gated call): the same integers as row_numel and tensor_bytes.
        element_size = grads.element_size()
        per_sample_numel = 0
        for param, rows in use.parts:
            per_sample_numel += param.numel() if rows is None else row_numel(param, rows)
        per_sample_bytes = kept_rows * element_size * per_sample_numel
        held_bytes = grads.numel() * element_size
        for value in activations:
            if isinstance(value, torch.Tensor):
                held_bytes += value.numel() * value.element_size()
        # A tied weight's uses keep their inputs and G: its cross terms are formed from them (tied.py).
        tied = state.tied is not None and state.tied.touches(use)
        keep_per_sample = not tied and per_sample_bytes <= self.per_sample_memory_ratio * held_bytes
        # A user's norm needs the cross terms between its examples: a norm form that does not take a user's
        # rows stacked cannot give it, so those layers form their per-example gradients and sum them per user.
        no_user_norm_form = users is not None and not use.stacks_users
        if shared or use.norms is None or keep_per_sample or no_user_norm_form:
            per_sample = use.grads(activations, grads)
            if not _whole_per_example_shapes(use.parts, per_sample, batch_size):  # else the check has nothing to refuse
                check_sampler_result("grad", use, per_sample, lambda p, r: (batch_size, *row_shape(p, r)))
            if users is not None:
                per_sample = {param: self._per_user(state, use, value) for param, value in per_sample.items()}
            if shared or keep_per_sample:
                for param, rows in use.parts:
                    state.add_materialised(param, rows, per_sample[param])
                return
            # No (per-user) norm-only form and large per-example gradients: reduce them to norms, free them,
            # and form the sum later from the kept inputs and output gradient.
            for param, _ in use.parts:
                state.add_squared(param, torch.linalg.vector_norm(per_sample[param].reshape(kept_rows, -1), dim=1).square())
            del per_sample
            weighted_sums = use.sums if use.norms is not None else partial(_weighted_sum_by_materialising, use.grads)
            state.deferred.append((use, weighted_sums, activations, grads))
            return
        if use.rank_one_linear and users is None and not tied:
            call = rank_one_linear(use, activations, grads)
            if call is not None:
                # Norm and sum both formed at the end of the pass, with the other rank-one linear calls (batched.py).
                if state.rank_one_linear is None:
                    state.rank_one_linear = RankOneLinearLayers()
                state.rank_one_linear.add(call, state.squared_norms)
                return
        if users is not None:
            if batch_size != users.num_rows:
                self._per_user(state, use, grads)  # raises: the layer saw other rows than the ticket's
            # Each user's k examples as one example: the norm form then sums over all of the user's positions.
            squared = use.norms(tuple(users.stack(a) for a in activations), users.stack(grads))
            check_sampler_result("norm", use, squared, lambda p, r: (users.num_users,))
        else:
            squared = use.norms(activations, grads)
            check_sampler_result("norm", use, squared, lambda p, r: (batch_size,))
        if tied:
            state.tied.add(use, activations, grads, users)  # its cross terms with the weight's other uses
        for param, _ in use.parts:
            state.add_squared(param, squared[param])
        state.deferred.append((use, use.sums, activations, grads))

    def _on_fallback_grad(self, use: Use, param: nn.Parameter, grads: torch.Tensor) -> None:
        self._check_live(use.generation)
        self._refuse_second_pass(use)
        state = self._pass_for_backward()
        if not use.consumed:
            state.reached.append(use)
        use.consumed = True
        state.note_batch(use, grads.shape[0])
        state.add_materialised(param, None, self._per_user(state, use, grads))

    @staticmethod
    def _refuse_second_pass(use: Use) -> None:
        """``RuntimeError`` before anything of the pass is kept when ``use``'s forward already had a backward pass
        clipped (two heads of one forward, two losses, two ``backward()`` calls): each pass clips its examples on
        what that pass reached, so together one example could move the release by up to 2 C. Hooks mode sums the
        passes per example before clipping instead."""
        if use.forward_clipped:
            raise RuntimeError(
                f"{module_label(use.path, use.layer)}: a second backward pass through one forward (ghost clipping). "
                f"An earlier backward already clipped this forward's examples without reaching this layer; clipping "
                f"them again would let one example move the release by up to 2 x max_grad_norm. Nothing of this pass "
                f"was kept. Add the losses and call backward once ((loss_a + loss_b).backward()), or use "
                f"grad_sample_mode='hooks' (which sums the passes per example before clipping)."
            )

    def _mark_forwards_clipped(self, state: BackwardPass) -> None:
        """After a pass was clipped: mark the calls of its forwards that it did not reach (see
        ``_refuse_second_pass``). A call no later backward reaches (an output left out of the loss) is harmless."""
        generations = {use.generation for use in state.reached}
        for use in self._passes.unconsumed():
            if use.generation in generations:
                use.forward_clipped = True

    def _finish_pass(self) -> None:
        try:
            self._clip_pass()
        finally:
            self._passes.drop_pass()

    def _clip_pass(self) -> None:
        self._backward_finished_by_clipping()
        passes, link = self._passes, self._clipping
        state, passes.current = passes.current, None
        padding_mask, passes.padding_mask = passes.padding_mask, None
        if state is None or state.batch is None:
            return
        ticket = self._forward_ticket if self._consumer is not None else None
        if padding_mask is None and ticket is not None and ticket.tracked:
            padding_mask = ticket.mask()  # the mask travels with this pass's own batch
        elif padding_mask is None and link.padding_mask_source is not None:
            padding_mask = link.padding_mask_source()
        clipper = link.clipper
        batch_size = state.batch[1]
        if padding_mask is not None and tuple(padding_mask.shape) != (batch_size,):
            raise ValueError(
                f"padding_mask has shape {tuple(padding_mask.shape)}; expected ({batch_size},), one flag per example"
            )
        if state.users is not None:
            padding_mask = state.users.user_padding(padding_mask)  # norms and factors are per user from here on
        # The output gradients were kept unscaled: fold the loss reduction's factor into norms and weights.
        scale = float(batch_size) if self.loss_reduction == "mean" else 1.0
        # fp16 loss scaling (an attached GradScaler): the output gradients are S times the true ones.
        scale /= clipper.loss_scale() if hasattr(clipper, "loss_scale") else 1.0
        # No graph for what follows (torch.no_grad()'s effect, without its context-manager object: once per pass).
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            norms, plan = self._group_norms_of_pass(state, clipper)
            # Norms are homogeneous: scaling the (unscaled-gradient) norms once equals scaling every G.
            if scale != 1.0:
                norms = norms * scale
            factors = clipper.clip_factors_for_norms(norms, padding_mask=padding_mask)
            # A zero factor does not cancel a NaN/Inf in that example's rows: zero them (only needed
            # when some norm is non-finite, as every entry then shows in its norm).
            drop_non_finite = _may_hold_non_finite(norms)
            weights = factors * scale
            sums = _clipped_sums(state, plan, weights, drop_non_finite)
            # A plain attribute (set in __init__; no parameter, buffer or module of that name): Module.__setattr__'s
            # registration checks have nothing to do.
            object.__setattr__(self, "last_per_sample_norms", norms)
            if link.takes_ownership:
                clipper.accumulate_clipped_sums_(sums, norms, padding_mask=padding_mask, take_ownership=True)
            else:
                clipper.accumulate_clipped_sums_(sums, norms, padding_mask=padding_mask)
            if ticket is not None:
                self._consumer.contract.contributed(ticket)
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        self._mark_forwards_clipped(state)

    def _group_norms_of_pass(self, state: BackwardPass, clipper) -> tuple[torch.Tensor, _GroupPlan]:
        """The per-example group norms ``(batch, num_groups)`` of everything ``state`` gathered, from the
        gradients as kept (the loss reduction's factor and the loss scale not yet applied), and the plan of the
        clipping groups (``clipper.group_index``) of the parameters the pass reached (``_group_plan``)."""
        if state.rank_one_linear is not None:
            state.rank_one_linear.squared_norms(state.squared_norms)  # fills the entries reserved in backward
        squared = dict(state.squared_norms)
        if state.tied is not None:
            state.tied.add_cross_terms(squared)  # and drops the tied uses' factors
        materialised = state.materialised
        # Materialised parameters with no norm yet (the usual case) are reserved at the end, in their order: the
        # flat sum below may then take their norms stacked, without one entry per parameter.
        reserved = bool(materialised) and not any(param in squared for param in materialised)
        if reserved:
            squared.update(dict.fromkeys(materialised))
        elif materialised:
            _add_materialised_squares(squared, materialised)
        plan = self._group_plan(squared, clipper)
        # Summed per clipping group first (one stacked sum, not one indexed add per parameter) and
        # handed over under one member of each group: the clipper adds a group's squares anyway.
        if plan.single_column is not None:
            # One group holding every entry in order (flat clipping): positions are 0..n-1, no list to gather.
            ((first, _),) = plan.groups
            group_square = _flat_square_sum(list(squared.values()), materialised) if reserved else None
            if group_square is None:
                if reserved:
                    _add_materialised_squares(squared, materialised)  # fills the reserved entries
                values = list(squared.values())
                group_square = values[0] if len(values) == 1 else torch.stack(values).sum(dim=0)
            group_squares = {first: group_square}
        else:
            if reserved:
                _add_materialised_squares(squared, materialised)  # fills the reserved entries
            values = list(squared.values())
            group_squares = {
                first: values[positions[0]] if len(positions) == 1 else torch.stack([values[i] for i in positions]).sum(dim=0)
                for first, positions in plan.groups
            }
        return clipper.group_norms_from_squared(group_squares), plan

    def _group_plan(self, squared: dict[nn.Parameter, torch.Tensor], clipper) -> _GroupPlan:
        """The clipping groups of the parameters of ``squared`` (in its order), after ``_check_known`` (a
        parameter outside the clipper raises). Kept per attached clipper (``ClipperLink``, replaced whole by
        ``attach_clipper``) and per sequence of parameters: a pass reaching the same parameters in the same order
        (every step of a fixed model) reuses it instead of one check and one group lookup per parameter. The
        ``id``s in the key cannot be reused by other objects while the plan lives: its ``group_of`` holds each
        parameter, and only parameters that passed both checks are kept."""
        link = self._clipping
        key = tuple(map(id, squared))
        plans = link.group_plans
        plan = plans.get(key)
        if plan is None:
            self._check_known(squared)
            group_of = {param: clipper.group_index(param) for param in squared}
            positions: dict[int, list[int]] = {}
            for position, column in enumerate(group_of.values()):
                positions.setdefault(column, []).append(position)
            params = list(squared)
            plan = _GroupPlan(
                group_of=group_of,
                groups=tuple((params[members[0]], tuple(members)) for members in positions.values()),
                single_column=next(iter(positions)) if len(positions) == 1 else None,
            )
            if len(plans) >= _MAX_GROUP_PLANS:
                plans.clear()  # passes over many different parameter sets: keep the newest only
            plans[key] = plan
        return plan


# torch.promote_types goes through the dispatcher; the pass asks once per materialised parameter for the same dtypes.
_promote_types = functools.cache(torch.promote_types)
#: Group plans kept per clipper link (``_group_plan``): more parameter sets than this in turn and they are rebuilt.
_MAX_GROUP_PLANS = 8


@dataclass(frozen=True)
class _GroupPlan:
    """The clipping groups of the parameters one pass reached, in the order the pass holds them.

    ``group_of``: each parameter's group (column of the norms and factors); read, never changed (it is reused by
    the passes with the same parameters). ``groups``: per group, in order of first appearance, its first
    parameter and the positions of its members. ``single_column``: the column when every parameter is in one
    group (flat clipping), else None."""

    group_of: dict
    groups: tuple
    single_column: int | None


def _whole_per_example_shapes(parts: tuple, per_sample: dict, batch_size: int) -> bool:
    """Whether every part of a call reads its whole parameter and ``per_sample`` holds, for each, a tensor of shape
    ``(batch_size, *param.shape)``: then ``check_sampler_result`` has nothing to refuse (a loop without its
    per-part shape tuples; where this says False, the check itself runs)."""
    for param, rows in parts:
        value = per_sample.get(param)
        if rows is not None or value is None:
            return False
        shape = value.shape
        if not shape or shape[0] != batch_size or shape[1:] != param.shape:
            return False
    return True


def _add_materialised_squares(squared: dict, materialised: dict) -> None:
    """Add each materialised parameter's per-example squared norms (float32 at least) to ``squared``, in the order
    of ``materialised``: added, not assigned, as other (disjoint) row blocks of a parameter may have norms already
    (a reserved entry holds None)."""
    for param, grads in materialised.items():
        # reshape, not flatten(1): a 0-dim parameter's per-example gradients are 1-D.
        value = torch.linalg.vector_norm(
            grads.reshape(grads.shape[0], param.numel()), dim=1, dtype=_promote_types(grads.dtype, torch.float32)
        ).square()
        previous = squared.get(param)
        squared[param] = value if previous is None else previous + value


def _flat_square_sum(values: list, materialised: dict) -> torch.Tensor | None:
    """``torch.stack(values).sum(dim=0)`` once the reserved last ``len(materialised)`` entries of ``values`` hold
    the materialised parameters' squared norms, with those norms taken stacked (``_stacked_norms``): the same
    ``(entries, rows)`` matrix, so the same sum, without one entry per parameter. None (nothing formed) where the
    stacked form does not apply: another device than the CPU, dtypes that the stack would promote, fewer than two
    entries; the caller then fills the entries one by one."""
    first = values[: len(values) - len(materialised)]
    if not first and len(materialised) < 2:
        return None
    norms = _stacked_norms(materialised)
    if norms is None:
        return None
    dtype, rows = norms.dtype, norms.shape[1]
    for value in first:
        if not (type(value) is torch.Tensor and value.dtype == dtype and value.is_cpu and value.shape == (rows,)):
            return None
    squares = norms.square()
    return (torch.cat([torch.stack(first), squares]) if first else squares).sum(dim=0)


def _stacked_norms(materialised: dict) -> torch.Tensor | None:
    """The per-example norms (float32 at least; not squared) of the materialised parameters, ``(parameters,
    rows)`` in the order of ``materialised``, each row the same floats as the parameter's own norm; None unless all
    are on the CPU in one norm dtype with one number of rows.

    Gradients that are contiguous, small (``STACK_ELEMENTS``) and of one shape and dtype are stacked and take one
    norm between them (a model of many small layers materialises dozens per pass): each row is reduced over its own
    contiguous elements exactly as the parameter's own norm reduces it (``tests/test_ghost_batched.py`` checks it
    bit for bit). Any other gradient (a non-contiguous one would be reduced strided) takes its own norm."""
    params, grads_list = list(materialised), list(materialised.values())
    groups: dict = {}  # (shape, dtype) or a position (taken alone) -> positions
    for position, grads in enumerate(grads_list):
        if not grads.is_cpu:
            return None
        key = (grads.shape, grads.dtype) if grads.is_contiguous() and grads.numel() <= STACK_ELEMENTS else position
        members = groups.get(key)
        if members is None:
            groups[key] = [position]
        else:
            members.append(position)
    pieces, order = [], []
    for positions in groups.values():
        grads = grads_list[positions[0]]
        norm_dtype = _promote_types(grads.dtype, torch.float32)
        numel = params[positions[0]].numel()
        if len(positions) == 1:
            # As _add_materialised_squares (reshape, not flatten(1): a 0-dim parameter's gradients are 1-D).
            piece = torch.linalg.vector_norm(grads.reshape(grads.shape[0], numel), dim=1, dtype=norm_dtype).unsqueeze(0)
        else:
            stacked = torch.stack([grads_list[position] for position in positions])
            piece = torch.linalg.vector_norm(
                stacked.reshape(len(positions), grads.shape[0], numel), dim=-1, dtype=norm_dtype
            )
            del stacked
        if pieces and (piece.dtype != pieces[0].dtype or piece.shape[1] != pieces[0].shape[1]):
            return None  # the caller's stack would promote (or refuse) where this cat would not
        pieces.append(piece)
        order.extend(positions)
    norms = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if order != list(range(len(order))):
        rank = [0] * len(order)  # the row of each parameter's norm in ``norms``
        for row, position in enumerate(order):
            rank[position] = row
        norms = norms.index_select(0, torch.tensor(rank))
    return norms


def _may_hold_non_finite(norms: torch.Tensor) -> bool:
    """Whether the rows of examples whose factor is 0 must be zeroed before the sums (True when a norm is
    NaN/Inf: a zero factor does not cancel a NaN/Inf). On CPU the check is free; on another device it would
    wait for the device (a host sync every pass), so there rows are always zeroed where the factor is 0: the same
    sums (those rows add zero either way; at most the sign of an exact zero differs), at the price of one ``where``
    per kept tensor (``tests/test_ghost_batched.py`` checks the equality on CPU, ``tests/test_cuda_paths.py`` on CUDA).

    On CPU the test is one sum (cheaper than ``isfinite(norms).all()``): the sum of the norms is finite only if every
    norm is (a NaN or an Inf never adds up to a finite number), so every non-finite norm is seen; a sum that
    overflows with finite norms (norms near the dtype's largest value) only zeroes rows needlessly."""
    return norms.device.type != "cpu" or not math.isfinite(norms.sum().item())


def _weighted_sum_by_materialising(grad_sampler: Callable, activations: tuple, grads: torch.Tensor, weights: torch.Tensor):
    """``sum_i weights[i] g_i`` through a grad sampler: per-example gradients are linear in the output
    gradient, so those of ``weights[i] * G_i`` summed over examples are the weighted sum."""
    scaled = grads * weights.to(grads.dtype).view(-1, *([1] * (grads.dim() - 1)))
    return {param: per_sample.sum(dim=0) for param, per_sample in grad_sampler(activations, scaled).items()}


def _clipped_sums(state: BackwardPass, plan: _GroupPlan, weights: torch.Tensor, drop_non_finite: bool) -> dict:
    """``{param: sum_i weights[i, group(param)] g_i}`` over the layers ``state`` deferred and the
    per-example gradients it materialised (``weights``: the clip factors times the gradients' scale;
    ``plan``: those parameters' clipping groups, from ``_group_norms_of_pass``). In a
    user-level pass ``weights`` and the materialised gradients are per user, and a deferred layer's rows take
    their user's weight."""
    sums: dict[nn.Parameter, torch.Tensor] = {}
    group_of, single_column = plan.group_of, plan.single_column
    # Each group's weights (and kept rows) are the same for every layer: taken once per pass, not per layer.
    deferred_weights: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def weights_of_column(column: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        cached = deferred_weights.get(column)
        if cached is None:
            column_weights = weights.select(1, column)
            if state.users is not None:
                column_weights = state.users.expand(column_weights)
            cached = deferred_weights[column] = (column_weights, column_weights != 0 if drop_non_finite else None)
        return cached

    deferred, state.deferred = state.deferred, []
    if state.rank_one_linear is not None:
        unbatched: list = []  # (use, activations, G) of calls whose weight and bias sit in different groups
        # Flat clipping with nothing to drop: the (B, 1) weights scale every stack as they are.
        flat = weights if single_column is not None and not drop_non_finite and weights.shape[1] == 1 else None
        state.rank_one_linear.weighted_sums(weights_of_column, sums, group_of, unbatched, single_column, flat)
        deferred.extend((use, use.sums, activations, grads) for use, activations, grads in unbatched)
    deferred.reverse()
    while deferred:
        # Popped one at a time so each layer's inputs and output gradient are freed as soon as
        # its sum exists: the peak stays near the larger of "all of them" and "all the sums".
        use, weighted_sums, activations, grads = deferred.pop()
        if single_column is not None:
            columns = {single_column: use.parts}
        else:
            columns: dict[int, list[tuple[nn.Parameter, Rows]]] = {}
            for param, rows in use.parts:
                columns.setdefault(group_of[param], []).append((param, rows))
        for column, parts in columns.items():
            column_weights, keep = weights_of_column(column)
            column_activations, column_grads = activations, grads
            if drop_non_finite:
                column_activations = tuple(zero_rows(a, keep) for a in activations)
                column_grads = zero_rows(grads, keep)
            result = weighted_sums(column_activations, column_grads, column_weights)
            check_sampler_result("weighted-sum", use, result, row_shape)
            for param, rows in parts:
                add_rows(sums, param, rows, result[param])
        del use, weighted_sums, activations, grads, column_activations, column_grads, result
    materialised, state.materialised = state.materialised, {}
    # Per (column, dtype): the column's weights in the gradients' dtype, when rows must be dropped the kept rows, and
    # the weights as tensordot reshapes them, (1, rows).
    materialised_weights: dict[tuple, tuple] = {}
    # The last (column, dtype) and its entry: consecutive parameters nearly always share both (one lookup saved).
    last_key = last = None
    while materialised:
        param, grads = materialised.popitem()
        column = single_column if single_column is not None else group_of[param]
        key = (column, grads.dtype)
        if key != last_key:
            last = materialised_weights.get(key)
            if last is None:
                column_weights = weights.select(1, column)
                keep = column_weights != 0 if drop_non_finite else None
                column_weights = column_weights.to(grads.dtype)
                row_weights = column_weights.reshape(1, column_weights.shape[0])
                last = materialised_weights[key] = (column_weights, keep, row_weights)
            last_key = key
        column_weights, keep, row_weights = last
        if drop_non_finite:
            grads = zero_rows(grads, keep)
        # _weighted_rows and add_rows (rows None) inlined: once per materialised parameter and pass.
        dim = grads.dim()
        if (
            dim >= 2
            and type(grads) is torch.Tensor
            and type(row_weights) is torch.Tensor
            and 0 < grads.shape[0] == row_weights.shape[1]
        ):
            # What tensordot computes, without its permutes and reshapes: its own mm on its own operands (the weights
            # as (1, rows), the rows flattened as it flattens them), then its result's shape set in place on the
            # fresh (1, n) product (not a view: the clipper keeps it without a detach). The same floats.
            if dim == 2:
                value = torch.mm(row_weights, grads).squeeze_(0)
            else:
                value = torch.mm(row_weights, grads.reshape(grads.shape[0], -1))
                # (resize_ refuses a tensor in a graph: the pass runs without one, so that is only a caller's.)
                value = value.reshape(grads.shape[1:]) if value.requires_grad else value.resize_(grads.shape[1:])
        else:
            value = _weighted_rows(column_weights, grads)
        previous = sums.setdefault(param, value)
        if previous is not value:
            sums[param] = previous + value
        del grads, value, previous
    return sums


def _weighted_rows(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``torch.tensordot(weights, rows, dims=1)`` (``sum_i weights[i] rows[i]``). For plain tensors the op is
    called without ``torch.tensordot``'s Python argument handling (a few microseconds per materialised parameter):
    the same ATen op on the same arguments, so the same result."""
    if type(weights) is torch.Tensor and type(rows) is torch.Tensor and _VF_TENSORDOT is not None:
        return _VF_TENSORDOT(weights, rows, [-1], [0])
    return torch.tensordot(weights, rows, dims=1)


_VF_TENSORDOT = getattr(getattr(torch, "_VF", None), "tensordot", None)
