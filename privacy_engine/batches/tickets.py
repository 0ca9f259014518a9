"""Batch tickets: which drawn batch (or slice of one) a tensor belongs to, decided exactly.

The private loader (``DPDataLoader``) issues a ``BatchTicket`` for every batch it yields and attaches
it to the batch's tensors (``tag_batch``). A tensor is then identified as part of a drawn batch in
exactly three ways, never by its size:

- its tag (set by the loader, by ``move_to``, or by the recognition of a copy below), valid while
  the tensor is not modified in place;
- it is a view of a tagged tensor whose rows lie inside consecutive rows of the batch, one view row
  per batch row (``x[a:b]``, ``x.split(n)``, ``x.view(B, -1)``, ``x.unsqueeze(1)``, ``x[:, :-1]``,
  ``x.transpose(0, 1)`` for a batch-second model): ``find_ticket``;
- its values equal, row for row, a run of rows of one of the few batches its loader yielded last
  (``TicketQueue.recent``): a copy made by ``.to(device)``, ``.clone()``, ``.contiguous()`` or
  ``.pin_memory()``, or a copy of a slice of the batch: ``row_runs``.

``move_to`` keeps the tag across a device copy. ``TicketQueue`` holds the tickets a loader yielded
that no forward has used yet, and references to its last ``RECENT_BATCHES`` batches (so memory stays
bounded however long a loop only iterates). What a step does with all this (which batches one
release contains, and the checks before it) is the step contract's:
``privacy_engine.training.step_contract``.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "BatchTicket",
    "LoaderOrigin",
    "TicketQueue",
    "find_ticket",
    "flat_rows",
    "forward_tensors",
    "iter_tensors",
    "move_to",
    "row_runs",
    "shares_a_row",
    "tag_batch",
    "tag_tensor",
    "ticket_of_tensors",
]

TICKET_ATTRIBUTE = "_privacy_engine_ticket"
_VERSION_ATTRIBUTE = "_privacy_engine_ticket_version"
# Batches yielded but never run through the model are forgotten beyond this many (a loop that only
# iterates, e.g. to count batches, must not grow memory without bound).
MAX_QUEUED_TICKETS = 4096
# Batches whose tensors a loader keeps, so that a copy of one (``.to(device)`` in a prefetcher) is
# recognised by its values. A few suffice: a copy is made right after the batch is yielded.
RECENT_BATCHES = 4


class LoaderOrigin:
    """The identity of one private loader, carried by its tickets (its batches are its own draws)."""

    __slots__ = ("__weakref__", "name")

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"LoaderOrigin({self.name})"


@dataclass(frozen=True, eq=False)
class BatchTicket:
    """One batch as a private loader drew it (or a contiguous slice of it), or a batch no private
    loader drew (``loader_step`` None).

    ``loader_step``: the draw's global index (the cyclic group is ``loader_step mod b``).
    ``size``: entries in the batch, padding included. ``part``: ``(start, end)`` rows of the drawn
    batch that this slice holds; None for all of it. ``origin``: the loader that drew it.
    ``refusal``: for a batch no loader drew, why the engine could not tie it to a draw (said when a
    step would release it). ``users``: for a user-level draw (``privacy_unit="user"``), the user slot
    (``0..users-1``) of every row of the whole draw, one user's rows consecutive; None for examples.
    """

    loader_step: int | None
    size: int
    group: int = 0
    padding_mask: torch.Tensor | None = None
    part: tuple[int, int] | None = None
    draw: Any = field(default=None, repr=False)  # identity of the whole draw (shared by its slices)
    origin: LoaderOrigin | None = field(default=None, repr=False)
    refusal: str = ""
    users: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.draw is None:
            object.__setattr__(self, "draw", object())

    @property
    def tracked(self) -> bool:
        """Whether a private loader drew this batch (``loader_step`` is not None). A step that would release
        an untracked batch refuses it when its optimizer has a private loader or the ticket carries a
        ``refusal`` (which says why)."""
        return self.loader_step is not None

    @property
    def rows(self) -> tuple[int, int]:
        """``(start, end)``: the rows of the drawn batch this ticket holds (``(0, size)`` for the whole batch)."""
        return self.part if self.part is not None else (0, self.size)

    @property
    def num_rows(self) -> int:
        """The number of rows this ticket holds (``end - start`` of ``rows``)."""
        start, end = self.rows
        return end - start

    def slice(self, start: int, end: int) -> BatchTicket:
        """The ticket of rows ``[start, end)`` of this batch (a micro-batch)."""
        first, last = self.rows
        if not 0 <= start <= end <= last - first:
            raise ValueError(f"slice [{start}, {end}) is outside a batch of {last - first} rows")
        return BatchTicket(
            loader_step=self.loader_step, size=self.size, group=self.group, padding_mask=self.padding_mask,
            part=(first + start, first + end), draw=self.draw, origin=self.origin, users=self.users,
        )  # fmt: skip

    def whole(self) -> BatchTicket:
        """The ticket of the whole drawn batch this one is a slice of."""
        if self.part is None:
            return self
        return BatchTicket(loader_step=self.loader_step, size=self.size, group=self.group,
                           padding_mask=self.padding_mask, draw=self.draw, origin=self.origin,
                           users=self.users)  # fmt: skip

    def mask(self) -> torch.Tensor | None:
        """The padding mask of the rows this ticket holds (None: no padding)."""
        if self.padding_mask is None:
            return None
        start, end = self.rows
        return self.padding_mask[start:end]

    def user_rows(self) -> torch.Tensor | None:
        """The user slot of each row this ticket holds (None: an example-level batch)."""
        if self.users is None:
            return None
        start, end = self.rows
        return self.users[start:end]

    def same_rows(self, other: BatchTicket | None) -> bool:
        """Whether ``other`` holds exactly the same rows of the same draw (False for None). Compares the
        draw's identity, never sizes: two draws of equal size are different batches."""
        return other is not None and other.draw is self.draw and other.rows == self.rows

    def differs_in_effect(self, other: BatchTicket) -> bool:
        """Whether using one for the other would change the release (padding or group)."""
        if self.group != other.group:
            return True
        if (self.users is None) != (other.users is None) or (
            self.users is not None and not torch.equal(self.user_rows(), other.user_rows())
        ):
            return True
        if (self.padding_mask is None) != (other.padding_mask is None):
            return True
        return self.padding_mask is not None and not torch.equal(self.mask(), other.mask())


