"""The step contract: what one released step contains, and where each rule of it is enforced.

Guarantee (the loop contract). Each ``DPOptimizer.step()`` releases the noised sum of the clipped
contributions of exactly the examples the accounted sampling drew for that step, each example clipped
on its own, and records that step with the accountant as the mechanism actually run; or it raises a
clear error before anything is released or counted.

How the pieces meet:

- The private loader (``DPDataLoader``) issues a ``BatchTicket`` for every batch it yields: the draw's
  global step index, its cyclic group and its padding mask. The ticket is attached to the tensors of
  the batch (``tag_batch``) and queued on the loader (both in ``privacy_engine.training.batch_tickets``).
- The wrapped module asks ``StepContract.resolve`` at every training forward which batch it is running
  on: the ticket found on its input tensors, or, when the tensors were copied (``.to(device)``), the
  oldest queued ticket of the same size. Consecutive forwards smaller than the batch are consecutive
  slices of it (``x.split(n)`` micro-batches). A backward pass is clipped with the padding mask of its
  own batch, so the mask travels with the batch whatever the iteration order.
- A backward pass's per-sample contributions are clipped on their own unless they come from the same
  batch (same examples) as the previous pass, in which case they are summed per example first
  (hooks mode; fast clipping refuses, since its norms cannot be added).
- ``StepContract.close`` (called by ``step()``) decides what the release contains and checks it.

Loop patterns (what each does under the contract):

==========================================  ==========================================================
loop pattern                                result
==========================================  ==========================================================
textbook (one batch, backward, step)        released and recorded as one sampled step
several batches, then one step              each batch clipped on its own; recorded as ``k`` draws in
(naive gradient accumulation)               one release (a mixture-of-Gaussians event, PLD
                                            accountant); divided by ``k * expected_batch_size``;
                                            BandMF / truncated sampling: ``ValueError``
micro-batches of one batch                  slices clipped on their own, one draw
(``VirtualSteps`` or ``x.split``)
two backward passes over the same batch     hooks: summed per example, then clipped once;
                                            ghost: ``RuntimeError`` at the second forward
a parameter unfrozen / frozen mid-run       the private set is read at every forward and step: a newly
                                            trainable parameter is clipped and noised (the noise
                                            layout restarts), a newly frozen one gets no update
model in ``eval()`` or unwrapped, then      ``RuntimeError`` at ``step()``: gradients exist without
backward + step                             per-sample contributions; nothing released or counted
another optimizer stepped the parameters    ``RuntimeError`` at the next forward or step
exception in forward or backward            that batch's partial state is discarded at the next forward
a batch skipped (empty, NaN loss, break)    never released; BandMF: its noise row is drawn and
                                            discarded and the step counted, so groups and noise rows
                                            stay tied to the loader's step index
prefetcher / ``list(loader)``               tickets travel on the tensors; copied tensors are matched
                                            by order and size; an ambiguous match that would change
                                            the padding or the group raises ``RuntimeError``
a batch from another source than the        ``RuntimeError`` at ``step()`` (it was not drawn by the
private loader                              accounted sampling), unless it ran before the backward of a
                                            drawn batch of the same size: then it holds other inputs
                                            of those examples (a GAN's generated batch), row i joined
                                            to example i and clipped with it
a batch released after a later one         ``RuntimeError`` (BandMF rows must increase)
==========================================  ==========================================================
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from privacy_engine.training.batch_tickets import BatchTicket, TicketQueue, find_ticket, iter_tensors

__all__ = ["Release", "StepContract", "forget_wrapper", "register_optimizer", "register_wrapper"]


# ---------------------------------------------------------------------------------------------- binding
# Live wrappers (GradSampleModule) and private optimizers (DPOptimizer): whichever is built second binds
# to the other, so a hand-built pair follows the contract as the engine's does.
_WRAPPERS: weakref.WeakSet = weakref.WeakSet()
_OPTIMIZERS: list[weakref.ref] = []  # in creation order: the newest matching optimizer binds last (wins)


def register_wrapper(wrapper: Any) -> None:
    _WRAPPERS.add(wrapper)
    _OPTIMIZERS[:] = [ref for ref in _OPTIMIZERS if ref() is not None]
    for ref in list(_OPTIMIZERS):
        optimizer = ref()
        if optimizer is not None:
            optimizer._bind_if_ours(wrapper)


def register_optimizer(optimizer: Any) -> None:
    _OPTIMIZERS[:] = [ref for ref in _OPTIMIZERS if ref() is not None]
    _OPTIMIZERS.append(weakref.ref(optimizer))
    for wrapper in list(_WRAPPERS):
        optimizer._bind_if_ours(wrapper)


def forget_wrapper(wrapper: Any) -> None:
    _WRAPPERS.discard(wrapper)


# ---------------------------------------------------------------------------------------------- release
@dataclass(frozen=True)
class Release:
    """What one ``step()`` releases: the draws its contributions came from."""

    draws: tuple[BatchTicket, ...]  # one ticket per distinct draw (whole-batch tickets)
    untracked: bool  # some contribution came from data no private loader drew

    @property
    def num_draws(self) -> int:
        return len(self.draws)

    @property
    def loader_step(self) -> int | None:
        steps = [t.loader_step for t in self.draws if t.loader_step is not None]
        return max(steps) if steps else None


class StepContract:
    """The bookkeeping of one private optimizer's open step: the batch each forward ran on, the
    backward passes whose contributions are accumulated, and the checks made before a release.

    ``resolve`` is called by the wrapped module at every training forward, ``contributed`` when a
    backward pass's contributions reached the clipper (or are held as ``grad_sample``), and
    ``close`` by ``step()`` to learn what the release contains. See the module docstring for the
    table of loop patterns.
    """

    def __init__(self) -> None:
        self._queues: list[TicketQueue] = []
        self._modules: weakref.WeakSet = weakref.WeakSet()
        self._contributions: list[BatchTicket] = []
        self.current: BatchTicket | None = None  # the batch of the newest training forward
        self._slice_end: int | None = None  # rows of `current`'s draw used so far by consecutive slices
        self._version_snapshot: tuple[int, ...] | None = None
        self._last_input: weakref.ref | None = None
        # Draws already released (a few recent ones suffice: a draw is only ever reused by the same loop).
        self._released_draws: collections.deque = collections.deque(maxlen=64)
        self.last_released_step: int | None = None

    # ---------------------------------------------------------------------------------------- wiring
    def attach_queue(self, queue: TicketQueue) -> None:
        if all(existing is not queue for existing in self._queues):
            self._queues.append(queue)

    def attach_module(self, module: Any) -> None:
        self._modules.add(module)

    @property
    def has_loader(self) -> bool:
        return bool(self._queues)

    @property
    def modules(self) -> list:
        return list(self._modules)

    # ---------------------------------------------------------------------------------------- forward
    def resolve(self, args: tuple, kwargs: Mapping, batch_size: int, *, join_pending: bool = False) -> BatchTicket:
        """The batch a training forward of ``batch_size`` examples runs on (see the module docstring):
        the ticket on its input tensors; else the same batch as the previous forward if it gets the same
        input tensor; else the next slice of a batch being split; else the oldest queued batch of that
        size; else, when ``join_pending`` (the previous forward ran on a drawn batch whose backward has
        not run yet), the same examples (other inputs for them: a GAN discriminator's generated batch,
        row i joined to example i and clipped with it); else an untracked batch (data no private loader
        drew)."""
        first_input = next(iter(iter_tensors([args, kwargs])), None)
        ticket = find_ticket(args, kwargs)
        if ticket is not None:
            for queue in self._queues:
                queue.take(ticket)
            rows = ticket.rows[1] - ticket.rows[0]
            if rows != batch_size:
                if ticket.part is not None or batch_size > ticket.size:
                    raise RuntimeError(
                        f"a forward ran on {batch_size} examples but its input belongs to a batch of {rows}: the "
                        f"model must see exactly the drawn examples (each once per step); do not add rows"
                    )
                ticket = self._slice_of(ticket, batch_size)
            else:
                self._slice_end = None
        elif first_input is not None and self._last_input is not None and self._last_input() is first_input:
            ticket = self.current  # the same batch again (a second forward on the same tensor)
        else:
            ticket = self._continuing_slice(batch_size) if self.current is not None else None
            if ticket is None:
                candidates = [t for queue in self._queues for t in queue]
                ticket = self._match_queued(candidates, batch_size) if candidates else None
            current = self.current
            if ticket is None and join_pending and current is not None and current.tracked:
                if current.rows[1] - current.rows[0] == batch_size:
                    ticket = current
            if ticket is None:
                ticket = BatchTicket(loader_step=None, size=batch_size)
                self._slice_end = None
        self.current = ticket
        self._last_input = None if first_input is None else weakref.ref(first_input)
        return ticket

    def _continuing_slice(self, batch_size: int) -> BatchTicket | None:
        """The next slice of the current draw, when the previous forwards used only part of it."""
        if self._slice_end is None:
            return None
        current = self.current
        if self._slice_end + batch_size > current.size:
            return None
        start = self._slice_end
        self._slice_end = start + batch_size
        if self._slice_end == current.size:
            self._slice_end = None
        whole = BatchTicket(loader_step=current.loader_step, size=current.size, group=current.group,
                            padding_mask=current.padding_mask, draw=current.draw)  # fmt: skip
        return whole.slice(start, start + batch_size)

    def _slice_of(self, ticket: BatchTicket, batch_size: int) -> BatchTicket:
        if batch_size > ticket.size:
            raise RuntimeError(
                f"a forward ran on {batch_size} examples but the private loader's batch holds {ticket.size}: the "
                f"model must see exactly the drawn examples (each once per step); do not add rows to the batch"
            )
        self._slice_end = batch_size if batch_size < ticket.size else None
        return ticket.slice(0, batch_size)

    def _match_queued(self, candidates: list[BatchTicket], batch_size: int) -> BatchTicket | None:
        matching = [t for t in candidates if t.size == batch_size]
        if matching:
            chosen = matching[0]
            later = [t for t in matching[1:] if chosen.differs_in_effect(t)]
            if later:
                raise RuntimeError(
                    "cannot tell which batch of the private loader this forward runs on: several batches of "
                    f"{batch_size} examples were yielded and not yet used, with different padding or cyclic "
                    "groups, and the tensors given to the model carry no batch tag (they were copied, e.g. by "
                    ".to(device)). Move batches with privacy_engine.move_to(batch, device), which keeps the tag, "
                    "or use each batch before drawing the next."
                )
            for queue in self._queues:
                queue.take(chosen)
            self._slice_end = None
            return chosen
        oldest = candidates[0]
        if batch_size < oldest.size:
            for queue in self._queues:
                queue.take(oldest)
            return self._slice_of(oldest, batch_size)
        return None

    def abandon(self, ticket: BatchTicket) -> None:
        """A forward's batch whose backward never ran: it may still be used by a later forward."""
        for queue in self._queues:
            queue.put_back(ticket)

    def check_parameters_unchanged(self, params: list[torch.nn.Parameter], *, where: str) -> None:
        """Raise if the parameters changed in place since the open step's first forward (another
        optimizer stepped them); the first call of a step takes the snapshot."""
        versions = tuple(p._version for p in params)
        if self._version_snapshot is None or len(self._version_snapshot) != len(versions):
            self._version_snapshot = versions
            return
        if versions != self._version_snapshot and (self._contributions or self._pending_grad_samples()):
            self._version_snapshot = None
            raise RuntimeError(
                f"the model's parameters changed since the forward of a batch whose private step has not been "
                f"taken (detected at {where}): another optimizer (one built over model.parameters() after "
                f"make_private?) updated them with non-private gradients. Step only the optimizer returned by "
                f"make_private."
            )
        self._version_snapshot = versions

    def _pending_grad_samples(self) -> bool:
        return any(getattr(module, "_grad_sample_ticket", None) is not None for module in self._modules)

    # ---------------------------------------------------------------------------------------- backward
    def contributed(self, ticket: BatchTicket) -> None:
        """A backward pass over ``ticket``'s rows reached the clipper."""
        self._contributions.append(ticket)

    def already_contributed(self, ticket: BatchTicket) -> bool:
        return any(t.same_rows(ticket) for t in self._contributions)

    # ---------------------------------------------------------------------------------------- step
    def close(self) -> Release:
        """What the step about to be released contains (the contributions since the last step)."""
        draws: dict[int, BatchTicket] = {}
        untracked = False
        for ticket in self._contributions:
            if not ticket.tracked:
                untracked = True
                continue
            draws.setdefault(id(ticket.draw), ticket)
        ordered = tuple(sorted(draws.values(), key=lambda t: t.loader_step))
        for ticket in ordered:
            if any(ticket.draw is done for done in self._released_draws):
                raise RuntimeError(
                    f"the batch of loader step {ticket.loader_step} was already released by an earlier step: a second "
                    f"release of the same draw is not a fresh sample, and the accounting assumes one. Draw a new batch "
                    f"for every optimizer.step()."
                )
        return Release(draws=ordered, untracked=untracked)

    def take_unused_draw(self) -> BatchTicket | None:
        """For a step with no contribution: the oldest yielded batch that no forward used (an empty
        batch whose backward the loop skipped), which this step then releases (as noise alone)."""
        for queue in self._queues:
            for ticket in queue:
                queue.take(ticket)
                return ticket
        return None

    def released(self, release: Release, loader_step: int | None) -> None:
        """Forget the open step's contributions after a release (or a discarded logical step)."""
        self._contributions = []
        self._version_snapshot = None
        self._released_draws.extend(ticket.draw for ticket in release.draws)
        if loader_step is not None:
            self.last_released_step = loader_step

    def discard(self) -> None:
        self._contributions = []
        self._version_snapshot = None
