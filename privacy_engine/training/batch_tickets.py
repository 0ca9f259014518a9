"""Batch tickets: which drawn batch (or slice of one) a tensor belongs to.

The private loader (``DPDataLoader``) issues a ``BatchTicket`` for every batch it yields and attaches
it to the batch's tensors (``tag_batch``); views that are runs of whole rows (``x.split(n)``,
``x[a:b]``) find their slice of it (``find_ticket``), and ``move_to`` keeps it across a device copy.
``TicketQueue`` holds the tickets a loader yielded that no forward has used yet. What a step does
with them (which batches one release contains, and the checks before it) is the step contract's:
``privacy_engine.training.step_contract``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BatchTicket", "TicketQueue", "find_ticket", "iter_tensors", "move_to", "tag_batch"]

TICKET_ATTRIBUTE = "_privacy_engine_ticket"
# Batches yielded but never run through the model are forgotten beyond this many (a loop that only
# iterates, e.g. to count batches, must not grow memory without bound).
MAX_QUEUED_TICKETS = 4096


@dataclass(frozen=True, eq=False)
class BatchTicket:
    """One batch as the private loader drew it (or a contiguous slice of it).

    ``loader_step``: the draw's global index (the cyclic group is ``loader_step mod b``); None for a
    batch that no private loader drew. ``size``: entries in the batch, padding included.
    ``part``: ``(start, end)`` rows of the drawn batch that this slice holds; None for all of it.
    """

    loader_step: int | None
    size: int
    group: int = 0
    padding_mask: torch.Tensor | None = None
    part: tuple[int, int] | None = None
    draw: Any = field(default=None, repr=False)  # identity of the whole draw (shared by its slices)

    def __post_init__(self) -> None:
        if self.draw is None:
            object.__setattr__(self, "draw", object())

    @property
    def tracked(self) -> bool:
        return self.loader_step is not None

    @property
    def rows(self) -> tuple[int, int]:
        return self.part if self.part is not None else (0, self.size)

    def slice(self, start: int, end: int) -> BatchTicket:
        """The ticket of rows ``[start, end)`` of this batch (a micro-batch)."""
        first, last = self.rows
        if not 0 <= start <= end <= last - first:
            raise ValueError(f"slice [{start}, {end}) is outside a batch of {last - first} rows")
        return BatchTicket(
            loader_step=self.loader_step, size=self.size, group=self.group, padding_mask=self.padding_mask,
            part=(first + start, first + end), draw=self.draw,
        )  # fmt: skip

    def mask(self) -> torch.Tensor | None:
        """The padding mask of the rows this ticket holds (None: no padding)."""
        if self.padding_mask is None:
            return None
        start, end = self.rows
        return self.padding_mask[start:end]

    def same_rows(self, other: BatchTicket | None) -> bool:
        return other is not None and other.draw is self.draw and other.rows == self.rows

    def differs_in_effect(self, other: BatchTicket) -> bool:
        """Whether using one for the other would change the release (padding or group)."""
        if self.group != other.group:
            return True
        if (self.padding_mask is None) != (other.padding_mask is None):
            return True
        return self.padding_mask is not None and not torch.equal(self.mask(), other.mask())


# ---------------------------------------------------------------------------------------------- tags
def iter_tensors(value: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, Mapping):
        for item in value.values():
            yield from iter_tensors(item, depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item, depth + 1)


def tag_batch(batch: Any, ticket: BatchTicket) -> None:
    """Attach ``ticket`` to every tensor of ``batch`` (so it travels with the tensors themselves)."""
    for tensor in iter_tensors(batch):
        try:
            setattr(tensor, TICKET_ATTRIBUTE, ticket)
        except (AttributeError, RuntimeError):  # a tensor type that refuses attributes
            pass


def _ticket_of(tensor: torch.Tensor) -> BatchTicket | None:
    ticket = getattr(tensor, TICKET_ATTRIBUTE, None)
    if ticket is not None:
        return ticket
    base = tensor._base
    parent = None if base is None else getattr(base, TICKET_ATTRIBUTE, None)
    if parent is None or base.dim() == 0 or tensor.dim() != base.dim():
        return None
    # A view of a tagged batch (``x.split(n)``, ``x[a:b]``): which rows, if it is a run of whole rows.
    row_stride = base.stride(0)
    offset = tensor.storage_offset() - base.storage_offset()
    if tensor.shape[1:] != base.shape[1:] or tensor.stride() != base.stride() or row_stride <= 0:
        return None
    if offset % row_stride:
        return None
    start = offset // row_stride
    end = start + tensor.shape[0]
    if parent.part is not None or not 0 <= start <= end <= parent.size:
        return None
    return parent if (start, end) == (0, parent.size) else parent.slice(start, end)


def find_ticket(*values: Any) -> BatchTicket | None:
    """The ticket carried by the tensors in ``values`` (or by the tagged batch they are row-slices
    of); ``RuntimeError`` if they carry two batches' tickets."""
    found: BatchTicket | None = None
    for tensor in iter_tensors(list(values)):
        ticket = _ticket_of(tensor)
        if ticket is None:
            continue
        if found is not None and not found.same_rows(ticket):
            raise RuntimeError(
                "one forward received tensors of two different batches (or slices) of the private loader; give "
                "the model the tensors of one batch per forward"
            )
        found = ticket
    return found


def move_to(batch: Any, device: torch.device | str, **kwargs: Any) -> Any:
    """``batch`` with every tensor moved by ``tensor.to(device, **kwargs)``, keeping its ticket.

    Use it in place of ``.to(device)`` when batches are prefetched or listed ahead with truncated or
    cyclic sampling, so the engine never has to match copied tensors to their batch by order.
    """
    if isinstance(batch, torch.Tensor):
        moved = batch.to(device, **kwargs)
        ticket = getattr(batch, TICKET_ATTRIBUTE, None)
        if ticket is not None:
            setattr(moved, TICKET_ATTRIBUTE, ticket)
        return moved
    if isinstance(batch, Mapping):
        return type(batch)({key: move_to(value, device, **kwargs) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to(value, device, **kwargs) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(value, device, **kwargs) for value in batch)
    return batch


# ---------------------------------------------------------------------------------------------- queue
class TicketQueue:
    """Tickets a loader has yielded whose batch no forward has used yet, oldest first."""

    def __init__(self) -> None:
        self._tickets: collections.deque[BatchTicket] = collections.deque(maxlen=MAX_QUEUED_TICKETS)
        self.last_issued: BatchTicket | None = None

    def issue(self, ticket: BatchTicket) -> None:
        self._tickets.append(ticket)
        self.last_issued = ticket

    def clear(self) -> None:
        self._tickets.clear()

    def __iter__(self):
        return iter(list(self._tickets))

    def __len__(self) -> int:
        return len(self._tickets)

    def take(self, ticket: BatchTicket) -> list[BatchTicket]:
        """Remove ``ticket``'s draw and every older one; return the older (skipped) ones."""
        skipped = []
        while self._tickets:
            head = self._tickets.popleft()
            if head.draw is ticket.draw:
                return skipped
            skipped.append(head)
        return skipped

    def put_back(self, ticket: BatchTicket) -> None:
        """Return a whole draw that a forward took but never used (its backward never ran)."""
        if ticket.part is None and ticket.tracked and all(t.draw is not ticket.draw for t in self._tickets):
            self._tickets.appendleft(ticket)
