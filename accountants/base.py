"""The accountant interface: a ledger of training steps turned into epsilon by dp-accounting.

An accountant only records what was released (`HistoryEntry`s) and hands the matching
`DpEvent` to a dp-accounting accountant (RDP or PLD) when asked for epsilon. All privacy maths is
dp-accounting's.

BandMF bookkeeping: an entry of n identical steps over b bands contributes
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
from typing import Any, ClassVar

import dp_accounting

from accountants._validation import (
    check_delta,
    check_int,
    check_noise_multiplier,
    check_num_bands,
    check_real,
    check_sample_rate,
    check_truncation,
)
from accountants.composition import (
    AtomCount,
    AtomSequence,
    Composition,
    CompositionCache,
    EventComposition,
    atom_sequence,
    merged_counts,
)
from accountants.events import (
    accumulated_dpsgd_event,
    bandmf_event,
    max_participations,
    truncated_bandmf_event,
)

__all__ = ["STATE_DICT_FORMAT", "Accountant", "HistoryEntry"]

STATE_DICT_FORMAT = "privacy_engine.accountants/1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistoryEntry:
    """`num_steps` consecutive identical training steps.

    Fields are validated on construction: noise_multiplier >= 0, sample_rate in [0, 1],
    num_steps >= 1, num_bands >= 1, and group_size / max_batch_size both None (untruncated
    Poisson sampling) or both integers >= 1.
    """

    noise_multiplier: float
    sample_rate: float
    num_steps: int
    num_bands: int = 1
    group_size: int | None = None
    max_batch_size: int | None = None
    #: Which private optimizer recorded the steps: entries of different sources are separate
    #: mechanisms (never merged; BandMF participations are counted per source).
    source: str = ""
    #: Poisson batches (independent draws) accumulated into each noisy release (naive gradient
    #: accumulation); 1 for the usual one batch per step.
    batches_per_step: int = 1

    def __post_init__(self) -> None:
        # Normalise to python types so equality, merging and JSON do not depend on the caller's
        # numeric type (numpy / torch scalars).
        object.__setattr__(
            self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier)
        )
        object.__setattr__(self, "sample_rate", check_sample_rate(self.sample_rate))
        object.__setattr__(
            self, "num_steps", check_int("num_steps", self.num_steps, low=1)
        )
        object.__setattr__(self, "num_bands", check_num_bands(self.num_bands))
        group_size, max_batch_size = check_truncation(
            self.group_size, self.max_batch_size
        )
        object.__setattr__(self, "group_size", group_size)
        object.__setattr__(self, "max_batch_size", max_batch_size)
        if not isinstance(self.source, str):
            raise TypeError(f"source must be a str; got {self.source!r}")
        object.__setattr__(
            self, "batches_per_step", check_int("batches_per_step", self.batches_per_step, low=1)
        )
        if self.batches_per_step > 1 and (self.num_bands > 1 or self.truncated):
            raise ValueError(
                "batches_per_step > 1 (several Poisson batches in one release) is accounted for plain "
                "DP-SGD only; BandMF and truncated sampling need exactly one batch per step"
            )

    @property
    def count(self) -> int:
        """Alias of `num_steps`: how many identical steps this entry merges."""
        return self.num_steps

    @property
    def truncated(self) -> bool:
        return self.max_batch_size is not None

    @property
    def participations(self) -> int:
        """Most of this entry's steps any one example takes part in: ceil(num_steps / num_bands)."""
        return max_participations(self.num_steps, self.num_bands)

    @property
    def releases_without_noise(self) -> bool:
        """Data are sampled (q > 0) and released with no noise: no privacy at all."""
        return self.noise_multiplier == 0.0 and self.sample_rate > 0.0

    def same_mechanism(self, other: HistoryEntry) -> bool:
        """Equal in everything but the step count, so the two may be merged."""
        return dataclasses.replace(other, num_steps=self.num_steps) == self

    def event(self) -> dp_accounting.DpEvent:
        """The dp-accounting event for this entry (see `accountants.events`)."""
        if self.batches_per_step > 1:
            return accumulated_dpsgd_event(
                self.noise_multiplier, self.sample_rate, self.num_steps, self.batches_per_step
            )
        if self.truncated:
            return truncated_bandmf_event(
                self.noise_multiplier,
                self.sample_rate,
                self.num_steps,
                self.num_bands,
                self.group_size,
                self.max_batch_size,
            )
        return bandmf_event(
            self.noise_multiplier, self.sample_rate, self.num_steps, self.num_bands
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> HistoryEntry:
        if not isinstance(data, dict):
            raise TypeError(
                f"a history entry must be a dict; got {type(data).__name__}."
            )
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(
                f"history entry has unknown keys {unknown}; allowed: {sorted(fields)}."
            )
        return cls(**data)


class Accountant(abc.ABC):
    """Ledger of DP-SGD / BandMF steps; epsilon from a dp-accounting accountant.

    Subclasses say which dp-accounting accountant to use (`_new_dp_accountant`) and which
    settings it takes (`settings`). Compositions are cached (`accountants.composition`): several
    `get_epsilon` calls cost one composition, a new step extends the cached one instead of
    starting again (whichever entry it was merged into), and `epsilon_if` / `would_exceed` /
    `steps_left` answer "what if" questions from the same cache without changing the ledger.
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

    def _decision_margin(self, composition: Composition, delta: float) -> float:
        """How far `composition.get_delta(e)` may be from the drift-free value (see `_exceeds`)."""
        return 0.0

    def _largest_count_within(
        self, start: Composition, atom: AtomCount, max_epsilon: float, delta: float, limit: int
    ) -> int:
        """About the largest m <= limit such that `start` plus m more occurrences of `atom` stays
        within (max_epsilon, delta) (`steps_left` checks the boundary exactly afterwards).
        Default: doubling, then bisection, each probe a composition from the cache."""

        def fits(extra: int) -> bool:
            sequence = (*start.sequence, AtomCount(atom.key, atom.event, extra))
            return self._composition_of(sequence).get_epsilon(delta) <= max_epsilon

        if limit <= 0 or not fits(1):
            return 0
        low, high = 1, 2
        while high <= limit and fits(high):
            low, high = high, high * 2
        if high > limit:
            if fits(limit):
                return limit
            high = limit
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

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
        out-of-range argument        ValueError / TypeError naming it
        ===========================  ================================================
        """
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
        )
        # The latest entry of the same source (other optimizers' steps may have come in between).
        position = next(
            (i for i in range(len(self._history) - 1, -1, -1) if self._history[i].source == entry.source),
            None,
        )
        last = None if position is None else self._history[position]
        if last is None or not last.same_mechanism(entry):
            self._check_supported(entry)
        if num_steps == 0:
            return
        if last is not None and last.same_mechanism(entry):
            self._history[position] = dataclasses.replace(
                last, num_steps=last.num_steps + num_steps
            )
        else:
            self._history.append(dataclasses.replace(entry, num_steps=num_steps))
        self._composed = None

    def _check_supported(self, entry: HistoryEntry) -> None:
        """Raise NotImplementedError, naming an accountant that can, if dp-accounting cannot."""
        event = entry.event()
        if self._new_dp_accountant().supports(event):
            return
        from accountants.registry import ACCOUNTANTS  # the registry imports this module

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

    def _exceeds(self, sequence: AtomSequence, max_epsilon: float, delta: float) -> bool:
        """Whether `sequence` composed has epsilon > max_epsilon at delta, as dp-accounting's own
        composition of it decides.

        A cached composition may have gone through a few more lossy steps than dp-accounting's
        (`Composition.drift`), which moves its delta(epsilon) by at most `_decision_margin`; when
        its delta at max_epsilon is within that margin of `delta`, the drift-free composition is
        built and decides. So the guard, `steps_left` and dp-accounting agree at the boundary.
        """
        if not sequence:
            return False
        composition = self._composition_of(sequence)
        epsilon = composition.get_epsilon(delta)
        if composition.drift == 0 or not math.isfinite(epsilon):
            return epsilon > max_epsilon
        # epsilon is non-increasing in delta: epsilon > max_epsilon exactly when delta(max) > delta.
        delta_at_max = composition.get_delta(max_epsilon)
        if abs(delta_at_max - delta) > self._decision_margin(composition, delta):
            return delta_at_max > delta
        exact = self._cache.store(self._exact_composition(sequence))
        return exact.get_epsilon(delta) > max_epsilon

    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles carry the ledger, not the cache: it is rebuilt on demand, and its
        # distributions (megabytes on the default PLD grid) have no place in a copy or a file.
        state = dict(self.__dict__)
        state["_history"] = list(self._history)
        state["_composed"] = None
        state["_cache"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache = self._new_cache()

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

    # ----------------------------------------------------------------- what if
    def epsilon_if(self, delta: float, **step_kwargs: Any) -> float:
        """Epsilon at `delta` if `step(**step_kwargs)` were recorded now; the ledger does not change.

        Guarantee: equal to what `get_epsilon(delta)` returns right after `step(**step_kwargs)`
        (the composition is kept, so that call then costs nothing). Used by the privacy budget
        guard before each release.

        ===========================  ================================================
        case                         result
        ===========================  ================================================
        num_steps = 0                the current epsilon
        invalid step arguments       the error `step` raises; nothing recorded
        delta outside (0, 1)         ValueError naming delta
        ===========================  ================================================
        """
        delta = check_delta(delta)
        return self._after(step_kwargs).get_epsilon(delta)

    def history_if(self, **step_kwargs: Any) -> tuple[HistoryEntry, ...]:
        """The history `step(**step_kwargs)` would leave (errors as `step`); the ledger does not change."""
        return self._after(step_kwargs).history

    def would_exceed(self, max_epsilon: float, delta: float, **step_kwargs: Any) -> bool:
        """Whether recording `step(**step_kwargs)` now would make `get_epsilon(delta) > max_epsilon`.

        Guarantee: the decision of the drift-free composition (dp-accounting's way of composing
        the same event) even when the cached value is within float noise of `max_epsilon`; the
        ledger does not change. Agrees with `steps_left`: it is True exactly when
        `steps_left(max_epsilon, delta, **step_kwargs) == 0` for a one-step call.

        ============================  ======================================
        case                          result
        ============================  ======================================
        step releases without noise   True (epsilon inf)
        step with sample_rate 0       as without the step
        max_epsilon < 0, NaN, inf     ValueError naming max_epsilon
        invalid step arguments        the error `step` raises
        ============================  ======================================
        """
        max_epsilon = check_real("max_epsilon", max_epsilon, low=0.0)
        delta = check_delta(delta)
        after = self._after(step_kwargs)
        return after._exceeds(after._sequence(), max_epsilon, delta)

    def steps_left(self, max_epsilon: float, delta: float, *, limit: int = 2**20, **step_kwargs: Any) -> int:
        """How many more `step(**step_kwargs)` calls (one step each) keep `get_epsilon(delta) <= max_epsilon`.

        Guarantee: recording the returned number k of such steps keeps epsilon within max_epsilon,
        and one more would exceed it (unless k == limit), decided as `would_exceed` decides (so a
        guard consulting `would_exceed` before each step allows exactly k). The ledger does not
        change. The search doubles the number of participations and then bisects (PLD: binary
        lifting over powers of the step's distribution), then checks the boundary exactly.

        ==============================  ===========================================
        case                            result
        ==============================  ===========================================
        already over max_epsilon        0
        steps that add no privacy loss  limit (sample_rate 0)
        noiseless steps (q > 0)         0
        more than limit steps fit       limit
        num_steps given                 TypeError: each call counts one step
        limit < 0 / max_epsilon < 0     ValueError naming it
        invalid step arguments          the error `step` raises
        ==============================  ===========================================
        """
        max_epsilon = check_real("max_epsilon", max_epsilon, low=0.0)
        delta = check_delta(delta)
        limit = check_int("limit", limit, low=0)
        if "num_steps" in step_kwargs:
            raise TypeError("steps_left counts single steps: leave out num_steps.")
        self._after({**step_kwargs, "num_steps": 0})  # validates the step, records nothing
        sequence = self._sequence()
        if limit == 0 or self._exceeds(sequence, max_epsilon, delta):
            return 0
        before = merged_counts(sequence)

        def grown(steps: int) -> AtomSequence:
            return self._after({**step_kwargs, "num_steps": steps})._sequence() if steps else sequence

        def fits(steps: int) -> bool:
            return not self._exceeds(grown(steps), max_epsilon, delta)

        def last_fitting(fits: Any, high: int) -> int:
            # Largest k in [0, high] with fits(k), for fits monotone and fits(0) true.
            if fits(high):
                return high
            low = 0
            while high - low > 1:
                middle = (low + high) // 2
                if fits(middle):
                    low = middle
                else:
                    high = middle
            return low

        def changed(steps: int) -> dict[str, int]:
            after = merged_counts(grown(steps))
            return {key: count for key, count in after.items() if count != before.get(key, 0)}

        # The atom these steps add to (BandMF: the first steps may add no participation).
        probe = 1
        while not changed(probe):
            if probe >= limit:
                return limit
            probe = min(2 * probe, limit)
        keys = list(changed(probe))
        if len(keys) != 1:
            return last_fitting(fits, limit)
        atom = next(atom for atom in grown(probe) if atom.key == keys[0])

        def added(steps: int) -> int:
            return merged_counts(grown(steps)).get(atom.key, 0) - before.get(atom.key, 0)

        most = added(limit)
        fitting = self._largest_count_within(self._composition_of(sequence), atom, max_epsilon, delta, most)
        estimate = limit if fitting >= most else last_fitting(lambda steps: added(steps) <= fitting, limit)
        # The search above decides on cached values; settle the boundary as would_exceed does.
        while estimate > 0 and not fits(estimate):
            estimate -= 1
        while estimate < limit and fits(estimate + 1):
            estimate += 1
        return estimate

    # ----------------------------------------------------------------- copies and checkpoints
    def fresh(self) -> Accountant:
        """An empty accountant of the same kind and settings."""
        return type(self)(**self.settings())

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable state: kind, settings and history."""
        return {
            "format": STATE_DICT_FORMAT,
            "accountant": self.name,
            "settings": self.settings(),
            "history": [entry.to_dict() for entry in self._history],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace settings and history with those in `state_dict` (from `state_dict()`).

        Everything is validated first; on any error the accountant is left unchanged. Loading
        the state of another kind of accountant (an RDP state into a PLD accountant) raises
        ValueError: build the matching one with make_accountant(state_dict["accountant"]).
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"state_dict must be a dict; got {type(state_dict).__name__}."
            )
        missing = {"format", "accountant", "settings", "history"} - set(state_dict)
        if missing:
            raise ValueError(f"state_dict is missing keys {sorted(missing)}.")
        if state_dict["format"] != STATE_DICT_FORMAT:
            raise ValueError(
                f"state_dict['format'] is {state_dict['format']!r}; this version reads "
                f"{STATE_DICT_FORMAT!r}."
            )
        if state_dict["accountant"] != self.name:
            raise ValueError(
                f"state_dict['accountant'] is {state_dict['accountant']!r} but this is a "
                f"{self.name!r} accountant; use make_accountant({state_dict['accountant']!r}) "
                "and load into that."
            )
        settings = state_dict["settings"]
        if not isinstance(settings, dict):
            raise TypeError("state_dict['settings'] must be a dict.")
        # Validates the settings before anything changes.
        loaded = type(self)(**settings)
        if not isinstance(state_dict["history"], list | tuple):
            raise TypeError("state_dict['history'] must be a list of entries.")
        history = [HistoryEntry.from_dict(entry) for entry in state_dict["history"]]
        for entry in history:
            loaded._check_supported(entry)
        # Adopt the loaded settings wholesale: copying attribute by attribute would have to be
        # repeated in every subclass.
        self.__dict__.update(loaded.__dict__)
        self._history = history
        self._composed = None

    def __repr__(self) -> str:
        settings = ", ".join(
            f"{key}={value!r}" for key, value in self.settings().items()
        )
        return f"{type(self).__name__}({settings}) with {self.steps} steps in {len(self._history)} entries"
