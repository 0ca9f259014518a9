"""Batch samplers for private training (the loader that uses them is ``data_loader.DPDataLoader``).

* ``PoissonBatchSampler``: every step includes every example independently with probability
  ``q`` (the sampling DP-SGD's amplification analysis assumes). Batches vary in size and can be
  empty.
* ``CyclicPoissonBatchSampler``: the examples are split once into ``b`` groups; step ``t``
  Poisson-samples (probability ``p``) from group ``t mod b`` only, so an example's participations
  are at least ``b`` steps apart (what BandMF with ``b`` bands needs, Choquette-Choo et al. 2023,
  arXiv:2306.08153). With ``max_batch_size`` it truncates (random subset) and pads every batch
  to exactly ``max_batch_size``, recording which entries are padding.

* ``ShuffledBatches``: no sampler of ours; the fixed-size batches of the user's own loader
  (``poisson_sampling=False``), and how a release of several of them is accounted.

Randomness comes from a ``torch.Generator`` (``None``: torch's global generator); sampling uses
float64 uniforms, so inclusion probabilities are exact to 2**-53.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from privacy_engine.noise.secure_random import is_secure_generator, secure_permutation, secure_randint, secure_uniform
from privacy_engine.settings_checks import check_count, check_sample_rate

__all__ = ["CyclicPoissonBatchSampler", "PoissonBatchSampler", "ShuffledBatches"]


def _validated_generator(generator: Any) -> torch.Generator | None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError("generator must be a CPU torch.Generator: sampling runs on the CPU")
    return generator


def _validated_indices(indices: Any, num_samples: int) -> torch.Tensor:
    """The index set to sample from: ``range(num_samples)`` by default, else distinct valid indices."""
    if indices is None:
        return torch.arange(num_samples)
    values = torch.as_tensor(list(indices) if not isinstance(indices, torch.Tensor) else indices).flatten()
    if values.is_floating_point() or values.dtype == torch.bool:
        raise ValueError(f"indices must be integers; got dtype {values.dtype}")
    values = values.to(torch.long)
    if values.numel() < 1:
        raise ValueError("indices is empty: there is nothing to sample")
    if int(values.min()) < 0 or int(values.max()) >= num_samples:
        raise ValueError(f"indices must lie in [0, {num_samples}) (the dataset's size)")
    if torch.unique(values).numel() != values.numel():
        raise ValueError("indices repeats an index; each example must appear once in the index set")
    return values


def _bernoulli_members(members: torch.Tensor, rate: float, generator: torch.Generator | None) -> torch.Tensor:
    # One float64 uniform per member, compared with the rate: inclusion is Bernoulli(rate),
    # independent across members and steps, and never looks at the data.
    if rate >= 1.0:
        return members
    if is_secure_generator(generator):  # secure mode: 53-bit uniforms straight from the OS
        uniforms = secure_uniform(members.numel())
    else:
        uniforms = torch.rand(members.numel(), generator=generator, dtype=torch.float64)
    return members[uniforms < rate]


class _DPBatchSampler(Sampler[list[int]]):
    """Common state: the step counter and the per-batch records ``DPDataLoader`` consumes."""

    num_groups: int
    max_batch_size: int | None
    #: Whether the loader's ``state_dict`` holds this sampler's own ``state_dict()`` (user-level sampling's
    #: cycles); the Poisson and cyclic samplers' state is written by the loader itself.
    saves_own_state: bool = False

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._next_step = 0
        # (step, padding_mask, entries) per drawn batch, filled only while a DPDataLoader is attached
        # (otherwise direct iteration would grow it without bound).
        self._records: collections.deque[tuple[int, torch.Tensor | None, int]] = collections.deque()
        self._recording = False
        #: Seed ``generator`` by one draw from torch's global generator at the first batch drawn (``seed_lazily``).
        self.seed_pending = False

    def seed_lazily(self, source: torch.Generator | None = None) -> None:
        """Seed this sampler's own generator by one draw from ``source`` (``None``: torch's global generator)
        when the first batch is drawn, not now: ``torch.manual_seed`` called after the loader is built (after ``make_private``) still
        makes the batches repeat, while the generator stays the sampler's own (its state is checkpointed and
        other users of the global generator do not shift the batches once it is seeded). ``ValueError`` for a
        sampler with no own generator (``None``: the global one) or a secure one (OS randomness, never seeded)."""
        generator = getattr(self, "generator", None)
        if generator is None or is_secure_generator(generator):
            raise ValueError("seed_lazily needs the sampler's own torch.Generator (not None, not a secure one)")
        if source is generator:
            raise ValueError("seed_lazily: the source must not be the sampler's own generator")
        self._seed_source = source
        self.seed_pending = True

    def __len__(self) -> int:
        return self.steps

    def _draw(self, step: int) -> tuple[list[int], torch.Tensor | None]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[int]]:
        start = self._next_step
        for step in range(start, start + self.steps):
            if self.seed_pending:
                source = getattr(self, "_seed_source", None)
                self.generator.manual_seed(int(torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=source).item()))
                self.seed_pending = False
            indices, padding_mask = self._draw(step)
            self._next_step = step + 1
            if self._recording:
                self._records.append((step, padding_mask, len(indices)))
            yield indices

    def group_of_step(self, step: int) -> int:
        """The group that global step ``step`` samples from (0 without cyclic groups)."""
        return 0

    def take_row_users(self, step: int) -> torch.Tensor | None:
        """Called by the loader when it yields the batch of global step ``step``: the user slot of each of
        its rows for a user-level sampler (``user_sampling.UserPoissonBatchSampler``); None here (examples)."""
        return None


class PoissonBatchSampler(_DPBatchSampler):
    """Batches of a Poisson-subsampled dataset.

    Guarantee: in every step, every index of the index set (``indices``, default
    ``range(num_samples)``) is included independently with probability ``sample_rate`` (float64
    uniform < q), independently of other steps and of the data; no other index is ever drawn.
    Batch sizes are Binomial(len(indices), q), so batches vary and can be empty.

    ``len(sampler)`` is ``steps`` (default ``round(1 / sample_rate)``: one epoch in
    expectation); each ``iter`` draws that many batches.

    ==========================  ==================================
    case                        result
    ==========================  ==================================
    sample_rate = 1             every index in every batch
    sample_rate <= 0 or > 1     ValueError naming sample_rate
    num_samples < 1             ValueError naming num_samples
    steps < 1                   ValueError naming steps
    generator None              torch's global generator
    indices out of range/dups   ValueError naming indices
    ==========================  ==================================
    """

    num_groups = 1
    max_batch_size = None

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        *,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        indices: Any = None,
    ) -> None:
        self.num_samples = check_count("num_samples", num_samples)
        self.sample_rate = check_sample_rate(sample_rate)
        self.generator = _validated_generator(generator)
        self.indices = _validated_indices(indices, self.num_samples)
        default_steps = max(1, round(1.0 / self.sample_rate))
        super().__init__(default_steps if steps is None else check_count("steps", steps))

    @property
    def population(self) -> int:
        """How many examples can be drawn (the index set's size)."""
        return int(self.indices.numel())

    @property
    def expected_batch_size(self) -> float:
        """``q * population``: what the noisy sum is divided by (never the realised batch size)."""
        return self.sample_rate * self.population

    def _draw(self, step: int) -> tuple[list[int], None]:
        return _bernoulli_members(self.indices, self.sample_rate, self.generator).tolist(), None

    def __repr__(self) -> str:
        return (
            f"PoissonBatchSampler(num_samples={self.num_samples}, sample_rate={self.sample_rate}, "
            f"steps={self.steps})"
        )


class CyclicPoissonBatchSampler(_DPBatchSampler):
    """Cyclic Poisson sampling: ``num_groups`` fixed groups, step ``t`` samples group ``t mod b``.

    The examples (of the index set ``indices``, default all) are split into ``b = num_groups``
    groups once, at construction:

    * ``public_size=False`` (default): every example picks its group uniformly and
      independently, so adding or removing one example changes no other example's group: the
      assignment the amplified BandMF analysis assumes under add/remove adjacency.
    * ``public_size=True``: a uniformly random permutation cut into ``b`` contiguous parts of
      equal size (sizes differ by at most one). Adding one example changes how the others are
      split, so this is only valid under replace-one adjacency (the dataset size is public);
      the accountants here report add/remove epsilons.

    Guarantee: at global step ``t`` only members of group ``t mod b`` can appear, each included
    independently with probability ``sample_rate`` (independent of other steps and of the data).
    The step counter runs on across epochs (``iter`` calls), so every example's participations
    are at least ``b`` steps apart over the whole run. Through ``DPDataLoader``, the counter
    counts batches actually yielded: batches prefetched by workers but never yielded are drawn
    afresh next epoch, so discarded draws never shorten a separation.

    Truncation (``max_batch_size``): if more than ``max_batch_size`` members are drawn, a
    uniformly random subset of ``max_batch_size`` is kept; every batch is padded to exactly
    ``max_batch_size`` with the group's first member (index 0 if the group is empty), and the
    batch's ``padding_mask`` (True = padding) marks those entries, which the optimizer must
    drop. Accounting must then treat the mechanism as truncated Poisson sampling.

    ``len(sampler)`` is ``steps`` (default ``b * round(1 / sample_rate)``: each example is
    sampled once per epoch in expectation).

    ==========================  ==========================================
    case                        result
    ==========================  ==========================================
    num_groups = 1              Poisson sampling (optionally truncated)
    num_groups > num_samples    ValueError naming num_groups
    sample_rate not in (0, 1]   ValueError naming sample_rate
    empty group (private size)  empty batch (all padding when truncated)
    max_batch_size < 1          ValueError naming max_batch_size
    ==========================  ==========================================
    """

    def __init__(
        self,
        num_samples: int,
        num_groups: int,
        sample_rate: float,
        *,
        steps: int | None = None,
        public_size: bool = False,
        generator: torch.Generator | None = None,
        max_batch_size: int | None = None,
        indices: Any = None,
    ) -> None:
        self.num_samples = check_count("num_samples", num_samples)
        self.num_groups = check_count("num_groups", num_groups)
        self.indices = _validated_indices(indices, self.num_samples)
        if self.num_groups > self.indices.numel():
            raise ValueError(
                f"num_groups={self.num_groups} exceeds the dataset size {self.num_samples}: every "
                "group needs examples; use at most as many groups (bands) as examples"
            )
        self.sample_rate = check_sample_rate(sample_rate)
        self.generator = _validated_generator(generator)
        self.public_size = bool(public_size)
        self.max_batch_size = (
            None if max_batch_size is None else check_count("max_batch_size", max_batch_size)
        )
        default_steps = self.num_groups * max(1, round(1.0 / self.sample_rate))
        super().__init__(default_steps if steps is None else check_count("steps", steps))
        population = self.indices.numel()
        if self.public_size:
            secure = is_secure_generator(self.generator)
            order = secure_permutation(population) if secure else torch.randperm(population, generator=self.generator)
            permutation = self.indices[order]
            self.groups = list(torch.tensor_split(permutation, self.num_groups))
        else:
            if is_secure_generator(self.generator):
                assignment = secure_randint(self.num_groups, population)
            else:
                assignment = torch.randint(self.num_groups, (population,), generator=self.generator)
            self.groups = [self.indices[assignment == group] for group in range(self.num_groups)]

    @property
    def population(self) -> int:
        """How many examples can be drawn (the index set's size)."""
        return int(self.indices.numel())

    @property
    def expected_batch_size(self) -> float:
        """Expected number of real (non-padding) examples per batch before truncation."""
        return self.sample_rate * self.population / self.num_groups

    def group_of_step(self, step: int) -> int:
        """The group that global step ``step`` samples from."""
        return step % self.num_groups

    def _draw(self, step: int) -> tuple[list[int], torch.Tensor | None]:
        members = self.groups[self.group_of_step(step)]
        chosen = _bernoulli_members(members, self.sample_rate, self.generator)
        if self.max_batch_size is None:
            return chosen.tolist(), None
        if chosen.numel() > self.max_batch_size:
            if is_secure_generator(self.generator):
                keep = secure_permutation(chosen.numel())[: self.max_batch_size]
            else:
                keep = torch.randperm(chosen.numel(), generator=self.generator)[: self.max_batch_size]
            chosen = chosen[keep]
        padding = self.max_batch_size - chosen.numel()
        filler = int(members[0]) if members.numel() else 0
        indices = chosen.tolist() + [filler] * padding
        padding_mask = torch.zeros(self.max_batch_size, dtype=torch.bool)
        padding_mask[chosen.numel() :] = True
        return indices, padding_mask

    def state_dict(self) -> dict[str, Any]:
        """Group membership and the next step: resuming with it keeps the min-separation."""
        return {"groups": [g.clone() for g in self.groups], "next_step": self._next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s groups and step; ``ValueError`` if it holds another number of
        groups or examples."""
        groups = [torch.as_tensor(g, dtype=torch.long) for g in state["groups"]]
        if len(groups) != self.num_groups or sum(g.numel() for g in groups) != self.population:
            raise ValueError(
                "state has another number of groups or examples than this sampler; build the "
                "sampler with the same num_samples and num_groups"
            )
        self.groups = groups
        self._next_step = int(state["next_step"])

    def __repr__(self) -> str:
        return (
            f"CyclicPoissonBatchSampler(num_samples={self.num_samples}, num_groups="
            f"{self.num_groups}, sample_rate={self.sample_rate}, steps={self.steps}, "
            f"public_size={self.public_size}, max_batch_size={self.max_batch_size})"
        )


@dataclass(frozen=True, kw_only=True)
class ShuffledBatches:
    """The batches of a plain loader (``poisson_sampling=False``): ``batches_per_epoch`` batches of
    ``batch_size`` examples (the last may be smaller), each epoch a partition of the data.

    Accounting. One batch is accounted as a Poisson sample at ``q = 1 / batches_per_epoch`` (the
    approximation ``make_private`` warns about). A release of ``k`` batches of one epoch holds ``k``
    disjoint draws without replacement: each example is in it at most once, with probability
    ``k / batches_per_epoch``, so it is accounted as one step at ``min(1, k * q)`` (as Opacus does), and
    its sum is divided by ``k * batch_size``. With ``k = batches_per_epoch`` every example is in the
    release exactly once: a full-batch Gaussian (q = 1), which is exact.
    """

    batch_size: int
    batches_per_epoch: int

    def __post_init__(self) -> None:
        check_count("batch_size", self.batch_size)
        check_count("batches_per_epoch", self.batches_per_epoch)

    @property
    def sample_rate(self) -> float:
        """The rate one batch is accounted at: ``1 / batches_per_epoch``."""
        return 1.0 / self.batches_per_epoch

    def batches_in(self, rows: int) -> int:
        """How many of the loader's batches a release of ``rows`` distinct example rows holds.

        Guarantee: ``ceil(rows / batch_size)``, at least 1, and it divides ``batches_per_epoch`` (or
        ``ValueError`` naming both, before anything is released): then releases that start at an epoch's
        start never span two epochs, so no example is in one release twice.

        ====================================  =============================================
        case                                  result
        ====================================  =============================================
        rows = 0 (an empty step)              1 (noise alone, accounted as one batch)
        micro-batches of one batch            1 (rows of one batch)
        the last, smaller batch of an epoch   counted as one batch (rounded up)
        k does not divide batches_per_epoch   ValueError: a release could span two epochs
                                              and hold an example twice
        ====================================  =============================================
        """
        batches = max(1, math.ceil(rows / self.batch_size))
        if batches > 1 and self.batches_per_epoch % batches:
            raise ValueError(
                f"this step accumulated {batches} batches of a loader of {self.batches_per_epoch} batches per "
                f"epoch without Poisson sampling: {batches} does not divide {self.batches_per_epoch}, so a release "
                f"would span two epochs and could hold an example twice, which the accounting (each example at most "
                f"once per release) does not cover. Nothing was released. Accumulate a number of batches that "
                f"divides len(loader), or use poisson_sampling=True (any number of batches is accounted)."
            )
        return batches

    def release_sample_rate(self, batches: int) -> float:
        """The rate a release of ``batches`` batches of one epoch is accounted at: ``min(1, batches * q)``."""
        return min(1.0, batches / self.batches_per_epoch)
