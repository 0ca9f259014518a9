"""Users: which user each example belongs to, and which of a sampled user's examples a step holds.

User-level privacy protects everything one user contributed (all of their examples), so the unit that
is sampled, clipped and accounted is the user. This module holds the part of that data path that
needs no randomness and no training code:

* ``user_assignment``: the user of every example the loader draws from, from ``user_ids`` (a sequence
  aligned with the dataset, or a function of the dataset index), as dense numbers ``0..U-1``;
* ``UserCycles``: each user's examples in a fixed order and where the user is in it; a sampled user
  contributes its next ``k`` examples, cycling (JAX Privacy's ``UserSelectionStrategy`` semantics).

The Poisson draw over users is the sampler's (``privacy_engine.training.user_sampling``); the clipping
of a user's summed gradient is the clipper's (``privacy_engine.clipping.per_user``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["UserAssignment", "UserCycles", "user_assignment"]


@dataclass(frozen=True, eq=False)
class UserAssignment:
    """The users of the examples a loader draws from.

    ``examples``: the dataset indices that can be drawn (``(N,)``, int64); ``user_of_example``: the dense
    user number (``0..num_users-1``) of each of them, in the same order; ``user_labels``: the user id
    given for each dense number (sorted).
    """

    examples: torch.Tensor
    user_of_example: torch.Tensor
    user_labels: tuple[Any, ...]

    @property
    def num_users(self) -> int:
        """How many distinct users own at least one example that can be drawn."""
        return len(self.user_labels)

    def examples_by_user(self) -> list[torch.Tensor]:
        """For each dense user, its dataset indices in increasing index order (a stable grouping)."""
        order = torch.argsort(self.user_of_example, stable=True)
        counts = torch.bincount(self.user_of_example, minlength=self.num_users)
        return list(torch.split(self.examples[order], counts.tolist()))


def _user_id_of(value: Any, where: str) -> Any:
    """A user id as a plain hashable, sortable value: an int (numpy/torch integers too) or a str."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise TypeError(f"user_ids: the user id of {where} is {value!r} ({type(value).__name__}); use an int or a str")
    return int(value) if isinstance(value, numbers.Integral) else value


def user_assignment(
    user_ids: Sequence[Any] | torch.Tensor | np.ndarray | Callable[[int], Any],
    num_samples: int,
    indices: torch.Tensor | None = None,
) -> UserAssignment:
    """The user of every example that can be drawn.

    ``user_ids``: a sequence (list, tuple, array, tensor) of ``num_samples`` ids, ``user_ids[i]`` the user
    of dataset example ``i``; or a function called once per drawable index, ``user_ids(i)``. An id is an
    int or a str; equal ids are one user. ``indices``: the dataset indices that can be drawn (a
    ``SubsetRandomSampler``'s split), None for all ``range(num_samples)``.

    Guarantee: two examples get the same dense user number exactly when their ids are equal; the dense
    numbers follow the sorted ids, so the assignment does not depend on the order of the examples.

    ===================================  =============================================
    case                                 result
    ===================================  =============================================
    a sequence of another length         ValueError naming user_ids and both lengths
    an id that is not an int / str       TypeError naming the example
    ints and strs mixed                  TypeError (ids must sort)
    neither a sequence nor a callable    TypeError naming user_ids
    a str (one id, not a sequence)       TypeError naming user_ids
    ===================================  =============================================
    """
    examples = torch.arange(num_samples) if indices is None else torch.as_tensor(indices, dtype=torch.long).flatten()
    if isinstance(user_ids, (str, bytes)):
        raise TypeError("user_ids is a str: give one user id per example (a sequence) or a function of the index")
    if callable(user_ids) and not isinstance(user_ids, (torch.Tensor, np.ndarray)):
        ids = [_user_id_of(user_ids(int(i)), f"example {int(i)}") for i in examples.tolist()]
    elif isinstance(user_ids, (Sequence, torch.Tensor, np.ndarray)):
        if len(user_ids) != num_samples:
            raise ValueError(
                f"user_ids has {len(user_ids)} entries but the dataset has {num_samples} examples: give one user "
                f"id per dataset example (user_ids[i] is example i's user), or a function of the index"
            )
        if isinstance(user_ids, torch.Tensor):
            user_ids = user_ids.detach().cpu().numpy()
        ids = [_user_id_of(user_ids[i], f"example {i}") for i in examples.tolist()]
    else:
        raise TypeError(
            f"user_ids must be a sequence with one user id per dataset example, or a function of the dataset "
            f"index; got {type(user_ids).__name__}"
        )
    if len({type(v) for v in ids}) > 1:
        raise TypeError("user_ids mixes ints and strs; use one kind of id")
    labels = sorted(set(ids))
    number = {label: n for n, label in enumerate(labels)}
    user_of_example = torch.tensor([number[v] for v in ids], dtype=torch.long)
    return UserAssignment(examples=examples, user_of_example=user_of_example, user_labels=tuple(labels))


