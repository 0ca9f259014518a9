"""Sampling for distributed private training: each rank's part of one global (cyclic) Poisson sample.

``privacy_engine.training.distributed`` builds these for ``make_private`` on a data-parallel model; they can
be used alone as well (give every rank the same ``seed``):

* ``DistributedPoissonBatchSampler``: every example is in exactly one rank's shard; each rank
  Poisson-samples its shard with the *global* rate ``q`` from a stream of its own, so the union
  of the ranks' batches is one Poisson sample of the whole dataset (local batches can be empty).
* ``DistributedCyclicPoissonBatchSampler``: the same ``b`` global groups on every rank (drawn from
  the shared seed), each split into one part per rank; step ``t`` samples group ``t mod b``.
  Truncated (``max_batch_size`` = cap on the global batch): every rank draws the same truncated
  sample of the group and keeps its equal slice, so the steps are the single-process truncated
  mechanism.
* ``DistributedDPDataLoader``: ``DPDataLoader`` over one of these.

Randomness is counter-based: the draws of step ``t`` come from a PCG64 stream keyed by a
SeedSequence of ``(seed, stream, [rank,] t)``, so ranks never drift apart (prefetching, an
interrupted epoch) and ``(seed, next step)`` is the whole sampling state. (Not torch generators:
``manual_seed`` keeps only 32 bits of a seed on CPU, see ``secure_random``; a SeedSequence keeps
all of the seed's bits.) ``secure=True`` (secure mode): each rank's own draws come straight from
the OS (``secure_random.secure_uniform``), the shared truncated draws from a separate seed that
is never written to a state dict (a resumed run agrees on a fresh one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from privacy_engine.noise.secure_random import secure_uniform
from privacy_engine.settings_checks import check_count, check_sample_rate
from privacy_engine.training.data_loader import DPDataLoader, cyclic_sampling_of
from privacy_engine.training.sampling import _DPBatchSampler, _validated_indices

__all__ = [
    "DistributedCyclicPoissonBatchSampler",
    "DistributedDPDataLoader",
    "DistributedPoissonBatchSampler",
    "derived_seed",
]


def derived_seed(seed: int, *key: int) -> int:
    """A 63-bit seed for the stream ``key`` of ``seed``."""
    # SeedSequence gives statistically independent streams per key from one seed (neighbouring
    # integers as seeds would not be).
    sequence = np.random.SeedSequence(entropy=int(seed), spawn_key=tuple(int(k) for k in key))
    return int(sequence.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))



def _check_rank(rank: Any, world_size: Any) -> tuple[int, int]:
    world_size = check_count("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}); got {rank!r}")
    return int(rank), world_size


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, the same on every rank; got {seed!r}")
    return int(seed)


def _stream(seed: int, *key: int) -> np.random.Generator:
    # Counter-based streams: the draws of a step depend on (seed, key, step) only, never on how many
    # draws came before, so ranks cannot drift apart (prefetching, an interrupted epoch) and
    # resuming needs only the step counter.
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy=int(seed), spawn_key=key)))


def _included(members: torch.Tensor, rate: float, uniforms: torch.Tensor) -> torch.Tensor:
    # One float64 uniform per member against the rate: Bernoulli(rate), independent per member.
    return members if rate >= 1.0 else members[uniforms < rate]


_LOCAL_STREAM = 1  # (_LOCAL_STREAM, rank, step): a rank's own draws from its shard
_SHARED_STREAM = 2  # (_SHARED_STREAM, step): the draws every rank makes alike (truncated sampling)
_GROUP_STREAM = 3  # (_GROUP_STREAM,): the cyclic group assignment


class _DistributedSampler(_DPBatchSampler):
    """Common parts: population, rank, the agreed seed and the state of the distributed samplers."""

    kind = ""

    def _setup(self, num_samples: int, sample_rate: float, rank: int, world_size: int, seed: int,
               indices: Any, secure: bool) -> None:  # fmt: skip
        self.num_samples = check_count("num_samples", num_samples)
        self.sample_rate = check_sample_rate(sample_rate)
        self.rank, self.world_size = _check_rank(rank, world_size)
        self.indices = _validated_indices(indices, self.num_samples)
        self.seed = _check_seed(seed)
        self.secure = bool(secure)

    def _local_uniforms(self, step: int, count: int) -> torch.Tensor:
        """This rank's own uniforms for ``step``: OS randomness when secure, else its stream."""
        if self.secure:
            return secure_uniform(count)
        return torch.from_numpy(_stream(self.seed, _LOCAL_STREAM, self.rank, step).random(count))

    @property
    def population(self) -> int:
        """How many examples can be drawn, over all ranks (the index set's size)."""
        return int(self.indices.numel())

    def state_dict(self) -> dict[str, Any]:
        """The agreed seed and the next step: with counter-based streams, that is the whole state.
        Outside secure mode the seed determines which examples were and will be sampled: keep the
        state as secret as the data. In secure mode it fixes only the cyclic groups (the draws come
        from the OS, or from a shared seed that is not saved)."""
        return {"kind": self.kind, "num_samples": self.num_samples, "population": self.population,
                "num_groups": self.num_groups, "rank": self.rank, "world_size": self.world_size,
                "secure": self.secure, "seed": self.seed, "next_step": self._next_step}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {"kind": self.kind, "num_samples": self.num_samples, "population": self.population,
                    "num_groups": self.num_groups, "rank": self.rank, "world_size": self.world_size,
                    "secure": self.secure}  # fmt: skip
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(
                    f"sampling state has {key}={state.get(key)!r} but this sampler has {key}={value!r}: resume with "
                    "the same dataset, grouping and number of ranks (load_distributed_state gives each rank its entry)"
                )
        self.set_seed(_check_seed(state["seed"]))
        self._next_step = int(state["next_step"])

    def set_seed(self, seed: int) -> None:
        self.seed = _check_seed(seed)


