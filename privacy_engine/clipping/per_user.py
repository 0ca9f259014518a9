"""Per-user clipping of a user-level batch: which rows of a backward pass are one user's.

A user-level draw (``privacy_unit="user"``, ``privacy_engine.training.user_sampling``) holds ``k`` rows
per sampled user, one user's rows consecutive; its ticket says which user slot each row is
(``BatchTicket.users``). The clipper then sums a user's per-example gradients and clips the sum once
(``PerSampleGradientClipper.clip_and_accumulate(group_ids=...)``). That bound holds per user only if
all of a user's rows are clipped in the same call: this module gives the clipper the ids of one pass
and refuses a pass that holds part of a user.
"""

from __future__ import annotations

import torch

from privacy_engine.batches.tickets import BatchTicket

__all__ = ["UserSplitError", "user_aligned_size", "user_group_ids"]


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
