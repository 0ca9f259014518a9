"""``opacus.data_loader.DPDataLoader``: the engine's Poisson-sampling loader with Opacus's constructors.

Sample rate. Opacus's code computes the rate as ``1 / len(loader)``: ``DPDataLoader.from_data_loader``
samples at ``1 / len(data_loader)``, and its examples account with
``accountant.get_optimizer_hook_fn(sample_rate=1 / len(loader))``. This namespace samples at that same
rate, so a pipeline built by hand the Opacus way records the rate it samples at: ``from_data_loader``
samples each example with probability ``q = 1 / len(data_loader)`` and its loader has
``len(data_loader)`` batches (``1 / len(private_loader)`` is the same ``q``). (The engine's own
``make_private`` samples at ``batch_size / N`` and records that; the two agree when ``batch_size``
divides ``N``.) ``DPDataLoader(dataset, sample_rate=q)`` samples at exactly the ``q`` given and, as in
Opacus, has ``int(1 / q)`` batches, so ``1 / len(loader) >= q``: a hook given ``1 / len(loader)`` records
at least the rate sampled (never less).
"""

from __future__ import annotations

import collections
import copy
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from privacy_engine.noise.secure_random import is_secure_generator
from privacy_engine.opacus._lazy import lazy_attribute
from privacy_engine.opacus.utils.uniform_sampler import opacus_steps_per_epoch
from privacy_engine.training.data_loader import DPDataLoader as _DPDataLoader
from privacy_engine.training.data_loader import _sized_dataset_length, loader_index_set
from privacy_engine.training.rewrap import plain_loader_for
from privacy_engine.training.sampling import PoissonBatchSampler

__all__ = ["CollateFnWithEmpty", "DPDataLoader", "switch_generator", "wrap_collate_with_empty"]


def _check_options(*, rand_on_empty: bool) -> None:
    if rand_on_empty:
        raise ValueError(
            "rand_on_empty=True is not supported: it would replace an empty Poisson batch by random data that was "
            "never sampled. Empty batches come out as zero-length tensors, which every layer here handles."
        )


class CollateFnWithEmpty:
    """A collate function that also collates an empty list (an empty Poisson batch): it remembers the
    structure of the first non-empty batch (tensors inside dicts, lists, tuples) and returns the same
    structure with a batch dimension of size 0 (dimension 0, or 1 when ``batch_first=False``).

    Guarantee: an empty draw gives a batch with no example, never data that was not sampled, so
    ``rand_on_empty=True`` (Opacus's random stand-in batch) raises ``ValueError``; a structure with other
    leaf types raises ``TypeError`` at the empty batch. Before any non-empty batch, an empty one gives
    zero tensors of ``sample_empty_shapes`` / ``dtypes`` when both are given, else ``[]``.
    ``collator_fn=None`` returns the list of examples itself.
    """

    def __init__(self, collator_fn: Callable[[list], Any] | None, batch_first: bool = True, rand_on_empty: bool = False,
                 sample_empty_shapes: Sequence[tuple] | None = None, dtypes: Sequence[Any] | None = None) -> None:  # fmt: skip
        _check_options(rand_on_empty=rand_on_empty)
        self.wrapped_collator_fn = collator_fn
        self.batch_first = batch_first
        self.rand_on_empty = rand_on_empty
        self.sample_empty_shapes = sample_empty_shapes
        self.dtypes = dtypes
        self.first_batch: Any = None

    def __call__(self, batch: list) -> Any:
        """The collated batch; for an empty ``batch``, the empty batch described above."""
        if len(batch) > 0:
            output = batch if self.wrapped_collator_fn is None else self.wrapped_collator_fn(batch)
            if self.first_batch is None:
                self.first_batch = copy.deepcopy(output)
            return output
        if self.first_batch is None:
            if self.sample_empty_shapes is not None and self.dtypes is not None:
                return [torch.zeros(shape, dtype=dtype) for shape, dtype in zip(self.sample_empty_shapes, self.dtypes)]
            return []
        return self._empty_like(self.first_batch)

    def _empty_like(self, sample: Any) -> Any:
        if isinstance(sample, torch.Tensor):
            shape = list(sample.shape)
            shape[0 if self.batch_first else 1] = 0
            return torch.empty(shape, dtype=sample.dtype, device=sample.device)
        if isinstance(sample, Mapping):
            return {key: self._empty_like(value) for key, value in sample.items()}
        if isinstance(sample, (list, tuple)):
            return type(sample)(self._empty_like(value) for value in sample)
        raise TypeError(
            f"CollateFnWithEmpty cannot make an empty batch holding {type(sample).__name__}: only tensors inside "
            f"dicts, lists and tuples (anything else could carry data of examples that were not sampled)"
        )