class UserCycles:
    """Each user's examples in a fixed order, and the position each user has reached in it.

    ``take(users, k)`` gives, for every user in ``users`` (in that order), the user's next ``k`` examples of
    its order, cycling: a user owning ``[0, 5, 10]`` contributes ``0, 5`` then ``10, 0`` then ``5, 10`` with
    ``k = 2``, and ``5, 5`` for a user owning only ``[5]``. This is JAX Privacy's
    ``UserSelectionStrategy`` (its ``examples_per_user_per_batch``): exactly ``k`` rows per sampled user,
    an example repeated when the user owns fewer than ``k``. The order is fixed at construction (already
    shuffled by the caller if wanted) and a user's position moves only when the user is sampled.

    Guarantee (what user-level privacy needs): the rows given for a user are that user's own examples
    only, and the rows of one user are consecutive; which examples they are depends only on how often
    the user was sampled before, never on other users' data.

    ======================  =========================================================
    case                    result
    ======================  =========================================================
    k < 1                   ValueError naming examples_per_user
    a user with no example  ValueError at construction (every user owns one at least)
    users empty             no rows
    ======================  =========================================================
    """

    def __init__(self, examples_by_user: Sequence[torch.Tensor]) -> None:
        counts = torch.tensor([len(e) for e in examples_by_user], dtype=torch.long)
        if counts.numel() == 0 or int(counts.min()) < 1:
            raise ValueError("every user must own at least one example (and there must be at least one user)")
        self.counts = counts
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
        self.flat = torch.cat([torch.as_tensor(e, dtype=torch.long) for e in examples_by_user])
        #: The position in its order of each user's next example.
        self.positions = torch.zeros(len(counts), dtype=torch.long)

    @property
    def num_users(self) -> int:
        """How many users there are."""
        return int(self.counts.numel())

    def take(self, users: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, row_users)``: the dataset indices of ``k`` examples of each user in ``users``, user by
        user, and for every row the position of its user in ``users`` (``0..len(users)-1``). Advances the
        positions of those users by ``k``."""
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"examples_per_user must be an int >= 1; got {k!r}")
        users = torch.as_tensor(users, dtype=torch.long).flatten()
        if users.numel() == 0:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        counts = self.counts[users][:, None]
        steps = torch.arange(k, dtype=torch.long)[None, :]
        positions = (self.positions[users][:, None] + steps) % counts
        indices = self.flat[self.offsets[users][:, None] + positions]
        self.positions[users] = (self.positions[users] + k) % self.counts[users]
        row_users = torch.arange(users.numel(), dtype=torch.long).repeat_interleave(k)
        return indices.reshape(-1), row_users

    def _per_user_sorted(self, flat: torch.Tensor) -> torch.Tensor:
        """Each user's examples sorted within the user (the orders compared as sets, user by user)."""
        owner = torch.arange(self.num_users).repeat_interleave(self.counts)
        span = int(flat.max()) + 1 if flat.numel() else 1
        return torch.sort(owner * span + flat).values

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The orders and positions (plain tensors): a resume continues every user's cycle where it was."""
        return {"counts": self.counts.clone(), "flat": self.flat.clone(), "positions": self.positions.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; ``ValueError`` (nothing changed) if it holds other users or examples."""
        counts = torch.as_tensor(state["counts"], dtype=torch.long)
        flat = torch.as_tensor(state["flat"], dtype=torch.long)
        positions = torch.as_tensor(state["positions"], dtype=torch.long)
        if (
            not torch.equal(counts, self.counts)
            or flat.shape != self.flat.shape
            or not torch.equal(self._per_user_sorted(flat), self._per_user_sorted(self.flat))
        ):
            raise ValueError("the saved user cycles hold other users or examples than this sampler's")
        if positions.shape != self.positions.shape or bool((positions < 0).any()) or bool((positions >= counts).any()):
            raise ValueError("the saved user positions do not fit the users' example counts")
        self.flat, self.positions = flat.clone(), positions.clone()
