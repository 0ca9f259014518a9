"""Virtual steps: train on large logical (Poisson) batches with bounded memory.

Each logical batch from the private loader is cut into physical micro-batches of at most
``max_physical_batch_size`` examples. The optimizer is told to skip (clip and accumulate only) at
every micro-batch but the last of its logical batch, so noise is added, the step recorded and the
parameters updated once per logical batch, exactly as if the whole batch had fit in memory:

    with VirtualSteps(data_loader=loader, max_physical_batch_size=32, optimizer=optimizer) as batches:
        for x, y in batches:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()

The keyword arguments are those of Opacus's ``BatchMemoryManager`` (a script switches by renaming
the class).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from privacy_engine.batches.tickets import find_ticket, tag_batch
from privacy_engine.clipping.per_user import user_aligned_size
from privacy_engine.training.fsdp_private import FSDPPrivateOptimizer
from privacy_engine.training.optimizer import DPOptimizer

__all__ = ["VirtualSteps", "batch_size_of", "split_batch"]


def batch_size_of(batch: Any) -> int:
    """The size of the batch dimension (dim 0) of the first tensor in ``batch``."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError("a 0-dim tensor has no batch dimension")
        return batch.shape[0]
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        values = []
    for value in values:
        try:
            return batch_size_of(value)
        except ValueError:
            continue
    raise ValueError(f"found no tensor with a batch dimension in the batch ({type(batch).__name__})")


def _slice(value: Any, start: int, end: int, batch_size: int) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != batch_size:
            raise ValueError(
                f"a tensor in the batch has shape {tuple(value.shape)}, but the batch has {batch_size} "
                f"examples: every tensor must have the batch as dim 0 to be split"
            )
        return value[start:end]
    if isinstance(value, Mapping):
        items = {key: _slice(item, start, end, batch_size) for key, item in value.items()}
        try:
            return type(value)(items)
        except TypeError:
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_slice(item, start, end, batch_size) for item in value))
    if isinstance(value, (list, tuple)):
        if len(value) == batch_size and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in value):
            return type(value)(value[start:end])  # a collated list of plain values, one per example
        return type(value)(_slice(item, start, end, batch_size) for item in value)
    return value


def split_batch(batch: Any, max_size: int) -> list[tuple[int, int, Any]]:
    """``(start, end, micro_batch)`` pieces of ``batch`` along dim 0, each at most ``max_size``
    long; an empty batch gives one empty piece (so its step is still taken)."""
    size = batch_size_of(batch)
    bounds = [(start, min(start + max_size, size)) for start in range(0, size, max_size)] or [(0, 0)]
    return [(start, end, _slice(batch, start, end, size)) for start, end in bounds]


class VirtualSteps:
    """Iterate physical micro-batches of each logical batch of ``data_loader``.

    Guarantee: for every logical batch, ``optimizer.signal_skip_step(True)`` precedes each
    micro-batch but the last and ``signal_skip_step(False)`` precedes the last, so (with one
    ``optimizer.step()`` per micro-batch) the noise is added and the step recorded once per
    logical batch; the update equals the one-batch update up to float summation order. The
    loader's ``padding_mask`` is sliced with the batch and handed to the optimizer. Leaving the
    loop between micro-batches of one logical batch discards its partial sum (nothing of it was
    released), with a warning.

    ================================  ==========================================
    case                              result
    ================================  ==========================================
    logical batch <= max size         one micro-batch, a normal step
    empty logical batch               one empty micro-batch, a normal step
    max_physical_batch_size < 1       ValueError
    user-level batch (privacy_unit=   micro-batches of a multiple of
    "user")                           examples_per_user rows (never cutting a
                                      user); ValueError if smaller than it
    optimizer not a DPOptimizer       TypeError
    (nor an FSDPPrivateOptimizer)
    loop left mid logical batch       partial sum discarded, warning
    FSDPPrivateOptimizer (FSDP2)      every rank runs the largest micro-batch
                                      count over the ranks (a collective per
                                      logical batch); extra ones are empty
    ================================  ==========================================
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int,
                 optimizer: DPOptimizer | FSDPPrivateOptimizer) -> None:  # fmt: skip
        if not isinstance(optimizer, (DPOptimizer, FSDPPrivateOptimizer)):
            raise TypeError(
                f"optimizer must be a DPOptimizer or FSDPPrivateOptimizer (from PrivacyEngine.make_private); got "
                f"{type(optimizer).__name__}"
            )
        if (
            isinstance(max_physical_batch_size, bool)
            or not isinstance(max_physical_batch_size, numbers.Integral)
            or max_physical_batch_size < 1
        ):
            raise ValueError(f"max_physical_batch_size must be an int >= 1; got {max_physical_batch_size!r}")
        self.data_loader = data_loader
        self.max_physical_batch_size = int(max_physical_batch_size)
        self.optimizer = optimizer
        self._micro_padding_mask: torch.Tensor | None = None
        self._saved_source = None
        self._entered = False

    def __enter__(self) -> VirtualSteps:  # noqa: PYI034  (typing.Self needs Python 3.11)
        self._saved_source = self.optimizer.padding_mask_source
        self.optimizer.padding_mask_source = lambda: self._micro_padding_mask
        self._entered = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.optimizer.padding_mask_source = self._saved_source
        self._entered = False

    def __len__(self) -> int:
        """Logical batches in one pass (the number of physical ones depends on the sampling)."""
        return len(self.data_loader)

    def __iter__(self) -> Iterator[Any]:
        if not self._entered:
            # Used as a plain iterable: install the padding-mask hand-over for this pass only.
            with self:
                yield from self._micro_batches()
            return
        yield from self._micro_batches()

    def _micro_batches(self) -> Iterator[Any]:
        open_logical_step = False
        try:
            for batch in self.data_loader:
                padding_mask = getattr(self.data_loader, "padding_mask", None)
                ticket = find_ticket(batch)
                # User-level batches (privacy_unit="user") are cut between users only: a user is clipped once.
                pieces = split_batch(batch, user_aligned_size(ticket, self.max_physical_batch_size))
                if isinstance(self.optimizer, FSDPPrivateOptimizer):
                    # Under FSDP each micro-batch runs collectives: every rank runs the largest count, a rank
                    # with fewer examples empty micro-batches (they add nothing).
                    count, size = self.optimizer.agreed_micro_batch_count(len(pieces)), batch_size_of(batch)
                    pieces += [(size, size, _slice(batch, size, size, size))] * (count - len(pieces))
                for index, (start, end, micro_batch) in enumerate(pieces):
                    last = index == len(pieces) - 1
                    if ticket is not None:
                        # Each micro-batch carries its slice of the drawn batch's ticket (its rows of
                        # the padding mask), so the step contract clips it on its own, as one draw.
                        tag_batch(micro_batch, ticket.slice(start, end))
                        padding_mask = ticket.padding_mask
                    self._micro_padding_mask = None if padding_mask is None else padding_mask[start:end]
                    self.optimizer.signal_skip_step(not last)
                    open_logical_step = not last
                    yield micro_batch
                open_logical_step = False
        finally:
            self._micro_padding_mask = None
            if open_logical_step:
                warnings.warn(
                    "the loop stopped between micro-batches of one logical batch: its partial clipped sum "
                    "is discarded (nothing of it was released or recorded)"
                )
                self.optimizer.discard_logical_step()

