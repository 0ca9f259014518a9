"""``opacus.data_loader.DPDataLoader``: the engine's Poisson-sampling loader with Opacus's constructors.

Sample rate (the one difference an Opacus user can see): ``from_data_loader`` samples each example
with probability ``q = batch_size / N`` (the engine's rule), where Opacus uses ``1 / len(loader)``
(``len(loader) = ceil(N / batch_size)`` without ``drop_last``). They agree when ``batch_size``
divides ``N``; otherwise Opacus's ``q`` is slightly smaller (fewer examples per step, slightly smaller
epsilon per step). Either is private as long as the accountant records the rate actually sampled,
which both do. ``DPDataLoader(dataset, sample_rate=q)`` samples at exactly the ``q`` given.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from privacy_engine.opacus._lazy import lazy_attribute
from privacy_engine.training.data_loader import DPDataLoader as _DPDataLoader
from privacy_engine.training.rewrap import plain_loader_for
from privacy_engine.training.sampling import PoissonBatchSampler

__all__ = ["DPDataLoader"]


def _check_options(*, rand_on_empty: bool) -> None:
    if rand_on_empty:
        raise ValueError(
            "rand_on_empty=True is not supported: it would replace an empty Poisson batch by random data that was "
            "never sampled. Empty batches come out as zero-length tensors, which every layer here handles."
        )


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
        sampler = PoissonBatchSampler(len(dataset), sample_rate, generator=generator)
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
        """A Poisson-sampling loader over ``data_loader``'s examples with its expected batch size
        (``q = batch_size / N``; see the module docstring for Opacus's ``1 / len(loader)``).
        ``generator`` drives the sampling (default: ``data_loader.generator``, as Opacus; None:
        torch's global generator). A private loader passed in is rebuilt from the plain loader it
        stands for (same examples and expected batch size)."""
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
        return super().from_data_loader(data_loader, generator=generator, steps=steps)
