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
    settings it takes (`settings`). The composed dp-accounting accountant is cached until the
    next `step` or `load_state_dict`, so several `get_epsilon` calls cost one composition.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._history: list[HistoryEntry] = []
        self._composed: dp_accounting.PrivacyAccountant | None = None

    # ----------------------------------------------------------------- subclass hooks
    @abc.abstractmethod
    def _new_dp_accountant(self) -> dp_accounting.PrivacyAccountant:
        """A fresh dp-accounting accountant with this accountant's settings."""

    @abc.abstractmethod
    def settings(self) -> dict[str, Any]:
        """Constructor keyword arguments (JSON types) that rebuild an equivalent empty accountant."""

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

    def _composed_accountant(self) -> dp_accounting.PrivacyAccountant:
        if self._composed is None:
            self._composed = self._new_dp_accountant().compose(self.event())
        return self._composed

    def get_epsilon(self, delta: float) -> float:
        """Smallest epsilon such that everything recorded is (epsilon, delta)-DP.

        Guarantee: the value is dp-accounting's epsilon for `self.event()` with this accountant's
        settings (an upper bound for RDP; the pessimistic PLD estimate for PLD), add/remove-one
        adjacency.

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
        return float(self._composed_accountant().get_epsilon(delta))

    def get_delta(self, epsilon: float) -> float:
        """Smallest delta such that everything recorded is (epsilon, delta)-DP (dp-accounting's).

        Nothing recorded -> 0.0; a noiseless step with q > 0 -> 1.0; epsilon < 0 -> ValueError.
        """
        epsilon = check_real("epsilon", epsilon, low=0.0)
        if not self._history:
            return 0.0
        if any(entry.releases_without_noise for entry in self._history):
            return 1.0
        return float(self._composed_accountant().get_delta(epsilon))

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
