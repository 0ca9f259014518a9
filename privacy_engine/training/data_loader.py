"""``DPDataLoader``: a DataLoader whose batches come from the private batch samplers (``sampling.py``).

It wraps an existing ``torch.utils.data.DataLoader`` (same dataset, collate_fn, workers, pinning, ...)
with one of those samplers; empty batches come out as zero-length tensors, and ``loader.padding_mask``
follows the batch last yielded. Also here: what the samplers need to know of the wrapped loader
(``loader_index_set``: which examples it draws from; its dataset's length and batch size).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from privacy_engine.batches.tickets import BatchTicket, TicketQueue, tag_batch
from privacy_engine.noise.secure_random import is_secure_generator
from privacy_engine.settings_checks import check_count
from privacy_engine.training.sampling import (
    CyclicPoissonBatchSampler,
    PoissonBatchSampler,
    _DPBatchSampler,
)

__all__ = ["DPDataLoader", "loader_index_set"]


def _is_plain_leaf(value: Any) -> bool:
    return value is None or isinstance(value, (str, bytes, numbers.Number))


def _zero_length(collated: Any) -> Any:
    """``collated`` (a batch of one example) with its batch dimension cut to length 0."""
    if isinstance(collated, torch.Tensor):
        return collated[:0] if collated.dim() > 0 else collated
    if isinstance(collated, np.ndarray):
        return collated[:0] if collated.ndim > 0 else collated
    if isinstance(collated, Mapping):
        items = {key: _zero_length(value) for key, value in collated.items()}
        try:
            return type(collated)(items)
        except TypeError:
            return items
    if isinstance(collated, tuple) and hasattr(collated, "_fields"):  # namedtuple
        return type(collated)(*(_zero_length(value) for value in collated))
    if isinstance(collated, (list, tuple)):
        # default_collate returns plain values (strings, numbers) as a sequence over the batch:
        # that sequence is the batch dimension. Sequences holding tensors/containers are fields.
        if all(_is_plain_leaf(value) for value in collated):
            return type(collated)()
        return type(collated)(_zero_length(value) for value in collated)
    return collated


class _EmptyBatchSafeCollate:
    """Collate function that turns an empty batch into zero-length tensors of the right shape.

    ``collate_fn([])`` fails for most collate functions, and an empty Poisson batch is a normal
    event. For an empty batch this collates example 0 of the dataset alone and cuts every batch
    dimension to length 0, so the trailing shapes and dtypes are those of a real batch. Picklable
    (it runs in worker processes).
    """

    def __init__(self, collate_fn: Callable[[list], Any], dataset: Dataset) -> None:
        self.collate_fn = collate_fn
        self.dataset = dataset
        self._empty_template: Any = None
        self._has_template = False

    def __call__(self, batch: list) -> Any:
        if len(batch) > 0:
            return self.collate_fn(batch)
        if not self._has_template:
            self._empty_template = _zero_length(self.collate_fn([self.dataset[0]]))
            self._has_template = True
        # New tensor objects for every empty batch: each batch carries its own ticket on its tensors.
        return _zero_length(self._empty_template)


def _sized_dataset_length(loader: DataLoader) -> int:
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            f"loader.dataset ({type(dataset).__name__}) is an IterableDataset: Poisson sampling "
            "needs a sized, map-style dataset (len(dataset) and dataset[i]) to include each "
            "example independently"
        )
    try:
        length = len(dataset)
    except TypeError as error:
        raise TypeError(
            f"loader.dataset ({type(dataset).__name__}) has no __len__: Poisson sampling needs a "
            "sized, map-style dataset (len(dataset) and dataset[i])"
        ) from error
    if length < 1:
        raise ValueError("loader.dataset is empty: there is nothing to sample")
    return length


def _expected_batch_size(loader: DataLoader) -> int:
    if loader.batch_size is None:
        raise ValueError(
            "loader.batch_size is None (built with batch_sampler= or batch_size=None): build the "
            "DataLoader with batch_size set to the expected batch size you want"
        )
    return int(loader.batch_size)


def cyclic_sampling_of(loader: DataLoader, num_groups: int) -> tuple[int, int, float, torch.Tensor | None]:
    """``(num_samples, num_groups, sample_rate, indices)`` of cyclic Poisson sampling in ``num_groups``
    groups over what ``loader`` draws from, at the rate that keeps its expected batch size
    (``batch_size * num_groups / population``). Raises ValueError naming num_groups (more groups than
    examples) or the batch size (a rate above 1) before anything is built."""
    num_samples = _sized_dataset_length(loader)
    batch_size = _expected_batch_size(loader)
    num_groups = check_count("num_groups", num_groups)
    indices = loader_index_set(loader)
    population = num_samples if indices is None else int(indices.numel())
    if num_groups > population:
        raise ValueError(
            f"num_groups={num_groups} exceeds the {population} examples the loader draws from: use at most "
            "as many groups as examples"
        )
    if batch_size * num_groups > population:
        raise ValueError(
            f"loader.batch_size * num_groups = {batch_size} * {num_groups} exceeds the {population} examples "
            f"the loader draws from: each group has only ~{population // num_groups} examples, so the "
            "per-group sample rate would exceed 1; lower batch_size or num_groups"
        )
    return num_samples, num_groups, batch_size * num_groups / population, indices


def loader_index_set(loader: DataLoader) -> torch.Tensor | None:
    """The examples ``loader`` draws from, for Poisson sampling to stay within them: None for the
    whole dataset (a plain, shuffled or sequential loader), the sampler's indices for a
    ``SubsetRandomSampler`` (a train/validation split).

    ==================================  ================================================
    loader's sampler                    result
    ==================================  ================================================
    SequentialSampler / RandomSampler   None (every example; RandomSampler without
                                        replacement over the whole dataset only)
    SubsetRandomSampler                 its indices (N = their number)
    WeightedRandomSampler               ValueError: weighted sampling has no Poisson
                                        equivalent the accountant can analyse
    RandomSampler with replacement or   ValueError (not a uniform pass over the data)
    another num_samples
    any other sampler                   TypeError naming it: give a plain loader over
                                        the training subset (torch.utils.data.Subset)
    ==================================  ================================================
    """
    sampler = loader.sampler
    if isinstance(sampler, SequentialSampler):
        return None
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler.num_samples != len(loader.dataset):
            raise ValueError(
                "data_loader.sampler is a RandomSampler with replacement or with num_samples != len(dataset): "
                "private training Poisson-samples each example independently; use shuffle=True or a plain loader"
            )
        return None
    if isinstance(sampler, SubsetRandomSampler):
        return torch.as_tensor(list(sampler.indices), dtype=torch.long)
    if isinstance(sampler, WeightedRandomSampler):
        raise ValueError(
            "data_loader.sampler is a WeightedRandomSampler: weighted sampling is not the uniform Poisson sampling "
            "the privacy accounting analyses. Use a plain loader (rebalance with loss weights instead)."
        )
    raise TypeError(
        f"data_loader.sampler is a {type(sampler).__name__}: private training replaces the sampler by Poisson "
        f"sampling, and only SequentialSampler, RandomSampler and SubsetRandomSampler say which examples to "
        f"sample from. Build the loader over the training examples (torch.utils.data.Subset) with shuffle=True."
    )


_DATALOADER_HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters


def _sampling_generator_state(generator: torch.Generator | None) -> tuple[str, torch.Tensor | None]:
    """(kind, state) of a sampler's generator, for checkpoints; a secure one has no state to save."""
    if is_secure_generator(generator):
        return "secure", None
    if generator is None:
        return "global", None
    return "own", generator.get_state()