class DistributedPoissonBatchSampler(_DistributedSampler):
    """Rank ``rank``'s part of one Poisson sample of the whole dataset.

    Shard: every ``world_size``-th example of the index set (``indices``, default
    ``range(num_samples)``), starting at position ``rank``. Each step includes every shard member
    independently with the *global* rate ``sample_rate`` (float64 uniform < q), from a stream of
    this rank's own: derived from ``(seed, rank, step)`` (``secure``: from the OS), so the ranks
    may share one ``seed``.

    Guarantee: over the ranks, the shards partition the index set, so every example is on exactly
    one rank, and the union of the ranks' batches at a step is a Poisson sample of the index set
    with rate ``q``: each example in with probability q, independently of the others (the ranks'
    streams are independent), of other steps and of the data. Which rank holds an example does
    not matter for privacy: its inclusion probability is q wherever it is.

    ``expected_batch_size`` is the *global* ``q * population`` (what the noisy sum is divided by);
    ``local_expected_batch_size`` is this rank's ``q * len(shard)``.

    ==================================  ==========================================
    case                                result
    ==================================  ==========================================
    empty local batch                   yielded (zero-length through the loader)
    world_size > population             ranks past the end have an empty shard
    rank not in [0, world_size)         ValueError naming rank
    sample_rate not in (0, 1]           ValueError naming sample_rate
    ==================================  ==========================================
    """

    kind = "poisson"
    num_groups = 1
    max_batch_size = None

    def __init__(self, num_samples: int, sample_rate: float, *, rank: int, world_size: int, seed: int,
                 steps: int | None = None, indices: Any = None, secure: bool = False) -> None:  # fmt: skip
        self._setup(num_samples, sample_rate, rank, world_size, seed, indices, secure)
        default_steps = max(1, round(1.0 / self.sample_rate))
        super().__init__(default_steps if steps is None else check_count("steps", steps))
        self.shard = self.indices[self.rank :: self.world_size].clone()

    @property
    def groups(self) -> list[torch.Tensor]:
        """One group, the whole index set (no cycle)."""
        return [self.indices]

    @property
    def expected_batch_size(self) -> float:
        """The *global* ``q * population``, what the noisy sum is divided by (not this rank's share)."""
        return self.sample_rate * self.population

    @property
    def local_expected_batch_size(self) -> float:
        """This rank's share, ``q * len(shard)``; to read only: the noisy sum is divided by the global
        ``expected_batch_size``."""
        return self.sample_rate * self.shard.numel()

    def _draw(self, step: int) -> tuple[list[int], None]:
        uniforms = self._local_uniforms(step, self.shard.numel())
        return _included(self.shard, self.sample_rate, uniforms).tolist(), None

    def __repr__(self) -> str:
        return (f"DistributedPoissonBatchSampler(num_samples={self.num_samples}, population={self.population}, "
                f"sample_rate={self.sample_rate}, rank={self.rank}, world_size={self.world_size}, "
                f"steps={self.steps})")  # fmt: skip


