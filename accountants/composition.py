"""Composed privacy loss of a history, kept between questions.

An accountant's history is a list of entries, each a dp-accounting event `SelfComposed(atom, n)`
(`atom`: one participation of one mechanism). dp-accounting composes such a history entry by entry:
start from the identity, compose each entry's atom distribution self-composed n times, in order.
The `AtomSequence` of a history lists those (atom, n) in that order; it identifies a composition.

Recording a step either appends an entry or adds one to an existing entry's count (not always the
last one: each private optimizer, or `source`, has its own entries). Composition is commutative,
so a composition cached for the history before the step can be extended by the new occurrence
instead of being rebuilt, whichever entry grew. `Composition` is the composed result for one
sequence, immutable, with its epsilon per delta remembered; `CompositionCache` keeps the few most
recent ones. The accountants decide how to build and extend them (`accountants.pld`: cached PLDs;
`accountants.rdp`: cached RDP vectors).
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import dp_accounting

__all__ = [
    "AtomCount",
    "AtomSequence",
    "Composition",
    "CompositionCache",
    "EventComposition",
    "additions",
    "atom_sequence",
    "merged_counts",
    "sequence_event",
    "sequence_key",
]


@dataclass(frozen=True)
class AtomCount:
    """`count` occurrences of the atomic event `event`; `key` identifies the event (its repr)."""

    key: str
    event: dp_accounting.DpEvent
    count: int


#: (atom, count) per entry, in composition order: what dp-accounting composes, one by one.
AtomSequence = tuple[AtomCount, ...]


def _flatten(event: dp_accounting.DpEvent, multiplier: int) -> Iterator[tuple[dp_accounting.DpEvent, int]]:
    # dp-accounting's own traversal: SelfComposed multiplies the count, Composed composes its
    # events in order with the same count, NoOp composes nothing.
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        yield from _flatten(event.event, multiplier * event.count)
    elif isinstance(event, dp_accounting.ComposedDpEvent):
        for inner in event.events:
            yield from _flatten(inner, multiplier)
    else:
        yield event, multiplier


def atom_sequence(events: Iterable[dp_accounting.DpEvent]) -> AtomSequence:
    """The atomic events of `events` with their counts, in the order dp-accounting composes them.

    Atomic: any event other than NoOp, SelfComposed and Composed, which are unfolded. Two atoms
    are the same when their reprs are (dp-accounting events are attrs classes whose repr lists
    every field, floats exactly).
    """
    return tuple(AtomCount(repr(atom), atom, count) for event in events for atom, count in _flatten(event, 1))


def sequence_key(sequence: AtomSequence) -> tuple[tuple[str, int], ...]:
    """Hashable identity of a sequence."""
    return tuple((atom.key, atom.count) for atom in sequence)


def merged_counts(sequence: AtomSequence) -> dict[str, int]:
    """Total occurrences of each atom (what the composed privacy loss depends on)."""
    totals: dict[str, int] = {}
    for atom in sequence:
        totals[atom.key] = totals.get(atom.key, 0) + atom.count
    return totals


def sequence_event(sequence: AtomSequence) -> dp_accounting.DpEvent:
    """One dp-accounting event for `sequence`: Composed(SelfComposed(atom, count), ...) in order."""
    events = [dp_accounting.SelfComposedDpEvent(atom.event, atom.count) for atom in sequence]
    if not events:
        return dp_accounting.NoOpDpEvent()
    if len(events) == 1:
        return events[0]
    return dp_accounting.ComposedDpEvent(events)


class Composition(abc.ABC):
    """Everything in `sequence` composed. Immutable; epsilon and delta are remembered per argument.

    `drift` counts the PLD compositions this value went through that dp-accounting's own
    composition of the same sequence does not do (each trims tails of mass up to 1e-15): 0 means
    it was built the way dp-accounting builds it (the same operations in the same order). Missing
    mass moves delta(epsilon) by at most that much, which is how `Accountant._exceeds` decides
    when a cached value is close enough to a budget to need the drift-free one.
    """

    def __init__(self, sequence: AtomSequence, *, drift: int = 0) -> None:
        self.sequence = sequence
        self.key = sequence_key(sequence)
        self.drift = drift
        self._epsilons: dict[float, float] = {}
        self._deltas: dict[float, float] = {}

    def get_epsilon(self, delta: float) -> float:
        """Epsilon at `delta` of everything in `sequence` composed; computed once per `delta`, then remembered.
        `delta` is not validated here (`Accountant.get_epsilon` checks it first)."""
        if delta not in self._epsilons:
            self._epsilons[delta] = float(self._epsilon(delta))
        return self._epsilons[delta]

    def get_delta(self, epsilon: float) -> float:
        """Delta at `epsilon` of everything in `sequence` composed; computed once per `epsilon`, then remembered.
        `epsilon` is not validated here (`Accountant.get_delta` checks it first)."""
        if epsilon not in self._deltas:
            self._deltas[epsilon] = float(self._delta(epsilon))
        return self._deltas[epsilon]

    @abc.abstractmethod
    def _epsilon(self, delta: float) -> float: ...

    @abc.abstractmethod
    def _delta(self, epsilon: float) -> float: ...


class EventComposition(Composition):
    """A dp-accounting accountant that composed `sequence_event(sequence)` (the uncached fallback)."""

    def __init__(self, dp_accountant: dp_accounting.PrivacyAccountant, sequence: AtomSequence) -> None:
        super().__init__(sequence)
        self._accountant = dp_accountant.compose(sequence_event(sequence))

    def _epsilon(self, delta: float) -> float:
        return self._accountant.get_epsilon(delta)

    def _delta(self, epsilon: float) -> float:
        return self._accountant.get_delta(epsilon)


class CompositionCache:
    """The most recently used compositions (at most `capacity`), looked up by sequence.

    Shared by an accountant and the temporary copies `epsilon_if` and `steps_left` make, so a
    composition computed for a step that is then recorded is found again by `get_epsilon`.
    Subclasses add what their accountant reuses (per-atom distributions).
    """

    def __init__(self, capacity: int = 4) -> None:
        self._capacity = capacity
        self._compositions: OrderedDict[tuple, Composition] = OrderedDict()

    def find(self, sequence: AtomSequence) -> Composition | None:
        """The cached composition of `sequence` (looked up by `sequence_key`), marked most recently used;
        None if not cached."""
        key = sequence_key(sequence)
        found = self._compositions.get(key)
        if found is not None:
            self._compositions.move_to_end(key)
        return found

    def store(self, composition: Composition) -> Composition:
        """Cache `composition` (replacing one of the same sequence) as the most recently used, dropping the
        least recently used beyond `capacity`; returns `composition`."""
        self._compositions[composition.key] = composition
        self._compositions.move_to_end(composition.key)
        while len(self._compositions) > self._capacity:
            self._compositions.popitem(last=False)
        return composition

    def recent(self) -> list[Composition]:
        """Cached compositions, most recently used first."""
        return list(reversed(self._compositions.values()))


def additions(start: Composition, sequence: AtomSequence) -> dict[str, int] | None:
    """Per atom, how many more occurrences `sequence` has than `start`; None if `start` has more
    of any atom (then `sequence` is not `start` plus something)."""
    target = merged_counts(sequence)
    extra = dict(target)
    for key, count in merged_counts(start.sequence).items():
        have = target.get(key, 0)
        if count > have:
            return None
        extra[key] = have - count
    return {key: value for key, value in extra.items() if value > 0}
