"""Tensor operations on materialised per-example gradients that the clipper applies: squared norms,
the nan_safe rule for non-finite entries, per-user sums, and the dtypes sums and norms are kept in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "all_finite",
    "expand_rows",
    "finite_entries",
    "norm_dtype",
    "squared_norms",
    "sum_dtype",
    "sum_per_user",
]


def sum_per_user(
    grads_by_index: dict[int, torch.Tensor],
    group_ids: torch.Tensor,
    padding_mask: torch.Tensor | None,
) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    """Per-user gradients ``(users, *shape)`` (examples with equal ``group_ids`` summed, padding
    examples left out) and which users hold only padding examples."""
    _, user_of_example = torch.unique(group_ids, return_inverse=True)
    num_users = int(user_of_example.max().item()) + 1 if group_ids.numel() else 0
    summed = {}
    for index, grads in grads_by_index.items():
        if padding_mask is not None:
            keep = expand_rows(~padding_mask.to(grads.device), grads)
            grads = torch.where(keep, grads, torch.zeros((), dtype=grads.dtype, device=grads.device))
        users = torch.zeros((num_users, *grads.shape[1:]), dtype=grads.dtype, device=grads.device)
        summed[index] = users.index_add_(0, user_of_example.to(grads.device), grads)
    user_padding = None
    if padding_mask is not None:
        real_examples = torch.zeros(num_users, device=padding_mask.device)
        real_examples.index_add_(0, user_of_example.to(padding_mask.device), (~padding_mask).float())
        user_padding = real_examples == 0
    return summed, user_padding


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Clipped sums accumulate in at least float32 (a parameter's own dtype when wider)."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms in at least float32: half-precision squares overflow at 256."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def expand_rows(row_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``(batch,)`` mask viewed as ``(batch, 1, 1, ...)`` to broadcast against ``like``."""
    return row_mask.view(-1, *([1] * (like.dim() - 1)))


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite (no NaN, no ±Inf); one device sync. The tensors must
    be on one device, and at least one (``RuntimeError`` from ``torch.stack`` for none)."""
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def finite_entries(grads: torch.Tensor) -> torch.Tensor:
    """``grads`` with every NaN/±Inf entry replaced by 0 (the nan_safe rule)."""
    return torch.nan_to_num(grads, nan=0.0, posinf=0.0, neginf=0.0)


def squared_norms(params: Sequence[nn.Parameter], grads_by_index: Mapping[int, torch.Tensor]) -> dict:
    """``{param: (batch,) squared L2 norms}`` of each parameter's per-sample gradients."""
    return {
        # reshape, not flatten(1): a 0-dim parameter's per-sample gradients are 1-D.
        params[i]: torch.linalg.vector_norm(g.reshape(len(g), params[i].numel()), dim=1, dtype=norm_dtype(g.dtype)).square()
        for i, g in grads_by_index.items()
    }