# ---------------------------------------------------------------------------------------------- tags
def iter_tensors(value: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """The tensors in ``value``: itself if a tensor, else those in its mapping values, lists and tuples,
    looked into up to three containers deep (deeper tensors, and tensors inside other containers, are
    not yielded)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, Mapping):
        for item in value.values():
            yield from iter_tensors(item, depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item, depth + 1)


def tag_tensor(tensor: torch.Tensor, ticket: BatchTicket) -> None:
    """Attach ``ticket`` to ``tensor``; the tag holds until the tensor is modified in place."""
    try:
        setattr(tensor, TICKET_ATTRIBUTE, ticket)
        setattr(tensor, _VERSION_ATTRIBUTE, tensor._version)
    except (AttributeError, RuntimeError):  # a tensor type that refuses attributes
        pass


def tag_batch(batch: Any, ticket: BatchTicket) -> None:
    """Attach ``ticket`` to every tensor of ``batch`` (so it travels with the tensors themselves)."""
    for tensor in iter_tensors(batch):
        tag_tensor(tensor, ticket)


def _own_tag(tensor: torch.Tensor) -> BatchTicket | None:
    ticket = getattr(tensor, TICKET_ATTRIBUTE, None)
    if ticket is None:
        return None
    # Modified in place since it was tagged (a buffer the next batch was copied into): the tag no
    # longer says what the tensor holds.
    return ticket if getattr(tensor, _VERSION_ATTRIBUTE, None) == tensor._version else None


def _rows_of_view(view: torch.Tensor, base: torch.Tensor, batch_dim: int) -> tuple[int, int] | None:
    """``(start, end)``: the rows of ``base`` (dim 0) that rows ``0..n`` of ``view`` (along
    ``batch_dim``) lie inside, one view row inside one base row, consecutively; None when the view
    is not such a view (its rows mix examples, or its layout cannot be read)."""
    if view.dtype != base.dtype or base.dim() == 0 or view.dim() <= batch_dim or base.numel() == 0:
        return None
    if view.numel() == 0 or min(base.stride() + view.stride(), default=0) < 0:
        return None
    row_extent = sum((n - 1) * s for n, s in zip(base.shape[1:], base.stride()[1:]))  # last offset in a row
    row_stride = base.stride(0) if base.shape[0] > 1 else row_extent + 1
    if row_stride <= row_extent:
        return None  # the base's rows interleave: a row is not a block of memory
    offset = view.storage_offset() - base.storage_offset()
    if offset < 0:
        return None
    start, within = divmod(offset, row_stride)
    rows = view.shape[batch_dim]
    if rows > 1 and view.stride(batch_dim) != row_stride:
        return None
    inner = sum((n - 1) * s for d, (n, s) in enumerate(zip(view.shape, view.stride())) if d != batch_dim)
    if within + inner > row_extent or start + rows > base.shape[0]:
        return None
    return start, start + rows


def _ticket_of(tensor: torch.Tensor, batch_dim: int) -> BatchTicket | None:
    ticket = _own_tag(tensor)
    if ticket is not None:
        return ticket
    base = tensor._base
    parent = None if base is None else _own_tag(base)
    if parent is None or base.shape[0] != parent.num_rows:
        return None
    rows = _rows_of_view(tensor, base, batch_dim)
    if rows is None:
        return None
    return parent if rows == (0, parent.num_rows) else parent.slice(*rows)


def find_ticket(*values: Any, batch_dim: int = 0) -> BatchTicket | None:
    """The ticket carried by the tensors in ``values``, or by the tagged batch they are views of
    (with the batch along ``batch_dim``); ``RuntimeError`` if they carry two batches' tickets."""
    return ticket_of_tensors(iter_tensors(list(values)), batch_dim=batch_dim)


def forward_tensors(args: tuple, kwargs: Mapping) -> list[torch.Tensor]:
    """``list(iter_tensors([args, kwargs]))``: the tensors of a forward's arguments, in that order. The usual
    ``model(x)`` (plain tensors, no keyword) is answered without the generators' walk (at every forward)."""
    if not kwargs and type(args) is tuple and all(type(arg) is torch.Tensor for arg in args):
        return list(args)
    return list(iter_tensors([args, kwargs]))


def ticket_of_tensors(tensors: Iterable[torch.Tensor], *, batch_dim: int = 0) -> BatchTicket | None:
    """``find_ticket`` over tensors already listed (``iter_tensors``' or ``forward_tensors``' answer): the same
    ticket, or the same ``RuntimeError``."""
    found: BatchTicket | None = None
    for tensor in tensors:
        ticket = _ticket_of(tensor, batch_dim if tensor._base is not None else 0)
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

    Use it in place of ``.to(device)`` where the copy would not be recognised by its values: a batch
    used long after it was yielded (more than ``RECENT_BATCHES`` batches later), or a copy that
    changes the values (``dtype=``).
    """
    if isinstance(batch, torch.Tensor):
        moved = batch.to(device, **kwargs)
        ticket = _own_tag(batch)
        if ticket is not None:
            tag_tensor(moved, ticket)
        return moved
    if isinstance(batch, Mapping):
        return type(batch)({key: move_to(value, device, **kwargs) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to(value, device, **kwargs) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(value, device, **kwargs) for value in batch)
    return batch


# ---------------------------------------------------------------------------------------------- values
_FINGERPRINT_ATTRIBUTE = "_privacy_engine_row_fingerprints"


def flat_rows(tensor: torch.Tensor, batch_dim: int = 0) -> torch.Tensor:
    """``tensor`` as a matrix with one row per entry along ``batch_dim``."""
    rows = tensor.movedim(batch_dim, 0)
    if rows.is_complex():
        rows = torch.view_as_real(rows)
    return rows.reshape(rows.shape[0], -1)


# Fingerprints read at most this many values of a row (a fixed random choice of columns): enough to
# tell distinct rows apart in practice, and the exact comparison settles the rest.
_FINGERPRINT_COLUMNS = 1024


@functools.lru_cache(maxsize=16)
def _projection(width: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(columns read or None for all, their weights) of the fingerprint of rows of ``width`` values."""
    generator = torch.Generator().manual_seed(20261125)
    columns = None
    if width > _FINGERPRINT_COLUMNS:
        columns = torch.randperm(width, generator=generator)[:_FINGERPRINT_COLUMNS].sort().values.to(device)
        width = _FINGERPRINT_COLUMNS
    return columns, (torch.rand(width, generator=generator, dtype=torch.float64) + 0.5).to(device)


def _fingerprints(tensor: torch.Tensor, batch_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 projection of each row of ``tensor`` (along ``batch_dim``), and the scale its
    rounding error is relative to. Equal rows give projections within ``_close_pairs``' tolerance of
    each other, whatever their values (NaN and ±Inf included): the projections only pick the pairs to
    compare exactly. Kept on the tensor until it is modified in place (a batch is compared with every
    copy of it)."""
    key = (batch_dim, tensor._version)
    cached = getattr(tensor, _FINGERPRINT_ATTRIBUTE, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    rows = flat_rows(tensor, batch_dim)
    columns, weights = _projection(rows.shape[1], rows.device)
    values = (rows if columns is None else rows[:, columns]).double()
    if rows.is_floating_point():
        values = torch.nan_to_num(values, nan=0.5, posinf=1e30, neginf=-1e30).clamp_(-1e30, 1e30)
    result = (values @ weights, values.abs() @ weights)
    try:
        setattr(tensor, _FINGERPRINT_ATTRIBUTE, (key, result))
    except (AttributeError, RuntimeError):
        pass
    return result


def _close_pairs(a: torch.Tensor, a_dim: int, b: torch.Tensor, b_dim: int) -> torch.Tensor:
    """``(rows of a, rows of b)`` bool, on ``b``'s device: the row pairs whose fingerprints are close
    (a superset of the equal pairs). Each side is fingerprinted where it lives; only the fingerprints
    move (the loader's batches stay on the host when the model's copies are on a GPU)."""
    fa, sa = (value.to(b.device) for value in _fingerprints(a, a_dim))
    fb, sb = _fingerprints(b, b_dim)
    tolerance = (_FINGERPRINT_COLUMNS * 4e-16 + 1e-13) * (sa[:, None] + sb[None, :]) + 1e-300
    return (fa[:, None] - fb[None, :]).abs() <= tolerance


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values (NaN equal to NaN); ``b`` is moved to ``a``'s device."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    b = b.to(a.device)
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() or not bool(a.isnan().any()):
        return bool(a.is_floating_point() and (a == b).all())  # -0.0 == 0.0, which torch.equal may not say
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _comparable(a: torch.Tensor, a_dim: int, b: torch.Tensor, b_dim: int) -> bool:
    """Same dtype and the same number of values per row."""
    if a.dtype != b.dtype or a.dim() <= a_dim or b.dim() <= b_dim:
        return False
    return a.numel() * b.shape[b_dim] == b.numel() * a.shape[a_dim] and (a.numel() == 0) == (b.numel() == 0)


def row_runs(candidate: torch.Tensor, batch_dim: int, reference: torch.Tensor) -> list[int]:
    """The starts ``a`` at which the rows of ``candidate`` (along ``batch_dim``) equal rows
    ``a .. a + n`` of ``reference`` (along dim 0), value for value, on any devices (only the run
    compared exactly moves). An empty candidate matches only an empty reference (at 0).

    Guarantee: exact (no false match, no missed one): fingerprints only select the runs to compare
    value for value. NaN equals NaN; -0.0 equals 0.0.

    ==========================  ===========================
    case                        result
    ==========================  ===========================
    dtype or row width differs  [] (a ``dtype=`` copy is not recognised)
    candidate longer            []
    both empty                  [0]
    duplicate runs              every start
    ==========================  ===========================
    """
    count, total = candidate.shape[batch_dim] if candidate.dim() > batch_dim else -1, reference.shape[0]
    if count == 0 or total == 0:
        return [0] if count == total and candidate.dtype == reference.dtype else []
    if not _comparable(candidate, batch_dim, reference, 0) or count > total:
        return []
    close = _close_pairs(candidate, batch_dim, reference, 0)
    rows = None
    starts = []
    for start in close[0, : total - count + 1].nonzero().flatten().tolist():
        if bool(close.diagonal(start)[:count].all()):
            rows = flat_rows(candidate, batch_dim) if rows is None else rows
            if _same_values(rows, flat_rows(reference[start : start + count])):
                starts.append(start)
    return starts


def shares_a_row(candidate: torch.Tensor, batch_dim: int, reference: torch.Tensor, reference_dim: int, *,
                 aligned_at: int | None = None) -> bool:  # fmt: skip
    """Whether some row ``i`` of ``candidate`` equals some row ``j`` of ``reference`` (each along its
    batch dimension), not counting the pairs ``j == aligned_at + i`` (the same example's own row)."""
    if not _comparable(candidate, batch_dim, reference, reference_dim) or candidate.numel() == 0:
        return False
    candidate_rows, reference_rows = flat_rows(candidate, batch_dim), flat_rows(reference, reference_dim)
    for i, j in _close_pairs(candidate, batch_dim, reference, reference_dim).nonzero().tolist():
        if (aligned_at is None or j != aligned_at + i) and _same_values(candidate_rows[i], reference_rows[j]):
            return True
    return False


# ---------------------------------------------------------------------------------------------- queue
class TicketQueue:
    """Tickets a loader has yielded whose batch no forward has used yet, oldest first, and the
    tensors of its last ``RECENT_BATCHES`` batches."""

    def __init__(self, name: str = "DPDataLoader") -> None:
        self._tickets: collections.deque[BatchTicket] = collections.deque(maxlen=MAX_QUEUED_TICKETS)
        self._recent: collections.deque[tuple[BatchTicket, tuple[torch.Tensor, ...]]] = collections.deque(
            maxlen=RECENT_BATCHES
        )
        self.last_issued: BatchTicket | None = None
        #: The loader's identity on its tickets.
        self.origin = LoaderOrigin(name)

    def issue(self, ticket: BatchTicket, batch: Any = None) -> None:
        """Queue ``ticket`` (the loader yielded its batch) and make it ``last_issued``; with ``batch``, also
        keep references to its tensors (those with at least one dimension) among the ``RECENT_BATCHES``
        recent ones, so that a copy of them is recognised by its values. Beyond ``MAX_QUEUED_TICKETS``
        unused tickets the oldest is forgotten."""
        self._tickets.append(ticket)
        self.last_issued = ticket
        if batch is not None:
            self._recent.append((ticket, tuple(t for t in iter_tensors(batch) if t.dim() > 0)))

    def clear(self) -> None:
        """Forget every queued ticket (``last_issued`` and the recent batches are kept)."""
        self._tickets.clear()

    def __iter__(self) -> Iterator[BatchTicket]:
        return iter(list(self._tickets))

    def __len__(self) -> int:
        return len(self._tickets)

    def __contains__(self, ticket: BatchTicket) -> bool:
        return any(t.draw is ticket.draw for t in self._tickets)

    def recent(self) -> list[tuple[BatchTicket, tuple[torch.Tensor, ...]]]:
        """``(ticket, tensors)`` of the last batches yielded, oldest first."""
        return list(self._recent)

    def take(self, ticket: BatchTicket) -> list[BatchTicket]:
        """Remove ``ticket``'s draw and every older one; return the older (skipped) ones."""
        tickets = self._tickets
        if tickets and tickets[0].draw is ticket.draw:  # the oldest: the usual loop, without the scan below
            tickets.popleft()
            return []
        if ticket not in self:
            return []
        skipped = []
        while self._tickets:
            head = self._tickets.popleft()
            if head.draw is ticket.draw:
                return skipped
            skipped.append(head)
        return skipped

    def put_back(self, ticket: BatchTicket) -> None:
        """Return a whole draw that a forward took but never used (its backward never ran)."""
        if ticket.part is None and ticket.tracked and ticket not in self:
            self._tickets.appendleft(ticket)
