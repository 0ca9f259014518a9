"""User-level sampling: Poisson sampling over users, ``k`` examples per sampled user
(``make_private(privacy_unit="user")``).

* ``UserPoissonBatchSampler``: every step includes every *user* independently with probability ``q``;
  each included user contributes its next ``examples_per_user`` examples (``batches.users.UserCycles``:
  cycling through the user's examples, optionally in a shuffled order, as JAX Privacy's
  ``UserSelectionStrategy``). The loader's ticket of each batch carries the user slot of every row
  (``BatchTicket.users``), so the optimizer clips each user's summed gradient once
  (``clipping.per_user``).
* ``user_level_loader``: a ``DPDataLoader`` over a plain loader's dataset with that sampler;
  ``distributed_user_level_loader``: one DDP rank's part of it (``make_private`` on a DDP model).

Accounting: one step is the Poisson-subsampled Gaussian of DP-SGD with the user as the unit: rate ``q``
over users, sensitivity ``max_grad_norm`` per user (a user's clipped sum), noise ``sigma * max_grad_norm``.
With correlated noise over ``b`` cyclic groups (BandMF, BLT) the users are split into ``b`` groups
(``num_groups``) and the run is that mechanism's event with the user as the unit.
Adding or removing one user (all of their examples) is the neighbouring relation it protects.

Under DDP (``rank``, ``world_size``) user ``u`` belongs to rank ``u mod world_size``: each rank Poisson-samples
its own users at the *global* rate from a generator of its own, so all of a user's rows are on one rank (its
sum is clipped there once), and the union of the ranks' batches is one Poisson sample of the users at rate
``q``: the single-process event.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from privacy_engine.batches.users import UserAssignment, UserCycles, user_assignment
from privacy_engine.noise.secure_random import SecureGenerator, is_secure_generator, secure_permutation, secure_randint
from privacy_engine.settings_checks import check_count, check_sample_rate
from privacy_engine.training.data_loader import DPDataLoader, loader_index_set
from privacy_engine.training.distributed_sampling import derived_seed
from privacy_engine.training.sampling import _bernoulli_members, _DPBatchSampler, _validated_generator

__all__ = ["UserPoissonBatchSampler", "assignment_for_loader", "distributed_user_level_loader", "user_level_loader"]

_USER_STREAM = 4  # derived_seed(seed, _USER_STREAM, rank): a DDP rank's user sampling (distributed_sampling uses 1-3)


class UserPoissonBatchSampler(_DPBatchSampler):
    """Batches of Poisson-sampled users, ``examples_per_user`` rows per sampled user.

    Guarantee: in every step, every user of ``assignment`` is included independently with probability
    ``sample_rate`` (a float64 uniform < q from ``generator``, or from the OS for a secure generator),
    independently of other steps and of the data. An included user contributes exactly ``k =
    examples_per_user`` rows, all its own examples, consecutive in the batch: its next ``k`` in its
    cycle (its examples in increasing index order, or in one uniformly random order per user drawn at
    construction with ``shuffle=True``; a user owning fewer than ``k`` has some repeated). No other user's
    data influences which rows a user contributes. ``take_row_users(step)`` gives the user slot of each row.

    Cyclic Poisson sampling over users (``num_groups = b > 1``, BandMF): every user picks one of ``b`` groups
    uniformly and independently at construction (so adding or removing a user moves no other user), and step
    ``t`` samples only the users of group ``t mod b``, each with probability ``sample_rate``: a user's
    participations are at least ``b`` steps apart over the whole run (the step counter runs on across epochs),
    what BandMF's amplified analysis assumes, with the user as the unit.

    The cycle positions follow the batches the loader yielded: draws prefetched but never yielded are
    drawn afresh (the same step counter rule as the other samplers), and ``state_dict`` saves the positions
    of the last yielded batch, so a resume continues every user's cycle exactly.

    ``len(sampler)`` is ``steps`` (default ``b * round(1 / sample_rate)``: each user once per epoch in
    expectation).

    DDP (``world_size > 1``): this rank samples only its users, ``u mod world_size == rank`` (the cyclic groups
    are drawn for every user, but only the owner's draw is used), each at the global ``sample_rate``; give each
    rank a generator of its own (independent streams). ``expected_batch_size`` stays the global ``q * users /
    b``, what the all-reduced noisy sum is divided by.

    ==============================  ============================================
    case                            result
    ==============================  ============================================
    sample_rate = 1                 every user in every batch
    sample_rate <= 0 or > 1         ValueError naming sample_rate
    examples_per_user < 1           ValueError naming examples_per_user
    num_groups > users              ValueError naming num_groups
    rank not in [0, world_size)     ValueError naming rank
    an empty cyclic group           an empty batch at its steps
    no user sampled                 an empty batch (noise alone is released)
    ==============================  ============================================
    """

    max_batch_size = None
    saves_own_state = True

    def __init__(
        self,
        assignment: UserAssignment,
        sample_rate: float,
        *,
        examples_per_user: int = 1,
        shuffle: bool = False,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        num_groups: int = 1,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.world_size = check_count("world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, world_size={self.world_size}); got {rank!r}")
        self.rank = int(rank)
        if not isinstance(assignment, UserAssignment):
            raise TypeError(f"assignment must be a batches.users.UserAssignment; got {type(assignment).__name__}")
        self.assignment = assignment
        self.sample_rate = check_sample_rate(sample_rate)
        self.examples_per_user = check_count("examples_per_user", examples_per_user)
        self.shuffle = bool(shuffle)
        self.generator = _validated_generator(generator)
        examples_by_user = assignment.examples_by_user()
        if self.shuffle:
            secure = is_secure_generator(self.generator)
            examples_by_user = [
                e[secure_permutation(e.numel()) if secure else torch.randperm(e.numel(), generator=self.generator)]
                for e in examples_by_user
            ]
        self.cycles = UserCycles(examples_by_user)
        self.num_groups = check_count("num_groups", num_groups)
        if self.num_groups > self.cycles.num_users:
            raise ValueError(f"num_groups={self.num_groups} exceeds the {self.cycles.num_users} users: use at most as "
                             "many cyclic groups (bands) as users")  # fmt: skip
        users = torch.arange(self.cycles.num_users)
        if self.num_groups == 1:
            self.groups = [users]  # no draw: plain Poisson sampling over users
        else:
            if is_secure_generator(self.generator):
                group_of_user = secure_randint(self.num_groups, users.numel())
            else:
                group_of_user = torch.randint(self.num_groups, (users.numel(),), generator=self.generator)
            self.groups = [users[group_of_user == group] for group in range(self.num_groups)]
        # DDP: this rank's users only (every user on exactly one rank).
        self._local_groups = [g[g % self.world_size == self.rank] for g in self.groups]
        # Positions as of the last batch the loader yielded; per drawn step, (row users, positions after it).
        self._committed = self.cycles.positions.clone()
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        default_steps = self.num_groups * max(1, round(1.0 / self.sample_rate))
        super().__init__(default_steps if steps is None else check_count("steps", steps))

    @property
    def num_users(self) -> int:
        """How many users can be sampled."""
        return self.cycles.num_users

    @property
    def population(self) -> int:
        """The sampled units: users."""
        return self.num_users

    @property
    def expected_batch_size(self) -> float:
        """``q * users / b``: the expected number of users per batch, what the noisy sum is divided by."""
        return self.sample_rate * self.num_users / self.num_groups

    def group_of_step(self, step: int) -> int:
        """The cyclic group of users that global step ``step`` samples from."""
        return step % self.num_groups

    def __iter__(self):
        if self._recording:
            # The loader restarts from its last yielded batch: so do the cycles.
            self.cycles.positions = self._committed.clone()
            self._pending.clear()
        return super().__iter__()

    def _draw(self, step: int) -> tuple[list[int], None]:
        users = _bernoulli_members(self._local_groups[self.group_of_step(step)], self.sample_rate, self.generator)
        indices, row_users = self.cycles.take(users, self.examples_per_user)
        if self._recording:
            self._pending[step] = (row_users, self.cycles.positions.clone())
        return indices.tolist(), None

    def take_row_users(self, step: int) -> torch.Tensor:
        """The user slot of each row of the batch of step ``step``, which the loader is yielding now; the
        cycle positions after it become the ones saved and restarted from."""
        row_users, positions = self._pending.pop(step)
        self._committed = positions
        return row_users

    def state_dict(self) -> dict[str, Any]:
        """The users' cycles (orders and positions as of the last yielded batch), the cyclic groups of users and
        the next step."""
        cycles = self.cycles.state_dict()
        cycles["positions"] = self._committed.clone()
        return {"user_cycles": cycles, "user_groups": [g.clone() for g in self.groups], "next_step": self._next_step,
                "rank": self.rank, "world_size": self.world_size}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``; ``ValueError`` (nothing changed) if it holds other users, or was saved
        by another DDP rank or number of ranks (its generator would then be that rank's: two ranks drawing the
        same uniforms would include their users together, not independently)."""
        cycles = state.get("user_cycles") if isinstance(state, dict) else None
        if not cycles:
            raise ValueError("the loader state holds no user cycles: it was not saved from user-level sampling")
        saved_by = (state.get("rank", 0), state.get("world_size", 1))
        if saved_by != (self.rank, self.world_size):
            raise ValueError(
                f"the loader state was saved by rank {saved_by[0]} of {saved_by[1]}; this is rank {self.rank} of "
                f"{self.world_size}: give each rank its own saved state (user-level DDP: one state per rank)"
            )
        groups = state.get("user_groups")
        members = torch.cat([torch.as_tensor(g, dtype=torch.long) for g in groups]) if groups else None
        if (
            members is None
            or len(groups) != self.num_groups
            or not torch.equal(members.sort().values, torch.arange(self.num_users))
        ):
            raise ValueError(
                f"the loader state's cyclic groups of users are not {self.num_groups} groups of this "
                f"loader's {self.num_users} users: make_private with the settings of the saved run"
            )
        self.cycles.load_state_dict(cycles)  # checks everything before it changes anything
        self.groups = [torch.as_tensor(g, dtype=torch.long).clone() for g in groups]
        self._local_groups = [g[g % self.world_size == self.rank] for g in self.groups]
        self._committed = self.cycles.positions.clone()
        self._next_step = int(state["next_step"])

    def __repr__(self) -> str:
        return (
            f"UserPoissonBatchSampler(users={self.num_users}, num_groups={self.num_groups}, sample_rate={self.sample_rate}, "
            f"examples_per_user={self.examples_per_user}, shuffle={self.shuffle}, steps={self.steps}"
            + (f", rank={self.rank}, world_size={self.world_size})" if self.world_size > 1 else ")")
        )


def assignment_for_loader(loader: DataLoader, user_ids: Sequence[Any] | Callable[[int], Any]) -> UserAssignment:
    """The users of the examples ``loader`` draws from (its ``SubsetRandomSampler``'s split, else the whole
    dataset; other samplers refused as for Poisson sampling): see ``batches.users.user_assignment``."""
    indices = loader_index_set(loader)
    return user_assignment(user_ids, len(loader.dataset), indices)


def user_level_loader(
    loader: DataLoader,
    assignment: UserAssignment,
    *,
    examples_per_user: int = 1,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
    steps: int | None = None,
    num_groups: int = 1,
    rank: int = 0,
    world_size: int = 1,
) -> DPDataLoader:
    """A ``DPDataLoader`` over ``loader``'s dataset (and its collate_fn, workers, ...) that samples users:
    ``loader.batch_size`` is the expected number of *users* per batch (each with ``examples_per_user`` rows),
    so ``q = batch_size / users``, or with ``num_groups = b`` cyclic groups (BandMF) ``q = b * batch_size /
    users`` within the step's group. ValueError naming the batch size when ``q`` would exceed 1. ``rank`` /
    ``world_size``: this DDP rank's part (its users, see ``UserPoissonBatchSampler``); ``batch_size`` stays
    the global expected number of users."""
    batch_size = loader.batch_size
    if batch_size is None or isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
        raise ValueError(
            "data_loader.batch_size is None: build the loader with batch_size = the expected users per batch"
        )
    num_groups = check_count("num_groups", num_groups)
    if batch_size * num_groups > assignment.num_users:
        raise ValueError(
            f"data_loader.batch_size={batch_size} (times {num_groups} cyclic groups) exceeds the {assignment.num_users} "
            f"users: with privacy_unit='user' the batch size is the expected number of users per batch (q = batch_size "
            f"* groups / users must be <= 1)"
        )
    sampler = UserPoissonBatchSampler(
        assignment, batch_size * num_groups / assignment.num_users, examples_per_user=examples_per_user,
        shuffle=shuffle, steps=steps, generator=generator, num_groups=num_groups, rank=rank, world_size=world_size,
    )  # fmt: skip
    return DPDataLoader(loader.dataset, sampler, **DPDataLoader._loader_kwargs(loader))


def distributed_user_level_loader(
    loader: DataLoader,
    assignment: UserAssignment,
    job: Any,
    *,
    examples_per_user: int = 1,
    shuffle: bool = False,
    steps: int | None = None,
    num_groups: int = 1,
    secure: bool = False,
) -> DPDataLoader:
    """This DDP rank's user-level loader (``make_private(privacy_unit="user")`` on a DDP model; collective: every
    rank calls it). ``job``: this rank's ``training.distributed_job.DistributedJob``.

    Guarantee: user ``u`` is sampled only by rank ``u mod world_size``, at the global rate, from a stream of
    that rank's own (rank 0's seed, broadcast, keyed by rank; ``secure``: the OS), so the ranks' draws are
    independent and their union is the single-process Poisson sample of users: each rank clips its users' sums,
    the all-reduced sum plus rank 0's noise is the single-process release, accounted as the same event.
    ``expected_batch_size`` and ``sample_rate`` are the global ones. Checkpoints of this loader are this rank's
    state (``state_dict``); ``training.distributed.distributed_state`` does not take it.
    """
    if secure:
        generator: torch.Generator = SecureGenerator()
    else:
        proposal = job.sampling_seed if job.sampling_seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        seed = job.broadcast_int(proposal, "make_private agreeing on the user sampling seed")
        generator = torch.Generator().manual_seed(derived_seed(seed, _USER_STREAM, job.rank))
    private = user_level_loader(loader, assignment, examples_per_user=examples_per_user, shuffle=shuffle,
                                generator=generator, steps=steps, num_groups=num_groups, rank=job.rank,
                                world_size=job.world_size)  # fmt: skip
    private.distributed_job = job
    job.loader_step = lambda: private.batch_sampler._next_step - 1  # the step of the batch last drawn
    return private
