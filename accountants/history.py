"""One entry of an accountant's ledger: `num_steps` consecutive identical training steps.

A `HistoryEntry` is validated on construction, knows the dp-accounting event it stands for
(`accountants.events`) and round-trips through plain dicts (`to_dict` / `from_dict`), which is how
accountants save their history in checkpoints.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import dp_accounting

from accountants._validation import (
    check_int,
    check_noise_multiplier,
    check_num_bands,
    check_sample_rate,
    check_truncation,
)
from accountants.events import (
    accumulated_dpsgd_event,
    bandmf_event,
    max_participations,
    truncated_bandmf_event,
)

__all__ = ["HistoryEntry"]


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
