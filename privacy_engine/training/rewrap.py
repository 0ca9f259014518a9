"""A private loader given to ``make_private`` again.

A script does this on a second run or a second model (as Opacus allows): ``make_private`` returns a
``DPDataLoader`` that the script keeps in the variable it passes to the next call. The engine plans
its sampling from a plain loader (dataset, batch size, sampler), so the private loader is first
turned back into the plain loader it stands for.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils.data import DataLoader, SubsetRandomSampler

from privacy_engine.training.data_loader import DPDataLoader

__all__ = ["plain_loader_for"]


def _index_set(loader: DPDataLoader) -> torch.Tensor | None:
    """The examples ``loader``'s sampler draws from, or None for the whole dataset."""
    sampler = loader.batch_sampler
    indices = getattr(sampler, "indices", None)
    if indices is None and getattr(sampler, "groups", None) is not None:
        indices = torch.cat([torch.as_tensor(group, dtype=torch.long) for group in sampler.groups])
    if indices is None:
        return None
    indices = torch.sort(torch.as_tensor(indices, dtype=torch.long).flatten()).values
    if indices.numel() == len(loader.dataset) and torch.equal(indices, torch.arange(len(loader.dataset))):
        return None
    return indices


def plain_loader_for(loader: DPDataLoader) -> DataLoader:
    """The plain loader ``loader`` was made from: the same dataset and examples (a
    ``SubsetRandomSampler`` over them if the private loader drew from a subset), ``batch_size``
    its expected batch size, and its collate function, workers, pinning and worker seeding.

    Guarantee: planning private training from the result samples the same examples with the same
    expected batch size, so a second ``make_private`` on a private loader accounts the sampling it
    really runs (the engine builds fresh private sampling from this loader).

    ===========================================  ==============================================
    case                                         result
    ===========================================  ==============================================
    loader from make_private / from_data_loader  exact: same examples and expected batch size
    sampler over a subset of the dataset         the same subset (SubsetRandomSampler)
    expected batch size not an integer           rounded to the nearest integer, with a warning
                                                 (the sample rate becomes batch_size / N)
    expected batch size < 0.5                    ValueError (no batch size >= 1 is that close)
    not a DPDataLoader                           TypeError
    ===========================================  ==============================================
    """
    if not isinstance(loader, DPDataLoader):
        raise TypeError(f"loader must be a DPDataLoader; got {type(loader).__name__}")
    expected = float(loader.expected_batch_size)
    batch_size = round(expected)
    if batch_size < 1:
        raise ValueError(
            f"the private loader's expected batch size is {expected:.4g} (< 0.5): make_private needs a loader with "
            f"an expected batch size of at least 1; pass the original DataLoader with batch_size set"
        )
    if abs(batch_size - expected) > 1e-9 * expected:
        warnings.warn(
            f"the private loader's expected batch size {expected:.6g} is not an integer: rebuilt with batch_size="
            f"{batch_size}, so the new sample rate is batch_size / N"
        )
    # Its collate function is the private loader's (the user's, wrapped for empty batches): a new
    # DPDataLoader unwraps it, and a plain loader (poisson_sampling=False) can use it as it is.
    kwargs = DPDataLoader._loader_kwargs(loader)
    indices = _index_set(loader)
    sampler = None if indices is None else SubsetRandomSampler(indices.tolist())
    return DataLoader(loader.dataset, batch_size=batch_size, sampler=sampler, **kwargs)