def wrap_collate_with_empty(*, collate_fn: Callable[[list], Any] | None, batch_first: bool = True,
                            rand_on_empty: bool = False, sample_empty_shapes: Sequence[tuple] | None = None,
                            dtypes: Sequence[Any] | None = None) -> CollateFnWithEmpty:  # fmt: skip
    """``CollateFnWithEmpty(collate_fn, ...)`` (Opacus's factory; the same arguments and guarantee)."""
    return CollateFnWithEmpty(collate_fn, batch_first=batch_first, rand_on_empty=rand_on_empty,
                              sample_empty_shapes=sample_empty_shapes, dtypes=dtypes)  # fmt: skip


class DPDataLoader(_DPDataLoader):
    """The engine's ``DPDataLoader`` (Poisson sampling, empty batches as zero-length tensors), built
    the engine's way (``DPDataLoader(dataset, batch_sampler, ...)``) or Opacus's way
    (``DPDataLoader(dataset, sample_rate=q, ...)``, ``from_data_loader(loader, distributed=...)``).

    Guarantee: the engine's ``DPDataLoader``'s (every example of the dataset is in each batch
    independently with probability ``sample_rate``, decided by the sampler alone).

    ===================================  ================================================
    case                                 result
    ===================================  ================================================
    sample_rate not in (0, 1]            ValueError naming sample_rate
    drop_last=True                       ignored with a warning (as Opacus)
    rand_on_empty=True                   ValueError (random data for an empty batch)
    distributed=True                     the engine's distributed Poisson loader
    from_data_loader(a DPDataLoader)     the same examples and expected batch size
    ===================================  ================================================
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_sampler: Any = None,
        *,
        sample_rate: float | None = None,
        collate_fn: Any = None,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        distributed: bool = False,
        batch_first: bool = True,
        rand_on_empty: bool = False,
        **kwargs: Any,
    ) -> None:
        if batch_sampler is not None:
            # The engine's constructor (its classmethods build loaders this way).
            if sample_rate is not None:
                raise TypeError("give batch_sampler (the engine's constructor) or sample_rate (Opacus's), not both")
            super().__init__(dataset, batch_sampler, collate_fn=collate_fn, generator=generator, **kwargs)
            return
        if sample_rate is None:
            raise TypeError("DPDataLoader needs sample_rate= (or a batch_sampler), e.g. batch_size / len(dataset)")
        _check_options(rand_on_empty=rand_on_empty)
        if distributed:
            raise ValueError("build a distributed private loader with DPDataLoader.from_data_loader(loader, distributed=True)")
        if drop_last:
            warnings.warn("drop_last is ignored: Poisson sampling has no last partial batch")
        sampler = PoissonBatchSampler(len(dataset), sample_rate, generator=generator,
                                      steps=opacus_steps_per_epoch(sample_rate))  # fmt: skip
        super().__init__(dataset, sampler, collate_fn=collate_fn, generator=generator, **kwargs)

    @classmethod
    def from_data_loader(
        cls,
        data_loader: DataLoader,
        *,
        distributed: bool = False,
        generator: torch.Generator | None = None,
        batch_first: bool = True,
        rand_on_empty: bool = False,
        steps: int | None = None,
    ) -> _DPDataLoader:
        """A Poisson-sampling loader over ``data_loader``'s examples at Opacus's rate,
        ``q = 1 / len(data_loader)``, with ``len(data_loader)`` batches per pass.

        Guarantee: every example ``data_loader`` draws from is in each batch independently with
        probability ``1 / len(data_loader)``, which is ``1 / len(returned loader)`` and the returned
        loader's ``sample_rate``: a step hook given ``sample_rate=1 / len(loader)`` (either loader), as
        Opacus's examples write it, records the rate actually sampled.

        ===================================  ================================================
        case                                 result
        ===================================  ================================================
        batch_size divides N                 q = batch_size / N (the engine's rate too)
        otherwise                            q = 1 / ceil(N / batch_size) (Opacus's), slightly
                                             below batch_size / N
        drop_last=True on data_loader        q = 1 / floor(N / batch_size) (Opacus's rule)
        a private loader passed in           rebuilt from the plain loader it stands for
        SubsetRandomSampler                  q over the sampler's indices only
        ``steps`` given                      that many batches per pass (q unchanged)
        empty data_loader                    ValueError
        ===================================  ================================================

        ``generator`` drives the sampling (default: ``data_loader.generator``, as Opacus; None:
        torch's global generator)."""
        _check_options(rand_on_empty=rand_on_empty)
        if isinstance(data_loader, _DPDataLoader):
            data_loader = plain_loader_for(data_loader)
        if generator is None:
            generator = data_loader.generator
        if distributed:
            build = lazy_attribute(
                "DPDataLoader.from_data_loader(distributed=True)",
                "privacy_engine.training.distributed",
                ("distributed_data_loader", "DistributedDPDataLoader"),
                "distributed Poisson sampling",
            )
            return build(data_loader, generator=generator)
        batches = len(data_loader)
        if batches < 1:
            raise ValueError("data_loader is empty (len(data_loader) == 0): it has no sample rate 1 / len(loader)")
        _sized_dataset_length(data_loader)  # TypeError naming the dataset unless it is sized, map-style
        sampler = PoissonBatchSampler(
            len(data_loader.dataset), 1.0 / batches, steps=batches if steps is None else steps, generator=generator,
            indices=loader_index_set(data_loader),
        )  # fmt: skip
        return cls(data_loader.dataset, sampler, **cls._loader_kwargs(data_loader))


def switch_generator(*, data_loader: DataLoader, generator: torch.Generator) -> DataLoader:
    """Opacus's ``switch_generator``: a new loader over the same dataset that samples exactly as
    ``data_loader`` does (same sampler type, rate, batch size, collate function and worker settings)
    but draws its randomness from ``generator``. ``data_loader`` itself is left unchanged.

    Guarantee: only the source of randomness differs; a private loader stays a private loader with the
    same sample rate (its accounting is unchanged).

    =====================================  ================================================
    case                                   result
    =====================================  ================================================
    a DPDataLoader (Poisson)               a DPDataLoader at the same rate, sampled from
                                           ``generator``
    a plain loader, shuffle=True           its RandomSampler drawn from ``generator``
    a plain loader, shuffle=False          ValueError (no randomness to switch), as Opacus
    a secure-mode DPDataLoader             ValueError (OS randomness is not switched)
    generator not a CPU torch.Generator    TypeError / ValueError, nothing built
    a batch sampler without ``sampler``    TypeError naming its class
    =====================================  ================================================
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"switch_generator: generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise ValueError("switch_generator: generator must be a CPU torch.Generator (sampling runs on the CPU)")
    batch_sampler = copy.copy(data_loader.batch_sampler)
    if isinstance(batch_sampler, PoissonBatchSampler):
        if is_secure_generator(batch_sampler.generator):
            raise ValueError("switch_generator: this loader samples from OS randomness (secure mode); a seedable "
                             "generator would weaken it. Build a non-secure loader instead.")
        batch_sampler.generator = generator
        batch_sampler.seed_pending = False  # the caller's generator is used as given, never reseeded
        batch_sampler._records = collections.deque()  # the copy records its own batches
        batch_sampler._recording = False
        kwargs = _DPDataLoader._loader_kwargs(data_loader)
        kwargs["generator"] = generator
        return type(data_loader)(data_loader.dataset, batch_sampler, **kwargs)
    inner = getattr(batch_sampler, "sampler", None)
    if inner is None:
        raise TypeError(
            f"switch_generator: the loader's batch sampler ({type(batch_sampler).__name__}) has no 'sampler' "
            "attribute to draw from another generator; build the loader again with generator=")
    if not hasattr(inner, "generator"):
        raise ValueError(
            f"switch_generator: the loader's sampler ({type(inner).__name__}) draws no randomness (e.g. "
            "shuffle=False): there is no generator to switch")
    inner = copy.copy(inner)
    inner.generator = generator
    batch_sampler.sampler = inner
    kwargs = _DPDataLoader._loader_kwargs(data_loader)
    kwargs["generator"] = generator
    return DataLoader(data_loader.dataset, batch_sampler=batch_sampler, **kwargs)