class DistributedCyclicPoissonBatchSampler(_DistributedSampler):
    """Rank ``rank``'s part of cyclic Poisson sampling over ``num_groups`` global groups.

    Groups: as ``CyclicPoissonBatchSampler`` draws them (``public_size=False``: each example picks
    its group uniformly and independently; ``True``: a permutation cut into equal parts), but from
    a stream of ``seed`` alone, so every rank holding the same ``seed`` has the same global groups.
    Step ``t`` samples group ``t mod b`` with rate ``sample_rate``.

    Untruncated: this rank's part of a group is every ``world_size``-th member of it, starting at
    ``rank``, Poisson-sampled from this rank's own stream (``(seed, rank, step)``; ``secure``: the OS).

    Truncated (``max_batch_size``: the cap on the *global* batch, a multiple of ``world_size``;
    each rank's batches have exactly ``max_batch_size / world_size`` entries): every rank draws
    the same truncated Poisson sample of the whole group from the shared stream ``(seed, step)``
    (``secure``: ``(shared_seed, step)``, a seed from rank 0's OS that no state dict holds)
    (Bernoulli draws, then a random subset of at most ``max_batch_size``, padded to exactly
    ``max_batch_size``) and keeps its own slice of ``max_batch_size / world_size`` entries. The
    union of the slices is exactly one single-process truncated sample, so the steps are accounted
    as the single-process truncated event (group size, global cap). Why not let each rank truncate
    its own draw: an example's privacy would then depend on the size of its own rank's part, which
    changes when examples are added or removed, and the truncated epsilon is not monotone in that
    size (dp-accounting, q = 0.1, cap 8, sigma 1, 100 steps: epsilon 14.0 / 24.0 / 17.0 at sizes
    50 / 100 / 200), so no single size would bound every example.

    Guarantee: at step ``t`` only members of global group ``t mod b`` appear on any rank; the
    ranks' batches are disjoint and their union is one (truncated) Poisson sample of that group
    with rate ``sample_rate``, independent of the data; the step counter runs on across epochs,
    so an example's participations are at least ``b`` steps apart.

    ==================================  ==========================================
    case                                result
    ==================================  ==========================================
    num_groups = 1 with max_batch_size  truncated Poisson sampling
    max_batch_size % world_size != 0    ValueError naming max_batch_size
    num_groups > population             ValueError naming num_groups
    empty group / draw                  empty batch (all padding when truncated)
    ==================================  ==========================================
    """

    kind = "cyclic"

    def __init__(self, num_samples: int, num_groups: int, sample_rate: float, *, rank: int, world_size: int,
                 seed: int, steps: int | None = None, public_size: bool = False, max_batch_size: int | None = None,
                 indices: Any = None, secure: bool = False, shared_seed: int | None = None) -> None:  # fmt: skip
        self._setup(num_samples, sample_rate, rank, world_size, seed, indices, secure)
        if secure and max_batch_size is not None and shared_seed is None:
            raise ValueError(
                "secure truncated sampling needs shared_seed: the seed of the draws every rank makes alike, from the "
                "OS of rank 0 and never saved (make_private agrees on one)"
            )
        self.shared_seed = None if shared_seed is None else _check_seed(shared_seed)
        self.num_groups = check_count("num_groups", num_groups)
        if self.num_groups > self.population:
            raise ValueError(f"num_groups={self.num_groups} exceeds the {self.population} examples to sample from")
        self.public_size = bool(public_size)
        self.max_batch_size = None if max_batch_size is None else check_count("max_batch_size", max_batch_size)
        if self.max_batch_size is not None and self.max_batch_size % self.world_size:
            raise ValueError(
                f"max_batch_size={self.max_batch_size} (the cap on the global batch) must be a multiple of "
                f"world_size={self.world_size}: every rank's batch holds max_batch_size / world_size entries"
            )
        default_steps = self.num_groups * max(1, round(1.0 / self.sample_rate))
        super().__init__(default_steps if steps is None else check_count("steps", steps))
        self.set_seed(self.seed)

    def set_seed(self, seed: int) -> None:
        """Take ``seed`` (the same on every rank) and draw the global groups from it."""
        self.seed = _check_seed(seed)
        stream = _stream(self.seed, _GROUP_STREAM)
        population = self.population
        if self.public_size:
            permutation = self.indices[torch.from_numpy(stream.permutation(population))]
            self.groups = list(torch.tensor_split(permutation, self.num_groups))
        else:
            assignment = torch.from_numpy(stream.integers(0, self.num_groups, size=population))
            self.groups = [self.indices[assignment == group] for group in range(self.num_groups)]
        self.local_groups = [group[self.rank :: self.world_size].clone() for group in self.groups]

    def set_shared_seed(self, shared_seed: int) -> None:
        """Secure truncated sampling: the seed of the shared draws (the same on every rank)."""
        self.shared_seed = _check_seed(shared_seed)

    @property
    def local_batch_size(self) -> int | None:
        """Entries of each of this rank's batches when truncated (None otherwise)."""
        return None if self.max_batch_size is None else self.max_batch_size // self.world_size

    @property
    def expected_batch_size(self) -> float:
        """Expected *global* number of real examples per step (before truncation)."""
        return self.sample_rate * self.population / self.num_groups

    def group_of_step(self, step: int) -> int:
        """The group that ``step`` samples from: ``step mod num_groups``, the same on every rank."""
        return step % self.num_groups

    def _draw(self, step: int) -> tuple[list[int], torch.Tensor | None]:
        group = self.group_of_step(step)
        if self.max_batch_size is None:
            members = self.local_groups[group]
            return _included(members, self.sample_rate, self._local_uniforms(step, members.numel())).tolist(), None
        members = self.groups[group]
        stream = _stream(self.shared_seed if self.secure else self.seed, _SHARED_STREAM, step)
        chosen = _included(members, self.sample_rate, torch.from_numpy(stream.random(members.numel())))
        if chosen.numel() > self.max_batch_size:
            chosen = chosen[torch.from_numpy(stream.permutation(chosen.numel())[: self.max_batch_size])]
        real = torch.zeros(self.max_batch_size, dtype=torch.bool)
        real[: chosen.numel()] = True
        filler = int(members[0]) if members.numel() else int(self.indices[0])
        padded = torch.full((self.max_batch_size,), filler, dtype=torch.long)
        padded[: chosen.numel()] = chosen
        width = self.local_batch_size
        mine = slice(self.rank * width, (self.rank + 1) * width)
        return padded[mine].tolist(), ~real[mine]

    def __repr__(self) -> str:
        return (f"DistributedCyclicPoissonBatchSampler(num_samples={self.num_samples}, num_groups={self.num_groups}, "
                f"sample_rate={self.sample_rate}, rank={self.rank}, world_size={self.world_size}, steps={self.steps}, "
                f"public_size={self.public_size}, max_batch_size={self.max_batch_size})")  # fmt: skip


