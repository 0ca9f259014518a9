"""Per-user clipping of a user-level batch: which rows of a backward pass are one user's.

A user-level draw (``privacy_unit="user"``, ``privacy_engine.training.user_sampling``) holds ``k`` rows
per sampled user, one user's rows consecutive; its ticket says which user slot each row is
(``BatchTicket.users``). The clipper then sums a user's per-example gradients and clips the sum once
(``PerSampleGradientClipper.clip_and_accumulate(group_ids=...)``). That bound holds per user only if
all of a user's rows are clipped in the same call: this module gives the clipper the ids of one pass
and refuses a pass that holds part of a user.

Fast clipping (``grad_sample_mode="ghost"``) never forms a user's summed gradient: ``user_rows`` gives the
layout of a pass (``UserRows``: ``U`` users of ``k`` consecutive rows), and ``stacks_users`` says for which
layers a user's norm is the layer's norm form applied to the user's ``k`` examples stacked as one example
(``clipping.ghost.backward``; the other layers' per-example gradients are formed and summed per user).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from grad_samplers.embedding import embedding_norm_sample
from grad_samplers.linear import linear_norm_sample
from grad_samplers.normalization import normalization_norm_sample
from privacy_engine.batches.tickets import BatchTicket

__all__ = ["UserRows", "UserSplitError", "stacks_users", "user_aligned_size", "user_group_ids", "user_rows"]


class UserSplitError(ValueError):
    """A backward pass holds only part of a user's rows (a micro-batch boundary inside a user)."""


def user_group_ids(ticket: BatchTicket) -> torch.Tensor | None:
    """The ``group_ids`` to clip the rows of ``ticket`` with: each row's user slot in its draw; None for an
    example-level batch (each example clipped on its own).

    Guarantee: when ids are returned, every user with a row among the ticket's rows has all of its rows of
    the draw there, so the clipper's sum per id is the user's whole contribution to the step and its clip
    bounds the user's contribution (never one bound per micro-batch).

    ==========================================  =============================================
    case                                        result
    ==========================================  =============================================
    ticket without users (examples)             None
    the whole draw, or a slice on user bounds   the slots of the rows (``(rows,)``, int64)
    a slice that cuts a user's rows             ``UserSplitError`` naming the rows; nothing is
                                                clipped (cut batches into a multiple of
                                                ``examples_per_user`` rows)
    ==========================================  =============================================
    """
    users = ticket.users
    if users is None:
        return None
    start, end = ticket.rows
    cut_at_start = 0 < start < users.numel() and bool(users[start - 1] == users[start])
    cut_at_end = 0 < end < users.numel() and bool(users[end - 1] == users[end])
    if cut_at_start or cut_at_end:
        raise UserSplitError(
            f"rows [{start}, {end}) of a user-level batch of {users.numel()} rows cut one user's rows in two: that "
            f"user's examples would be clipped once per micro-batch (up to twice the bound for one user). Nothing "
            f"was clipped. Cut batches into a multiple of examples_per_user rows (every sampled user has exactly "
            f"that many consecutive rows); VirtualSteps does so itself."
        )
    return users[start:end].to(torch.long)


