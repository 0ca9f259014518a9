"""The step contract: what one released step contains, and where each rule of it is enforced.

Guarantee (the loop contract). Each ``DPOptimizer.step()`` releases the noised sum of the clipped
contributions of exactly the examples the accounted sampling drew for that step, each example clipped
on its own, and records that step with the accountant as the mechanism actually run; or it raises a
clear error before anything is released or counted.

How the pieces meet:

- ``privacy_engine.connect_private(module, optimizer, data_loader)`` connects one wrapper, one
  ``DPOptimizer`` and one private loader, for good (``make_private`` calls it on what it builds; a
  hand-built pipeline calls it once). Nothing connects by itself: building a wrapper or an optimizer
  binds nothing, and there is no registry of live ones.
- The private loader (``DPDataLoader``) issues a ``BatchTicket`` for every batch it yields: the draw's
  global step index, its cyclic group and its padding mask. The ticket is attached to the tensors of
  the batch (``tag_batch``) and queued on the loader (both in ``privacy_engine.batches.tickets``).
- The wrapped module asks ``StepContract.resolve`` at every training forward which batch it is running
  on, identified exactly, never by its size: the ticket on its input tensors (valid until the tensor is
  modified in place), or on the tagged batch they are views of (row slices, ``x.split(n)``, reshapes
  that keep the batch dimension); else, for a copy (``.to(device)``, ``.clone()``, ``.contiguous()``,
  ``.pin_memory()``), the draw whose rows its values equal, among the last ``RECENT_BATCHES`` (4)
  batches of this optimizer's own loader (the copy is then tagged). A backward pass is clipped with the
  padding mask of its own batch, so the mask travels with the batch whatever the iteration order.
- Every ticket knows its loader (``BatchTicket.origin``); an optimizer has one loader
  (``connect_private``'s ``data_loader``; connected without one, it adopts the loader of the first drawn
  batch it trains on) and
  releases only that loader's draws: a batch of another loader is untracked, so refused at ``step()``.
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
wrapper not connected (a hand-built         ``RuntimeError`` at ``step()`` (or when its per-sample
wrapper and ``DPOptimizer`` without         gradients would be clipped), naming
``connect_private``)                        ``privacy_engine.connect_private``: nothing released or
                                            counted. ``grad_sample`` set by hand on parameters no
                                            wrapper holds (a bare optimizer) is released as before
model in ``eval()`` or unwrapped, then      ``RuntimeError`` at ``step()``: gradients exist without
backward + step                             per-sample contributions; nothing released or counted
another optimizer stepped the parameters    ``RuntimeError`` at the next forward or step
exception in forward or backward            that batch's partial state is discarded at the next forward
a batch skipped (empty, NaN loss, break)    never released; BandMF: its noise row is drawn and
                                            discarded and the step counted, so groups and noise rows
                                            stay tied to the loader's step index
a training forward on a drawn batch with    ``RuntimeError`` at ``step()``: nothing released or counted
examples, then ``step()`` with no backward  (it would release noise alone in place of the batch's sum);
                                            the backward may still run, then ``step()``. A batch of
                                            padding rows only (or empty) releases noise alone
prefetcher / ``list(loader)``               tickets travel on the tensors (views of them included);
                                            an exact copy of one of the loader's last 4 batches (or of
                                            a run of its rows) is that batch (or those rows); a copy of
                                            an older batch, or one that changes values (``dtype=``):
                                            ``RuntimeError`` at ``step()`` saying to use
                                            ``privacy_engine.move_to``; a copy whose values equal
                                            several draws that differ: ``RuntimeError`` at the forward
a buffer refilled in place (``copy_``)      its old tag is dropped; identified by its new values
rows added, dropped, repeated or reordered  not that batch (``cat([x, x])``, ``x.flip(0)``): untracked,
(``cat([x, x])``, ``x[perm]``)              ``RuntimeError`` at ``step()``; a tagged view whose rows
                                            are not the forward's examples: ``RuntimeError`` at once
a batch of another private loader (another  ``RuntimeError`` at ``step()``: its examples were sampled
``make_private`` call's loader), or a copy  at that loader's rate, which this optimizer does not
of one                                      account; ``attach_loader`` of a second loader: ValueError
a batch from another source than the        ``RuntimeError`` at ``step()`` (it was not drawn by the
private loader                              accounted sampling), unless it is joined (next row)
untagged inputs of as many rows, run        joined row for row to the drawn batch's examples (a GAN
before the backward of a drawn batch        discriminator's generated batch; an augmented copy) and
(GAN: ``netD(real)``, ``netD(fake)``, one   clipped with them, if no row i equals a row of the pending
backward)                                   batch or of the loader's last 4 batches other than example
                                            i's own; otherwise ``RuntimeError`` at that forward (rows of
                                            drawn data would be joined to other examples). Checked by
                                            value: data merely derived from drawn rows is not caught
``grad_sample_mode="no_op"``: grad_sample   ``RuntimeError`` at ``step()``, before anything is clipped:
rows != the forward's examples              one row per drawn example of the last training forward
``step()`` again with no new batch (no      ``RuntimeError``, nothing released or counted; a step
training forward, no backward since the     whose batch is empty and skipped by the loop (no forward)
last step)                                  releases noise alone and is counted
a batch released after a later one          ``RuntimeError`` (BandMF rows must increase)
activation checkpointing                    the recomputation in backward is recognised by torch's own
(``torch.utils.checkpoint``, reentrant or   markers and belongs to the forward it recomputes: the same
not; HF ``gradient_checkpointing_enable``)  release as without checkpointing (``capture.recompute``); a
                                            forward during backward that is not a recomputation:
                                            ``RuntimeError``
==========================================  ==========================================================
"""