class DPDataLoader(DataLoader):
    """A DataLoader whose batches come from a Poisson or cyclic Poisson batch sampler.

    Build it from an existing loader with ``DPDataLoader.from_data_loader`` (Poisson) or
    ``DPDataLoader.cyclic`` (cyclic Poisson, optionally truncated); it keeps the loader's
    dataset, collate_fn, num_workers, pin_memory, timeout, worker_init_fn,
    multiprocessing_context, generator (worker seeds), prefetch_factor, persistent_workers and
    pin_memory_device; its sampler/shuffle/drop_last are replaced by the private sampler.

    Attributes: ``sample_rate`` (per-step inclusion probability of an eligible example),
    ``expected_batch_size``, ``num_groups`` (1 for Poisson), ``max_batch_size`` (None unless
    truncated), ``padding_mask`` (bool tensor, True = padding, for the batch most recently
    yielded; None when batches are not padded).

    Guarantee: which examples are in a batch is decided by the batch sampler alone
    (independent Bernoulli draws, see the samplers), never by the data; empty batches are
    yielded as zero-length tensors. Every batch carries a ``BatchTicket`` (its step index, cyclic
    group and padding mask; ``privacy_engine.training.step_contract``) on its tensors and in
    ``loader.tickets``, so the optimizer step that releases it clips it with its own padding mask
    and ties it to its own step, whatever the iteration order (prefetching, ``list(loader)``,
    skipped batches). ``padding_mask`` (the last yielded batch's) is kept for inspection only.
    The loader keeps references to its last ``RECENT_BATCHES`` (4) batches, so that a copy of one
    (``.to(device)``) is recognised by its values; memory stays bounded however long a loop iterates.
    """

    def __init__(self, dataset: Dataset, batch_sampler: _DPBatchSampler, **loader_kwargs: Any) -> None:
        if not isinstance(batch_sampler, _DPBatchSampler):
            raise TypeError(
                "batch_sampler must be a PoissonBatchSampler or CyclicPoissonBatchSampler, got "
                f"{type(batch_sampler).__name__}"
            )
        collate_fn = loader_kwargs.pop("collate_fn", None)
        if collate_fn is None:
            collate_fn = torch.utils.data.default_collate
        if isinstance(collate_fn, _EmptyBatchSafeCollate):
            collate_fn = collate_fn.collate_fn
        # Masks are matched to batches in order, so batches must come back in sampler order.
        if _DATALOADER_HAS_IN_ORDER:
            loader_kwargs["in_order"] = True
        super().__init__(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=_EmptyBatchSafeCollate(collate_fn, dataset),
            **loader_kwargs,
        )
        self.padding_mask: torch.Tensor | None = None
        #: Tickets of the batches yielded and not yet run through the model (see step_contract).
        self.tickets = TicketQueue(f"{type(self).__name__} at {id(self):#x}")
        self._consumed_steps = batch_sampler._next_step

    # ------------------------------------------------------------------ constructors
    @staticmethod
    def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "collate_fn": loader.collate_fn,
            "num_workers": loader.num_workers,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": loader.generator,
            "persistent_workers": loader.persistent_workers,
            "pin_memory_device": loader.pin_memory_device,
        }
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        return kwargs

    @classmethod
    def from_data_loader(
        cls,
        loader: DataLoader,
        *,
        generator: torch.Generator | None = None,
        steps: int | None = None,
    ) -> DPDataLoader:
        """Poisson-sampling version of ``loader``: ``q = loader.batch_size / len(dataset)``.

        ``generator`` drives the sampling (None: ``loader.generator``, as in Opacus, and when that is None
        too, torch's global generator); ``steps`` per epoch defaults to ``round(1 / q)``.

        ============================  ===========================================
        case                          result
        ============================  ===========================================
        dataset has no __len__        TypeError naming loader.dataset
        loader.batch_size None        ValueError naming loader.batch_size
        batch_size > len(dataset)     ValueError (sample_rate would exceed 1)
        ============================  ===========================================
        """
        num_samples = _sized_dataset_length(loader)
        batch_size = _expected_batch_size(loader)
        indices = loader_index_set(loader)
        population = num_samples if indices is None else int(indices.numel())
        if batch_size > population:
            raise ValueError(
                f"loader.batch_size={batch_size} exceeds the {population} examples the loader draws from: the "
                "sample rate batch_size / len(examples) must be <= 1"
            )
        if generator is None:
            generator = loader.generator
        sampler = PoissonBatchSampler(
            num_samples, batch_size / population, steps=steps, generator=generator, indices=indices
        )
        return cls(loader.dataset, sampler, **cls._loader_kwargs(loader))

    @classmethod
    def cyclic(
        cls,
        loader: DataLoader,
        num_groups: int,
        *,
        max_batch_size: int | None = None,
        public_size: bool = False,
        generator: torch.Generator | None = None,
        steps: int | None = None,
    ) -> DPDataLoader:
        """Cyclic Poisson version of ``loader`` with ``num_groups`` groups (= BandMF bands).

        Expected batch size stays ``loader.batch_size``: each step samples its group with
        ``p = batch_size * num_groups / len(dataset)``. ``max_batch_size`` truncates and pads
        (see ``CyclicPoissonBatchSampler``); ``num_groups=1`` with ``max_batch_size`` is
        truncated Poisson sampling.

        ============================  ===========================================
        case                          result
        ============================  ===========================================
        dataset has no __len__        TypeError naming loader.dataset
        loader.batch_size None        ValueError naming loader.batch_size
        num_groups > len(dataset)     ValueError naming num_groups
        batch_size * num_groups > N   ValueError (p would exceed 1)
        ============================  ===========================================
        """
        num_samples, num_groups, rate, indices = cyclic_sampling_of(loader, num_groups)
        sampler = CyclicPoissonBatchSampler(
            num_samples,
            num_groups,
            rate,
            steps=steps,
            public_size=public_size,
            generator=generator,
            max_batch_size=max_batch_size,
            indices=indices,
        )
        return cls(loader.dataset, sampler, **cls._loader_kwargs(loader))

    # ------------------------------------------------------------------ attributes
    @property
    def sample_rate(self) -> float:
        """Probability ``q`` that an example is in a step's batch (with cyclic sampling: an example of
        the step's group); the rate the accountant records."""
        return self.batch_sampler.sample_rate

    @property
    def expected_batch_size(self) -> float:
        """Expected number of real examples in a batch: what the noisy sum is divided by (never the
        realised size, which depends on the data)."""
        return self.batch_sampler.expected_batch_size

    @property
    def num_groups(self) -> int:
        """Number of cyclic groups (1: plain Poisson sampling)."""
        return self.batch_sampler.num_groups

    @property
    def max_batch_size(self) -> int | None:
        """Truncated sampling's cap: every batch has this many rows, padding masked; None: not truncated."""
        return self.batch_sampler.max_batch_size

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        sampler: _DPBatchSampler = self.batch_sampler
        # Restart from the last batch actually yielded: draws that workers prefetched but that
        # were never yielded are discarded, not skipped over.
        sampler._next_step = self._consumed_steps
        sampler._records.clear()
        sampler._recording = True
        self.padding_mask = None
        try:
            for batch in super().__iter__():
                step, padding_mask, entries = sampler._records.popleft()
                self.padding_mask = padding_mask
                self._consumed_steps = step + 1
                # The ticket travels with the batch (on its tensors, and queued here), so the step
                # that releases this batch knows its step index, group and padding, whatever order
                # the loop uses it in.
                ticket = BatchTicket(loader_step=step, size=entries, group=sampler.group_of_step(step),
                                     padding_mask=padding_mask, origin=self.tickets.origin,
                                     users=sampler.take_row_users(step))  # fmt: skip
                self.tickets.issue(ticket, batch)
                tag_batch(batch, ticket)
                yield batch
        finally:
            sampler._recording = False
            sampler._records.clear()

    def state_dict(self) -> dict[str, Any]:
        """Sampler state as of the last yielded batch: ``next_step``, cyclic groups, and the
        sampling generator: ``generator`` is ``"own"``, ``"global"`` (torch's global generator) or
        ``"secure"``; ``generator_state`` is its ``get_state()`` for ``"own"``, else None (secure
        sampling draws from the OS and has no state; the global generator is shared with other code,
        e.g. every DataLoader iterator draws from it, so it cannot be resumed exactly). With worker
        processes prefetching, the generator may already be past the last yielded batch: a resume
        then samples validly but not the same batches."""
        sampler = self.batch_sampler
        if isinstance(sampler, CyclicPoissonBatchSampler) or sampler.saves_own_state:
            state = sampler.state_dict()
            state["next_step"] = self._consumed_steps
        else:
            state = {"next_step": self._consumed_steps}
        state["generator"], state["generator_state"] = _sampling_generator_state(sampler.generator)
        if sampler.seed_pending:
            state["seed_pending"] = True  # saved before the first batch: the generator is seeded at it (seed_lazily)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``. Raises ``ValueError`` (changing nothing) if the generator kind
        or state does not fit this loader's."""
        sampler = self.batch_sampler
        kind, _ = _sampling_generator_state(sampler.generator)
        saved = state.get("generator_state")
        if state.get("generator") != kind or (kind == "own") != isinstance(saved, torch.Tensor):
            raise ValueError(
                f"the loader state's sampling generator is {state.get('generator')!r}, this loader's is {kind!r}: "
                "build the loader with the same secure_mode / generator settings as the saved one"
            )
        if kind == "own" and (saved.dtype != torch.uint8 or saved.shape != sampler.generator.get_state().shape):
            raise ValueError("the loader state's generator_state is not a CPU generator state")
        if "user_cycles" in state and not sampler.saves_own_state:
            raise ValueError("the loader state was saved from user-level sampling (privacy_unit='user'); this loader "
                             "samples examples: make_private with the privacy_unit of the saved run")  # fmt: skip
        if isinstance(sampler, CyclicPoissonBatchSampler) or sampler.saves_own_state:
            sampler.load_state_dict(state)
        if kind == "own":
            sampler.generator.set_state(saved)
            sampler.seed_pending = state.get("seed_pending") is True
        self._consumed_steps = int(state["next_step"])
        sampler._next_step = self._consumed_steps