def user_aligned_size(ticket: BatchTicket | None, max_size: int) -> int:
    """The largest micro-batch size at most ``max_size`` that never cuts a user of ``ticket``'s draw: a
    multiple of the rows each sampled user has (``examples_per_user``); ``max_size`` itself for an
    example-level batch (or no ticket, or an empty draw). ``VirtualSteps`` splits logical batches with it.

    ==========================================  =============================================
    case                                        result
    ==========================================  =============================================
    example-level batch / no ticket             ``max_size``
    user-level, ``max_size >= k``               ``k * (max_size // k)``
    user-level, ``max_size < k``                ``ValueError``: a user's rows must fit in one
                                                micro-batch (raise max_physical_batch_size)
    ==========================================  =============================================
    """
    if ticket is None or ticket.users is None or ticket.users.numel() == 0:
        return max_size
    rows_per_user = int(torch.bincount(ticket.users).max())
    if max_size < rows_per_user:
        raise ValueError(
            f"max_physical_batch_size={max_size} is smaller than the {rows_per_user} rows (examples_per_user) each "
            f"sampled user has: a user's rows are clipped together and must fit in one micro-batch. Use "
            f"max_physical_batch_size >= examples_per_user."
        )
    return rows_per_user * (max_size // rows_per_user)


@dataclass(frozen=True)
class UserRows:
    """The rows of one backward pass of a user-level batch: ``num_users`` users of ``rows_per_user`` consecutive
    rows each (what ``UserPoissonBatchSampler`` draws: exactly ``k = examples_per_user`` rows per sampled user).

    Rows ``u * k .. u * k + k - 1`` are user ``u``'s. ``stack``, ``sum_rows`` and ``expand`` move between a
    ``(U * k, ...)`` row tensor and its ``(U, ...)`` per-user form.
    """

    num_users: int
    rows_per_user: int

    @property
    def num_rows(self) -> int:
        """``U * k``: the rows of the pass."""
        return self.num_users * self.rows_per_user

    def stack(self, value):
        """A ``(U * k, ...)`` tensor as ``(U, k, ...)``: each user's rows as one example with one more axis of
        positions; anything else (a non-tensor input, a tensor without the rows in front) unchanged."""
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == self.num_rows:
            return value.reshape(self.num_users, self.rows_per_user, *value.shape[1:])
        return value

    def sum_rows(self, value: torch.Tensor) -> torch.Tensor:
        """``(U * k, ...)`` -> ``(U, ...)``: each user's rows summed (a user's per-example gradients -> its
        gradient)."""
        return value.reshape(self.num_users, self.rows_per_user, *value.shape[1:]).sum(dim=1)

    def expand(self, per_user: torch.Tensor) -> torch.Tensor:
        """``(U, ...)`` -> ``(U * k, ...)``: each user's value repeated on each of its rows."""
        return per_user.repeat_interleave(self.rows_per_user, dim=0)

    def user_padding(self, padding_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padding mask of the users ``(U,)`` from that of the rows ``(U * k,)``: a user is padding when all
        of its rows are. ``ValueError`` if a user has padding and non-padding rows (its norm would mix them)."""
        if padding_mask is None:
            return None
        by_user = padding_mask.reshape(self.num_users, self.rows_per_user)
        padding = by_user.all(dim=1)
        if bool((by_user.any(dim=1) & ~padding).any()):
            raise ValueError(
                "a padding mask flags some but not all rows of a user: a user's rows are clipped together, so "
                "mark all of them or none"
            )
        return padding


def user_rows(ticket: BatchTicket | None) -> UserRows | None:
    """The ``UserRows`` of the rows ``ticket`` holds; None for an example-level batch (or no ticket).

    Guarantee: when a layout is returned, its users are exactly the ticket's users, each with all of its rows
    of the draw (``user_group_ids``), consecutive and as many for every user.

    ==========================================  =============================================
    case                                        result
    ==========================================  =============================================
    no ticket / example-level batch             None
    user-level rows, ``k`` each, consecutive    ``UserRows(U, k)``
    no rows (no user sampled)                   ``UserRows(0, 1)``
    a slice that cuts a user                    ``UserSplitError`` (``user_group_ids``)
    users with unequal or scattered rows        ``ValueError`` (not a user-level draw)
    ==========================================  =============================================
    """
    if ticket is None:
        return None
    ids = user_group_ids(ticket)
    if ids is None:
        return None
    if ids.numel() == 0:
        return UserRows(0, 1)
    runs, counts = torch.unique_consecutive(ids, return_counts=True)
    if runs.unique().numel() != runs.numel() or bool((counts != counts[0]).any()):
        raise ValueError(
            "the rows of a user-level batch are not k consecutive rows per user (what UserPoissonBatchSampler "
            "draws): per-user norms in ghost mode need that layout"
        )
    return UserRows(int(runs.numel()), int(counts[0]))


def stacks_users(layer: nn.Module, norm_sampler: Callable | None) -> bool:
    """Whether ``norm_sampler`` (``layer``'s registered norm form) gives a user's squared norm when called on
    the user's ``k`` examples stacked as one example (``UserRows.stack``: inputs and output gradients
    ``(U, k, ...)``), so that fast clipping needs no per-example gradient for a user's norm.

    Guarantee: True only for forms whose per-example gradient is a sum over every axis between the batch and
    the layer's feature axes (each position treated alike): a linear map (``nn.Linear``, HF ``Conv1D``:
    ``A_u^T G_u`` over the user's ``k * T`` positions, Gram or direct form), an embedding (its rows looked up
    at the user's positions), ``nn.LayerNorm`` / ``nn.RMSNorm`` (normalised over trailing axes only). The
    user's gradient is then the sum of its examples' gradients, exactly. False for every other form
    (convolutions, GroupNorm, InstanceNorm, a plugin's sampler): their per-example gradients are formed and
    summed per user instead.
    """
    if norm_sampler is linear_norm_sample or norm_sampler is embedding_norm_sample:
        return True
    return norm_sampler is normalization_norm_sample and type(layer) in (nn.LayerNorm, nn.RMSNorm)