from __future__ import annotations

import collections
import operator
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from privacy_engine.batches.tickets import (
    RECENT_BATCHES,
    BatchTicket,
    LoaderOrigin,
    TicketQueue,
    find_ticket,
    forward_tensors,
    row_runs,
    shares_a_row,
    tag_tensor,
    ticket_of_tensors,
)

__all__ = ["Release", "StepContract"]

_VERSION = operator.attrgetter("_version")


# ---------------------------------------------------------------------------------------------- refusals
# Why a forward's batch is tied to no draw of this optimizer's loader (said by step() when it refuses).
_UNTAGGED = (
    "the model's inputs carry no batch tag, are no view of a batch, and their values equal no run of rows of "
    f"the loader's last {RECENT_BATCHES} batches, so the engine cannot tell which examples they hold. Give the "
    "model the batch as the loader yielded it (or a row slice or view of it), move it with "
    "privacy_engine.move_to(batch, device) (which keeps the tag), and do any other preprocessing in the dataset or "
    "collate_fn, or inside the model"
)
_DRAWN_ROWS = (
    "a forward ran on untagged inputs before the backward of a drawn batch, as a generated (public) batch joined "
    "row for row to that batch's examples would, but its row i equals a row of the loader's batches other than "
    "example i's own: joined to example i, that row would be released outside its own clipping and accounting. "
    "Between a drawn batch's forward and its backward, feed the model only generated inputs or the batch itself"
)
_TWO_BATCHES = "the model's inputs are copies of two different batches of the loader; give one batch per forward"


def _foreign(ticket: BatchTicket, mine: LoaderOrigin | None) -> str:
    theirs = "another private loader" if ticket.origin is None else ticket.origin.name
    own = "" if mine is None else f" ({mine.name})"
    return (
        f"the batch of loader step {ticket.loader_step} was drawn by {theirs}, not by the loader this optimizer was "
        f"made private with{own}: its examples were sampled at that loader's rate, which this optimizer's "
        f"accounting does not record. Train each private model on the loader its own make_private call returned"
    )


