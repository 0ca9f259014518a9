"""The accountant interface: a ledger of training steps turned into epsilon by dp-accounting.

An accountant only records what was released (`HistoryEntry`s, `accountants.history`) and hands the matching
`DpEvent` to a dp-accounting accountant (RDP or PLD) when asked for epsilon. All privacy maths is
dp-accounting's. Each entry's event is the one its noise mechanism stated (an event kind and its
parameters, `accountants.events.EventSpec`) built by that kind's registered builder: nothing here
depends on which mechanism it is.

BandMF bookkeeping (the default kind's builder): an entry of n identical steps over b bands contributes
ceil(n / b) participations (see `accountants.events`). Consecutive identical steps are merged into
one entry, so recording steps one at a time or all at once gives the same epsilon. When the
mechanism changes mid-run (noise multiplier, sample rate or bands), each entry is composed with
its own ceil(n_i / b_i): this is conservative, as a window of n_i steps holds at most
ceil(n_i / b_i) steps of any one group. A change of `num_bands` is accounted as a fresh BandMF
run; the training code must restart its noise correlation there for that to be valid.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import dp_accounting

from accountants._validation import check_delta, check_int, check_real
from accountants.composition import (
    AtomSequence,
    Composition,
    CompositionCache,
    EventComposition,
    atom_sequence,
)
from accountants.events import DEFAULT_EVENT_KIND, entries_compose
from accountants.history import HistoryEntry
from accountants.registry import ACCOUNTANTS
from accountants.state import AccountantStateMixin
from accountants.what_if import WhatIfMixin

__all__ = ["Accountant"]


class Accountant(AccountantStateMixin, WhatIfMixin, abc.ABC):
    """Ledger of DP-SGD / BandMF steps; epsilon from a dp-accounting accountant.

    Subclasses say which dp-accounting accountant to use (`_new_dp_accountant`) and which
    settings it takes (`settings`). Compositions are cached (`accountants.composition`): several
    `get_epsilon` calls cost one composition, a new step extends the cached one instead of
    starting again (whichever entry it was merged into), and `epsilon_if` / `would_exceed` /
    `steps_left` answer "what if" questions from the same cache without changing the ledger.

    This file holds recording, reading and composing; the "what if" questions are in
    `accountants/what_if.py` (`WhatIfMixin`), saving and restoring in `accountants/state.py`
    (`AccountantStateMixin`), the ledger's entries in `accountants/history.py`.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._history: list[HistoryEntry] = []
        # The composition of the current history (None: look it up in the cache again).
        self._composed: Composition | None = None
        self._cache = self._new_cache()

    # ----------------------------------------------------------------- subclass hooks
    @abc.abstractmethod
    def _new_dp_accountant(self) -> dp_accounting.PrivacyAccountant:
        """A fresh dp-accounting accountant with this accountant's settings."""

    @abc.abstractmethod
    def settings(self) -> dict[str, Any]:
        """Constructor keyword arguments (JSON types) that rebuild an equivalent empty accountant."""

    def _new_cache(self) -> CompositionCache:
        """The cache this accountant's compositions live in (subclasses keep more in theirs)."""
        return CompositionCache()

    def _build_composition(self, sequence: AtomSequence) -> Composition:
        """Compose `sequence`, reusing what `self._cache` holds. Default: dp-accounting from scratch."""
        return EventComposition(self._new_dp_accountant(), sequence)

    def _exact_composition(self, sequence: AtomSequence) -> Composition:
        """Compose `sequence` the way dp-accounting does (drift 0). Default: `_build_composition`."""
        return self._build_composition(sequence)

    # ----------------------------------------------------------------- recording
    def step(
        self,
        *,
        noise_multiplier: float,
        sample_rate: float,
        num_steps: int = 1,
        num_bands: int = 1,
        max_batch_size: int | None = None,
        group_size: int | None = None,
        source: str = "",
        batches_per_step: int = 1,
        mechanism: str = DEFAULT_EVENT_KIND,
        mechanism_parameters: Mapping[str, Any] | None = None,
    ) -> None:
        """Record `num_steps` identical training steps.

        Guarantee: after the call, `get_epsilon` bounds the privacy loss of everything recorded,
        with this step read as: Poisson sampling with probability `sample_rate` (from group
        t mod num_bands for BandMF; capped at `max_batch_size` out of `group_size` examples when
        truncated), a sum of L2-clipped contributions, Gaussian noise of std
        noise_multiplier * clip norm (already scaled by the BandMF strategy's sensitivity).
        Invalid input raises before anything is recorded.

        ===========================  ================================================
        case                         result
        ===========================  ================================================
        num_steps = 0                arguments validated, nothing recorded
        same as the last entry       merged into it (count added)
        noise_multiplier = 0, q > 0  recorded; get_epsilon returns inf
        sample_rate = 0              recorded; contributes epsilon 0
        num_bands = b > 1            entry composes ceil(count / b) participations
        max_batch_size/group_size    truncated sampling: PLD only; RDP raises
                                     NotImplementedError naming PLDAccountant
        only one of the two given    ValueError naming the missing one
        source                       steps of another source never merge: each private
                                     optimizer composes as its own mechanism; a step is
                                     merged into its source's latest entry if identical
        batches_per_step = k > 1     k independent Poisson batches in one release: each
                                     example's sensitivity is Binomial(k, q) times the
                                     clip norm (mixture of Gaussians; PLD only)
        mechanism (+ parameters)     the event kind a noise mechanism stated
                                     (`NoiseMechanism.privacy_event().step_kwargs()`):
                                     the entry's event is that kind's registered
                                     builder's; default "gaussian" (DP-SGD / BandMF)
        unregistered mechanism       ValueError naming the registered kinds
        out-of-range argument        ValueError / TypeError naming it
        ===========================  ================================================
        """
        history = self._history
        # (_latest_position's first look, inline: the usual step's source is the last entry's)
        position = len(history) - 1 if history and history[-1].source == source else self._latest_position(source)
        if (
            position is not None
            and type(num_steps) is int
            and num_steps >= 1
            and mechanism_parameters is None
            and self._history[position].repeats(
                noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_bands=num_bands,
                group_size=group_size, max_batch_size=max_batch_size, batches_per_step=batches_per_step,
                mechanism=mechanism,
            )
        ):  # fmt: skip
            # The training loop's usual step: the same step again, merged into the source's latest entry. Its
            # arguments are plain values equal to that entry's validated fields, so building and validating an
            # entry (the path below) would end in this very merge.
            self._history[position] = self._history[position].with_more_steps(num_steps)
            self._composed = None
            return
        num_steps = check_int("num_steps", num_steps, low=0)
        # Validate the mechanism even when num_steps == 0 so that bad input never passes
        # silently; the entry needs a positive count, hence max(.., 1).
        entry = HistoryEntry(
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            num_steps=max(num_steps, 1),
            num_bands=num_bands,
            group_size=group_size,
            max_batch_size=max_batch_size,
            source=source,
            batches_per_step=batches_per_step,
            mechanism=mechanism,
            mechanism_parameters=() if mechanism_parameters is None else mechanism_parameters,
        )
        # The latest entry of the same source (other optimizers' steps may have come in between).
        position = self._latest_position(entry.source)
        last = None if position is None else self._history[position]
        if last is None or not last.same_mechanism(entry):
            self._check_supported(entry)
            if not entries_compose(entry.mechanism) and any(
                e.source == entry.source and e.mechanism == entry.mechanism for e in self._history
            ):
                raise ValueError(
                    f"a second ledger entry of event kind {entry.mechanism!r} for source {entry.source!r}: this kind "
                    "accounts a whole run from its start as one mechanism, so its steps must stay one entry (same "
                    "noise_multiplier, sample_rate and parameters, no other steps of this source in between); "
                    "separate entries would be composed as independent mechanisms, which the correlated noise is not"
                )
        if num_steps == 0:
            return
        if last is not None and last.same_mechanism(entry):
            self._history[position] = last.with_more_steps(num_steps)
        else:
            self._history.append(dataclasses.replace(entry, num_steps=num_steps))
        self._composed = None

    def _latest_position(self, source: object) -> int | None:
        """The index of the latest ledger entry of ``source`` (other optimizers' steps may come after it), or None."""
        history = self._history
        for position in range(len(history) - 1, -1, -1):
            if history[position].source == source:
                return position
        return None

    def _check_supported(self, entry: HistoryEntry) -> None:
        """Raise NotImplementedError, naming an accountant that can, if dp-accounting cannot."""
        event = entry.event()
        if self._new_dp_accountant().supports(event):
            return
        others = [
            f"{cls.__name__} (make_accountant({name!r}))"
            for name, cls in ACCOUNTANTS.items()
            if name != self.name and cls()._new_dp_accountant().supports(event)
        ]
        alternative = (
            f"use {' or '.join(others)} instead"
            if others
            else "no accountant here supports it"
        )
        what = (
            "truncated Poisson sampling (max_batch_size, group_size)"
            if entry.truncated
            else "this step"
        )
        inner = event
        while hasattr(inner, "event"):
            inner = inner.event
        raise NotImplementedError(
            f"{type(self).__name__} cannot account for {what}: dp-accounting's "
            f"{type(self._new_dp_accountant()).__name__} does not support "
            f"{type(inner).__name__}; {alternative}."
        )

    # ----------------------------------------------------------------- reading
    @property
    def steps(self) -> int:
        """Total number of recorded steps (not participations)."""
        return sum(entry.num_steps for entry in self._history)

    @property
    def history(self) -> tuple[HistoryEntry, ...]:
        """Recorded steps, consecutive identical steps merged into one entry with a count."""
        return tuple(self._history)

    def event(self) -> dp_accounting.DpEvent:
        """The dp-accounting event for everything recorded.

        NoOpDpEvent when nothing is recorded, the entry's own event when there is one entry,
        otherwise ComposedDpEvent of the entries' events in recording order.
        """
        events = [entry.event() for entry in self._history]
        if not events:
            return dp_accounting.NoOpDpEvent()
        if len(events) == 1:
            return events[0]
        return dp_accounting.ComposedDpEvent(events)

    # ----------------------------------------------------------------- composing (cached)
    def _sequence(self) -> AtomSequence:
        return atom_sequence(entry.event() for entry in self._history)

    def _composition_of(self, sequence: AtomSequence) -> Composition:
        found = self._cache.find(sequence)
        if found is None:
            found = self._cache.store(self._build_composition(sequence))
        return found

    def _composition(self) -> Composition:
        if self._composed is None:
            self._composed = self._composition_of(self._sequence())
        return self._composed

    def _copy(self) -> Accountant:
        """A copy with its own history list and the same settings and cache (not `copy.copy`:
        pickling and copying leave the cache out, see `__getstate__`)."""
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        copied._history = list(self._history)
        copied._composed = None
        return copied

    def _after(self, step_kwargs: dict[str, Any]) -> Accountant:
        """A copy of this accountant (sharing its cache) with `step(**step_kwargs)` recorded."""
        copied = self._copy()
        copied.step(**step_kwargs)
        return copied

    # ----------------------------------------------------------------- privacy so far
    def get_epsilon(self, delta: float) -> float:
        """Smallest epsilon such that everything recorded is (epsilon, delta)-DP.

        Guarantee: the value is dp-accounting's epsilon for `self.event()` with this accountant's
        settings (an upper bound for RDP; the pessimistic PLD estimate for PLD), add/remove-one
        adjacency. PLD compositions are cached and extended step by step; the value then differs
        from dp-accounting's recomposition of the same event by float rounding and a few extra
        1e-15 tail truncations (tested within 1e-9).

        ========================================  =====================
        case                                      result
        ========================================  =====================
        nothing recorded                          0.0
        only sample_rate = 0 steps                0.0
        a step with noise_multiplier 0 and q > 0  inf
        delta outside (0, 1)                      ValueError naming delta
        ========================================  =====================
        """
        delta = check_delta(delta)
        if not self._history:
            return 0.0
        if any(entry.releases_without_noise for entry in self._history):
            return math.inf
        return self._composition().get_epsilon(delta)

    def get_delta(self, epsilon: float) -> float:
        """Smallest delta such that everything recorded is (epsilon, delta)-DP (dp-accounting's).

        Nothing recorded -> 0.0; a noiseless step with q > 0 -> 1.0; epsilon < 0 -> ValueError.
        """
        epsilon = check_real("epsilon", epsilon, low=0.0)
        if not self._history:
            return 0.0
        if any(entry.releases_without_noise for entry in self._history):
            return 1.0
        return self._composition().get_delta(epsilon)

    def __repr__(self) -> str:
        settings = ", ".join(
            f"{key}={value!r}" for key, value in self.settings().items()
        )
        return f"{type(self).__name__}({settings}) with {self.steps} steps in {len(self._history)} entries"
