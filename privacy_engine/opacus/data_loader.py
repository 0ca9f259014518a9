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

import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from privacy_engine.opacus._lazy import lazy_attribute
from privacy_engine.opacus.utils.uniform_sampler import opacus_steps_per_epoch
from privacy_engine.training.data_loader import DPDataLoader as _DPDataLoader
from privacy_engine.training.data_loader import _sized_dataset_length, loader_index_set
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
