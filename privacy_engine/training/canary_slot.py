"""What an audit's canaries are given at each release, and what they must do with it.

A privacy audit (``privacy_engine.auditing``) needs canaries that take part in the training exactly as
examples do: inside the clipped sum, before the noise. Nothing in the optimizer exposes the un-noised
clipped sum (a public hook on it would let any code read a release before its noise). Instead the engine
gives the ``DPOptimizer`` one declared component, ``canaries`` (a ``ClippedSumCanaries``), whose only
operation on the release is to add its own contributions to the clipped sums; the optimizer calls it
once per released step, after the examples are clipped and before the noise is added. The protocol is
declared here, in ``training/``, so that the optimizer never imports ``auditing/`` (a higher layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["CanarySlot", "ClippedSumCanaries"]


@dataclass(frozen=True, kw_only=True)
class CanarySlot:
    """One release, as a canary that takes part like an example sees it (plain public values).

    ``sample_rate``: the Poisson rate the accountant records for this release; ``num_draws``: the loader
    batches the release holds (each an independent draw at that rate); ``group``: the cyclic group the
    release's batch was drawn from (BandMF, ``loader_step mod num_groups``; 0 without cyclic groups);
    ``sensitivity``: the clipper's bound C (a canary's clipped gradient has norm C)."""

    sample_rate: float
    num_draws: int
    group: int
    num_groups: int
    sensitivity: float


@runtime_checkable
class ClippedSumCanaries(Protocol):
    """An engine-owned component the optimizer calls once per release, before the noise.

    Guarantee asked of an implementation: ``add_to_clipped_sums`` adds to ``clipped_sums`` (one tensor per
    private parameter, in place) a vector that does not depend on the training data (only on its own
    state and ``slot``), of norm at most ``slot.sensitivity`` per canary taking part; it reads nothing
    from ``clipped_sums`` and keeps no reference to them. Its state is plain data (``state_dict``), saved
    and restored with the optimizer's DP state."""

    def add_to_clipped_sums(self, clipped_sums: Sequence[torch.Tensor], slot: CanarySlot) -> None:
        """Add this release's canary contributions to ``clipped_sums`` in place."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The canaries' state as plain data."""
        ...

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` unless ``load_state_dict(state)`` would restore it; change nothing."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``."""
        ...
