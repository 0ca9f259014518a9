"""One entry of an accountant's ledger: `num_steps` consecutive identical training steps.

A `HistoryEntry` is validated on construction, knows the dp-accounting event it stands for and
round-trips through plain dicts (`to_dict` / `from_dict`), which is how accountants save their history
in checkpoints. Its event is what the mechanism stated (`accountants.events.EventSpec`: the kind's name,
`num_bands` and the kind's parameters, stored as plain fields) built by the kind's registered builder:
the entry knows no mechanism by name. Entries saved before kinds existed have no `mechanism` key and
read as the default kind, whose builder gives them exactly the event they had.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import dp_accounting

from accountants._validation import (
    check_int,
    check_noise_multiplier,
    check_sample_rate,
    check_truncation,
)
from accountants.events import DEFAULT_EVENT_KIND, EventSpec, Sampling, max_participations

__all__ = ["HistoryEntry"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistoryEntry:
    """`num_steps` consecutive identical training steps.

    Fields are validated on construction: noise_multiplier >= 0, sample_rate in [0, 1],
    num_steps >= 1, num_bands >= 1, group_size / max_batch_size both None (untruncated
    Poisson sampling) or both integers >= 1, a registered `mechanism` kind with plain
    parameters, and the entry's event is built once (the kind's builder refuses what it cannot
    account, e.g. several batches per step with BandMF).
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
    #: The event kind the mechanism stated (`accountants.events.register_event_kind`); entries saved
    #: without it are of the default kind (DP-SGD / BandMF).
    mechanism: str = DEFAULT_EVENT_KIND
    #: The kind's parameters: (name, plain value) pairs sorted by name (a dict is accepted).
    mechanism_parameters: Any = ()

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
        spec = EventSpec(kind=self.mechanism, num_bands=self.num_bands, parameters=self.mechanism_parameters)
        object.__setattr__(self, "num_bands", spec.num_bands)
        object.__setattr__(self, "mechanism_parameters", spec.parameters)
        _check_buildable(spec, self.sampling, self.noise_multiplier)

    @property
    def count(self) -> int:
        """Alias of `num_steps`: how many identical steps this entry merges."""
        return self.num_steps

    @property
    def truncated(self) -> bool:
        """Whether these steps used truncated Poisson sampling (`max_batch_size` set; `group_size` too)."""
        return self.max_batch_size is not None

    @property
    def participations(self) -> int:
        """Most of this entry's steps any one example takes part in: ceil(num_steps / num_bands)."""
        return max_participations(self.num_steps, self.num_bands)

    @property
    def releases_without_noise(self) -> bool:
        """Data are sampled (q > 0) and released with no noise: no privacy at all."""
        return self.noise_multiplier == 0.0 and self.sample_rate > 0.0

    def with_more_steps(self, num_steps: int) -> HistoryEntry:
        """This entry with ``num_steps`` (an ``int`` >= 0, checked by the caller) more steps.

        The other fields are copied as they are, not validated again: they were validated when this entry
        was made, and ``num_steps`` grows from a valid count by a non-negative ``int``, so the copy is what
        ``dataclasses.replace(self, num_steps=...)`` gives, without its second ``__post_init__`` (the common
        merged step of a training loop, once per step)."""
        merged = object.__new__(HistoryEntry)
        merged.__dict__.update(self.__dict__)
        object.__setattr__(merged, "num_steps", self.num_steps + num_steps)
        return merged

    def same_mechanism(self, other: HistoryEntry) -> bool:
        """Equal in everything but the step count, so the two may be merged."""
        return all(
            getattr(self, name) == getattr(other, name) for name in _FIELDS_BUT_STEPS
        )

    def repeats(
        self, *, noise_multiplier: object, sample_rate: object, num_bands: object, group_size: object,
        max_batch_size: object, batches_per_step: object, mechanism: object,
    ) -> bool:  # fmt: skip
        """Whether steps recorded with these arguments (and this entry's source, no mechanism parameters) are
        this entry's steps, with no validation needed: each argument is a plain ``float`` / ``int`` / ``str`` /
        ``None`` (no bool, no numpy or torch scalar) equal to this entry's validated field, so building a
        ``HistoryEntry`` from them would validate and normalise to these very fields. False is no verdict:
        the caller builds and validates the entry as usual."""
        return (
            not self.mechanism_parameters
            and type(noise_multiplier) is float and noise_multiplier == self.noise_multiplier
            and type(sample_rate) is float and sample_rate == self.sample_rate
            and type(num_bands) is int and num_bands == self.num_bands
            and type(batches_per_step) is int and batches_per_step == self.batches_per_step
            and type(mechanism) is str and mechanism == self.mechanism
            # (None where the field is None, else a plain int equal to it; spelled out: once per step)
            and (group_size is None if self.group_size is None
                 else type(group_size) is int and group_size == self.group_size)
            and (max_batch_size is None if self.max_batch_size is None
                 else type(max_batch_size) is int and max_batch_size == self.max_batch_size)
        )  # fmt: skip

    @property
    def spec(self) -> EventSpec:
        """What the mechanism stated about these steps (kind, num_bands, parameters)."""
        return EventSpec(kind=self.mechanism, num_bands=self.num_bands, parameters=self.mechanism_parameters)

    @property
    def sampling(self) -> Sampling:
        """How each of these steps drew its batch."""
        return Sampling(
            sample_rate=self.sample_rate,
            group_size=self.group_size,
            max_batch_size=self.max_batch_size,
            batches_per_step=self.batches_per_step,
        )

    def event(self) -> dp_accounting.DpEvent:
        """The dp-accounting event for this entry: the builder of its kind, given its noise
        multiplier, sampling, step count, num_bands and parameters (`accountants.events.build_event`)."""
        return self.spec.dp_event(
            noise_multiplier=self.noise_multiplier, sampling=self.sampling, steps=self.num_steps
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON, `weights_only`). An entry of the default kind without parameters is
        written exactly as before kinds existed (no `mechanism` keys), so its checkpoint reads the
        same in older versions."""
        data = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in ("mechanism", "mechanism_parameters")
        }
        if self.mechanism != DEFAULT_EVENT_KIND or self.mechanism_parameters:
            data["mechanism"] = self.mechanism
            data["mechanism_parameters"] = {name: _listed(value) for name, value in self.mechanism_parameters}
        return data

    @classmethod
    def from_dict(cls, data: Any) -> HistoryEntry:
        """The entry `to_dict` wrote (the `mechanism` keys optional: default kind), validated as on
        construction. TypeError if `data` is not a dict; ValueError naming unknown keys; the field
        checks' errors (ValueError / TypeError naming the field) for invalid values."""
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


def _listed(value: Any) -> Any:
    """Tuples as lists (plain JSON / weights_only data)."""
    return [_listed(item) for item in value] if isinstance(value, tuple) else value


@functools.lru_cache(maxsize=256)
def _check_buildable(spec: EventSpec, sampling: Sampling, noise_multiplier: float) -> None:
    """Raise what the kind's builder raises for this mechanism and sampling (the step count does not
    change what a builder can account, so one step is tried; cached, as entries are rebuilt at every
    merged step)."""
    spec.dp_event(noise_multiplier=noise_multiplier, sampling=sampling, steps=1)


_FIELDS_BUT_STEPS = tuple(field.name for field in dataclasses.fields(HistoryEntry) if field.name != "num_steps")