class DistributedDPDataLoader(DPDataLoader):
    """``DPDataLoader`` over this rank's part of a distributed Poisson / cyclic Poisson sample.

    Build it with ``from_data_loader`` from the loader every rank passes (over the whole dataset,
    ``batch_size`` = expected global batch). ``sample_rate`` and ``expected_batch_size`` are the
    global ones; ``state_dict`` is this rank's sampling state (see ``distributed_state`` for the
    whole job's).
    """

    #: The job that built this loader (``privacy_engine.training.distributed``); None when built directly.
    distributed_job: Any = None

    @classmethod
    def from_data_loader(cls, loader: DataLoader, *, rank: int, world_size: int, seed: int,  # type: ignore[override]
                         num_groups: int = 1, max_batch_size: int | None = None, public_size: bool = False,
                         steps: int | None = None, secure: bool = False,
                         shared_seed: int | None = None) -> DistributedDPDataLoader:  # fmt: skip
        """Rank ``rank``'s private loader: ``q = batch_size / len(examples)`` (Poisson) or
        ``p = num_groups * batch_size / len(examples)`` (cyclic; truncated with ``max_batch_size``,
        the cap on the global batch). ``seed``: the same on every rank. The examples are the
        dataset's, or a ``SubsetRandomSampler``'s (``sampling.loader_index_set``).

        ============================  ===========================================
        case                          result
        ============================  ===========================================
        dataset has no __len__        TypeError naming loader.dataset
        loader.batch_size None        ValueError naming loader.batch_size
        num_groups > len(dataset)     ValueError naming num_groups
        batch_size * num_groups > N   ValueError (the rate would exceed 1)
        ============================  ===========================================
        """
        num_samples, num_groups, rate, indices = cyclic_sampling_of(loader, num_groups)
        if num_groups == 1 and max_batch_size is None:
            sampler: _DPBatchSampler = DistributedPoissonBatchSampler(
                num_samples, rate, rank=rank, world_size=world_size, seed=seed, steps=steps, indices=indices,
                secure=secure,
            )  # fmt: skip
        else:
            sampler = DistributedCyclicPoissonBatchSampler(
                num_samples, num_groups, rate, rank=rank, world_size=world_size, seed=seed, steps=steps,
                public_size=public_size, max_batch_size=max_batch_size, indices=indices, secure=secure,
                shared_seed=shared_seed,
            )  # fmt: skip
        return cls(loader.dataset, sampler, **cls._loader_kwargs(loader))

    def state_dict(self) -> dict[str, Any]:
        """This rank's sampling state as of the last yielded batch (seed, next step)."""
        state = self.batch_sampler.state_dict()
        state["next_step"] = self._consumed_steps
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s state (this rank's); ``ValueError`` if it was saved by another
        rank, number of ranks, dataset or grouping."""
        self.batch_sampler.load_state_dict(state)
        self._consumed_steps = int(state["next_step"])