# ---------------------------------------------------------------------------------------------- release
@dataclass(frozen=True)
class Release:
    """What one ``step()`` releases: the draws its contributions came from."""

    draws: tuple[BatchTicket, ...]  # one ticket per distinct draw (whole-batch tickets)
    untracked: bool  # some contribution came from data no private loader drew
    refusals: tuple[str, ...] = ()  # why some contributions could not be tied to a draw of this optimizer

    @property
    def num_draws(self) -> int:
        """The number of distinct draws of the loader whose contributions the step releases."""
        return len(self.draws)

    @property
    def loader_step(self) -> int | None:
        """The latest loader step among the released draws (None if no contribution came from a draw)."""
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
        # A hand-built optimizer (no loader attached): the loader of the first drawn batch it trains on.
        self._adopted_origin: LoaderOrigin | None = None
        # The wrapper attached (at most one), held weakly: the optimizer must not keep a dropped model alive.
        self._module_ref: weakref.ref | None = None
        self._contributions: list[BatchTicket] = []
        self.current: BatchTicket | None = None  # the batch of the newest training forward
        # The inputs of the newest forward on a drawn batch (until its step): what a joined batch is
        # compared with, row by row.
        self._pending_inputs: tuple[tuple[torch.Tensor, int], ...] = ()
        self._version_snapshot: tuple[int, ...] | None = None
        self._last_input: tuple[weakref.ref, int] | None = None  # the previous forward's first input, its version
        # Draws already released (a few recent ones suffice: a draw is only ever reused by the same loop).
        self._released_draws: collections.deque = collections.deque(maxlen=64)
        self.last_released_step: int | None = None
        # Since the last release: a training forward ran or a pass contributed. True before the first
        # release: only a step *again* without a batch is refused (a fresh optimizer's first step may
        # release noise alone, as the bare optimizer's noise tests do).
        self._new_batch = True
        self._forwarded_draw: BatchTicket | None = None  # the newest drawn batch a forward ran on since
        self._noise_only_draw: BatchTicket | None = None  # a draw released as noise alone by the open step

    # ---------------------------------------------------------------------------------------- wiring
    def attach_queue(self, queue: TicketQueue) -> None:
        """Make ``queue``'s loader this optimizer's loader; ``ValueError`` if it has another one."""
        if any(existing is queue for existing in self._queues):
            return
        if self._queues:
            raise ValueError(
                f"this optimizer already draws its batches from {self._queues[0].origin.name}: one optimizer "
                f"releases the draws of one private loader, accounted at that loader's sample rate. Make a second "
                f"model private with its own make_private call (it returns its own loader)."
            )
        self._queues.append(queue)

    def attach_module(self, module: Any) -> None:
        """Make ``module`` the wrapper whose passes this optimizer releases (``connect_private`` does it, once);
        ``ValueError`` if another wrapper already is."""
        existing = None if self._module_ref is None else self._module_ref()
        if existing is not None and existing is not module:
            raise ValueError(
                "this optimizer is already connected to another wrapper: one optimizer releases the per-sample "
                "gradients of one wrapper (privacy_engine.connect_private)."
            )
        self._module_ref = weakref.ref(module)

    @property
    def has_contributions(self) -> bool:
        """Whether a backward pass contributed to the open step (see ``contributed``)."""
        return bool(self._contributions)

    @property
    def has_loader(self) -> bool:
        """Whether a private loader is attached (``attach_queue``): then ``step()`` refuses untracked batches."""
        return bool(self._queues)

    @property
    def origin(self) -> LoaderOrigin | None:
        """The loader whose draws this optimizer releases: the attached one, else the one adopted from the
        first drawn batch a hand-built optimizer trained on, else None."""
        return self._queues[0].origin if self._queues else self._adopted_origin

    @property
    def modules(self) -> list:
        """The wrappers attached (``attach_module``; at most one), as a new list."""
        module = None if self._module_ref is None else self._module_ref()
        return [] if module is None else [module]

    # ---------------------------------------------------------------------------------------- forward
    def resolve(self, args: tuple, kwargs: Mapping, batch_size: int, *, batch_dim: int = 0,
                join_pending: bool = False) -> BatchTicket:  # fmt: skip
        """The batch a training forward of ``batch_size`` examples (along ``batch_dim`` of its inputs)
        runs on, identified exactly (see the module docstring): the tag on its input tensors or on the
        batch they are row views of; else, for an untagged tensor, the batch of the previous forward if
        it is the same tensor object; else the batch whose rows its values equal (a copy: it is tagged);
        else, when ``join_pending`` (a forward on a drawn batch ran and its backward has not), that
        batch, if no input row equals a row of drawn data (a GAN's generated batch, row i joined to
        example i); else an untracked batch, which ``step()`` refuses when a loader is attached.

        Guarantee: the ticket returned is a draw of this optimizer's loader only if the forward's
        inputs are exactly that draw's rows (tagged, a row view, or a value-equal copy), or inputs of
        as many rows joined to them, none equal to a drawn row other than example i's own.

        =====================================  ==========================================
        inputs                                 result
        =====================================  ==========================================
        tagged, or a row view of a tagged one  its draw (or the slice of it)
        copy of a recent batch (or a run of    that draw (or slice); the copy is tagged
        its rows)
        copy equal to several draws            ``RuntimeError`` (cannot tell)
        another loader's batch                 untracked: refused at ``step()``
        drawn rows != ``batch_size``           ``RuntimeError``
        untagged, a drawn batch awaiting its   that draw (joined); ``RuntimeError`` if a
        backward, as many rows                 row equals another drawn row
        anything else                          untracked: refused at ``step()`` when a
                                               loader is attached
        =====================================  ==========================================
        """
        self._new_batch = True
        inputs = forward_tensors(args, kwargs)
        first_input = inputs[0] if inputs else None
        holds_the_batch = True  # the inputs are (views or copies of) the batch, not inputs joined to it
        ticket = ticket_of_tensors(inputs, batch_dim=batch_dim)  # find_ticket(args, kwargs), one walk fewer
        if ticket is None and first_input is not None and self._last_input is not None:
            last, version = self._last_input
            if last() is first_input and first_input._version == version:
                ticket = self.current  # the same (untagged, unmodified) tensor as the previous forward: that batch
                holds_the_batch = False
        refusal = ""
        if ticket is None and self._queues:
            # (No loader, no recent batch: nothing is recognised or tagged, and the tickets looked up again
            # would be the ones just found: none.)
            refusal = self._recognise_copies(inputs, batch_dim)
            ticket = None if refusal else ticket_of_tensors(inputs, batch_dim=batch_dim)
        if ticket is not None and ticket.tracked:
            ticket = self._own(ticket, batch_size)
        if ticket is None:
            ticket = self._join_or_untracked(inputs, batch_dim, batch_size, join_pending, refusal)
            holds_the_batch = False
        if ticket.tracked:
            if ticket.num_rows != batch_size:
                raise RuntimeError(
                    f"a forward ran on {batch_size} examples but its input holds {ticket.num_rows} rows of the batch "
                    f"of loader step {ticket.loader_step}: the model must see exactly the drawn examples, one row "
                    f"each (do not add, drop or repeat rows; with batch_first=False the batch is dimension 1)"
                )
            for queue in self._queues:
                queue.take(ticket)
            self._forwarded_draw = ticket.whole()
            if holds_the_batch:
                self._pending_inputs = tuple([(t, batch_dim) for t in inputs if t.dim() > batch_dim])
        self.current = ticket
        self._last_input = None if first_input is None else (weakref.ref(first_input), first_input._version)
        return ticket

    def _own(self, ticket: BatchTicket, batch_size: int) -> BatchTicket:
        """``ticket`` if its loader is this optimizer's; else an untracked ticket saying why."""
        if not self._queues and self._adopted_origin is None:
            self._adopted_origin = ticket.origin  # hand-built: the first loader it trains on is its own
        if ticket.origin is self.origin:
            return ticket
        return BatchTicket(loader_step=None, size=batch_size, refusal=_foreign(ticket, self.origin))

    def _recognise_copies(self, inputs: list[torch.Tensor], batch_dim: int) -> str:
        """Tag the untagged inputs whose values equal a run of rows of one recent batch of this
        optimizer's loader (row i of the input along ``batch_dim`` equal to row a + i of the batch), with
        that run's ticket. Returns why they cannot be tied to one batch ("" when they were tagged or
        matched no batch)."""
        recent = [(ticket, tensors) for queue in self._queues for ticket, tensors in queue.recent()]
        if not recent:
            return ""
        matches: list[tuple[torch.Tensor, dict[int, list[BatchTicket]]]] = []
        seen: set[int] = set()
        for target in inputs:
            if id(target) in seen or target.dim() <= batch_dim or find_ticket(target, batch_dim=batch_dim):
                continue
            seen.add(id(target))
            count = target.shape[batch_dim]
            found: dict[int, list[BatchTicket]] = {}
            for ticket, tensors in recent:
                for batch_tensor in tensors:
                    for start in row_runs(target, batch_dim, batch_tensor):
                        whole = (start, count) == (0, ticket.num_rows)
                        run = ticket if whole else ticket.slice(start, start + count)
                        found.setdefault(id(ticket.draw), []).append(run)
            if found:
                matches.append((target, found))
        if not matches:
            return ""
        common = set.intersection(*(set(found) for _, found in matches))
        if not common:
            return _TWO_BATCHES
        draws = [ticket for ticket, _ in recent if id(ticket.draw) in common]
        chosen = draws[0]
        if len(draws) > 1:
            queued = [t for t in draws if any(t in queue for queue in self._queues)]
            chosen = queued[0] if queued else draws[-1]
            empty = all(run.num_rows == 0 for _, found in matches for runs in found.values() for run in runs)
            if not empty or any(chosen.differs_in_effect(other) for other in draws):
                raise RuntimeError(
                    f"cannot tell which batch of the private loader this forward runs on: its inputs are untagged "
                    f"copies whose values equal {len(draws)} different batches the loader yielded (loader steps "
                    f"{[t.loader_step for t in draws]}). Move batches with privacy_engine.move_to(batch, device), "
                    f"which keeps the tag, or give the model the batch as the loader yielded it."
                )
        for target, found in matches:
            runs = found[id(chosen.draw)]
            if any(runs[0].differs_in_effect(other) for other in runs[1:]):
                raise RuntimeError(
                    f"cannot tell which rows of the batch of loader step {chosen.loader_step} this forward runs on: "
                    f"its untagged input equals several runs of that batch's rows with different padding. Move "
                    f"batches with privacy_engine.move_to(batch, device), which keeps the tag."
                )
            tag_tensor(target, runs[0])
        return ""

    def _join_or_untracked(self, inputs: list[torch.Tensor], batch_dim: int, batch_size: int, join_pending: bool,
                           refusal: str) -> BatchTicket:  # fmt: skip
        """The pending drawn batch, for a batch joined row for row to its examples (a GAN's generated
        batch), or an untracked ticket saying why it is neither (``refusal``, when already known)."""
        current = self.current
        conflict = bool(refusal)
        refusal = refusal or _UNTAGGED
        if join_pending and not conflict and current is not None and current.tracked and current.num_rows == batch_size:
            if self._holds_drawn_rows(inputs, batch_dim):
                raise RuntimeError(_DRAWN_ROWS + ". Nothing was released or counted.")
            return current
        return BatchTicket(loader_step=None, size=batch_size, refusal=refusal if self._queues else "")

    def _holds_drawn_rows(self, inputs: list[torch.Tensor], batch_dim: int) -> bool:
        """Whether a row ``i`` of ``inputs`` equals a row of the pending drawn batch's inputs or of a
        recent batch of this optimizer's loader (value for value), other than example ``i``'s own row
        (an input that leaves some examples unchanged, e.g. a random augmentation, is theirs)."""
        current = self.current
        references = [(t, dim, 0) for t, dim in self._pending_inputs]
        for queue in self._queues:
            for ticket, tensors in queue.recent():
                aligned_at = current.rows[0] if ticket.draw is current.draw else None
                references += [(t, 0, aligned_at) for t in tensors]
        for tensor in inputs:
            if tensor.dim() <= batch_dim:
                continue
            for reference, dim, aligned_at in references:
                if shares_a_row(tensor, batch_dim, reference, dim, aligned_at=aligned_at):
                    return True
        return False

    def abandon(self, ticket: BatchTicket) -> None:
        """A forward's batch whose backward never ran: it may still be used by a later forward."""
        for queue in self._queues:
            queue.put_back(ticket)

    def check_parameters_unchanged(self, params: list[torch.nn.Parameter], *, where: str) -> None:
        """Raise if the parameters changed in place since the open step's first forward (another
        optimizer stepped them); the first call of a step takes the snapshot."""
        versions = tuple(map(_VERSION, params))  # (C-level: at every forward and step, over every parameter)
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
        return any(module.has_unflushed_passes for module in self.modules)

    # ---------------------------------------------------------------------------------------- backward
    def contributed(self, ticket: BatchTicket) -> None:
        """A backward pass over ``ticket``'s rows reached the clipper."""
        self._contributions.append(ticket)
        self._new_batch = True

    def already_contributed(self, ticket: BatchTicket) -> bool:
        """Whether a backward pass over exactly ``ticket``'s rows (same draw, same rows) already contributed to
        the open step (fast clipping refuses a second pass over the same rows: it would clip each example
        twice)."""
        contributions = self._contributions  # (empty at the usual forward: no generator then)
        return bool(contributions) and any(t.same_rows(ticket) for t in contributions)

    # ---------------------------------------------------------------------------------------- step
    def close(self) -> Release:
        """What the step about to be released contains (the contributions since the last step)."""
        draws: dict[int, BatchTicket] = {}
        untracked = False
        refusals: list[str] = []
        for ticket in self._contributions:
            if not ticket.tracked:
                untracked = True
                if ticket.refusal and ticket.refusal not in refusals:
                    refusals.append(ticket.refusal)
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
        return Release(draws=ordered, untracked=untracked, refusals=tuple(refusals))

    @property
    def has_new_batch(self) -> bool:
        """Whether a step may release now: since the last release a training forward ran or a
        backward pass contributed, or the oldest batch the loader yielded and no forward used is empty
        (a loop that skips an empty batch's forward and backward but steps)."""
        return self._new_batch or self._unused_empty_draw() is not None

    def _unused_empty_draw(self) -> BatchTicket | None:
        for queue in self._queues:
            for queued in queue:
                return queued if queued.size == 0 else None
        return None

    def forwarded_examples_without_backward(self) -> int:
        """How many examples (padding rows left out) of the newest drawn batch a training forward ran on since the
        last release, when that batch is not released yet; 0 when there is none or it holds no example. A step with
        no contribution that would release noise alone in place of such a batch's clipped sum is refused
        (``ReleaseChecks._check_release``): its backward never ran, so the release would not be the batch's sum."""
        ticket = self._forwarded_draw
        if ticket is None or any(ticket.draw is done for done in self._released_draws):
            return 0
        if ticket.padding_mask is None:
            return ticket.size
        return ticket.size - int(ticket.padding_mask.sum())

    def take_unused_draw(self) -> BatchTicket | None:
        """For a step with no contribution, the batch it releases (as noise alone): the drawn batch a
        forward ran on since the last release (its backward skipped, e.g. an empty batch), else the
        oldest yielded batch if it is empty and no forward used it."""
        ticket = self._forwarded_draw
        if ticket is None or any(ticket.draw is done for done in self._released_draws):
            ticket = self._unused_empty_draw()
            for queue in self._queues if ticket is not None else ():
                queue.take(ticket)
        self._noise_only_draw = ticket
        return ticket

    def released_draws_after(self, release: Release) -> collections.deque:
        """The window of released draws once ``release`` is released, built without changing anything: the
        optimizer builds it before the accountant records the step, so that nothing can raise after the record."""
        window = self._released_draws.copy()  # same maxlen
        window.extend(ticket.draw for ticket in release.draws)
        if self._noise_only_draw is not None:
            window.append(self._noise_only_draw.draw)
        return window

    def released(
        self, release: Release, loader_step: int | None, released_draws: collections.deque | None = None
    ) -> None:
        """Forget the open step's contributions after a release. Given ``released_draws`` (from
        ``released_draws_after``), only plain assignments remain: it cannot raise after a recorded step."""
        if released_draws is None:
            released_draws = self.released_draws_after(release)
        self._contributions = []
        self._version_snapshot = None
        self._released_draws = released_draws
        self._noise_only_draw = None
        self._forwarded_draw = None
        self._pending_inputs = ()
        self._new_batch = False
        if loader_step is not None:
            self.last_released_step = loader_step

    def discard(self) -> None:
        """Drop the open step's contributions without releasing them: nothing of them is released or counted,
        and their draws are not marked released."""
        self._contributions = []
        self._version_snapshot = None
