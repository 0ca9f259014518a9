"""What ``make_private`` decided about the noise: ``NoisePlan`` (public, ``engine.noise_plan``), the
``BandCandidate`` rows of an automatic choice of bands, and the plan's internal ``LoaderShape`` and
``NoiseChoice``.

Plain frozen dataclasses with no heavy imports, so that checkpoints can rebuild a plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accountants.events import EventSpec

__all__ = ["BandCandidate", "LoaderShape", "MechanismCandidate", "NoiseChoice", "NoisePlan"]


@dataclass(frozen=True, kw_only=True)
class BandCandidate:
    """One number of bands considered by the automatic choice, with its criterion.

    ``expected_error = strategy_loss * noise_multiplier**2``: the mean expected squared error per
    coordinate of the noisy prefix sums over ``total_steps`` steps, in units of ``max_grad_norm**2``
    (``privacy_engine.noise.strategy.expected_error``). ``noise_multiplier`` is the given one
    (``make_private``) or the one calibrated for this b (``make_private_with_epsilon``, on a
    coarse grid; ``inf`` if the target is out of reach with this b).
    """

    num_bands: int
    noise_multiplier: float
    strategy_loss: float
    expected_error: float


@dataclass(frozen=True, kw_only=True)
class MechanismCandidate:
    """One mechanism compared by ``noise_mechanism="auto"`` (``engine.mechanism_choice``), calibrated to the
    target on a coarse grid.

    ``mechanism``: ``"gaussian"``, ``"bandmf"`` (``num_bands`` bands) or ``"blt"`` (``num_buffers`` buffers,
    cyclic sampling over ``num_bands`` groups). ``expected_error``: the mean expected squared error per
    coordinate of the noisy prefix sums over the planned steps, in units of ``max_grad_norm**2`` (``inf`` if
    the target is out of reach). ``noise_memory_bytes``: the noise state held, in bytes (DP-SGD: the draw;
    BandMF: the draw and ``b - 1`` past rows; BLT: the draw and ``d`` buffers). ``chosen``: the one picked;
    ``fits_memory``: within ``max_noise_memory``.
    """

    mechanism: str
    num_bands: int
    num_buffers: int | None
    noise_multiplier: float
    expected_error: float
    noise_memory_bytes: int
    chosen: bool = False
    fits_memory: bool = True

    @property
    def label(self) -> str:
        """``gaussian``, ``bandmf(b=4)`` or ``blt(d=4, b=8)``."""
        if self.mechanism == "bandmf":
            return f"bandmf(b={self.num_bands})"
        if self.mechanism == "blt":
            return f"blt(d={self.num_buffers}, b={self.num_bands})"
        return self.mechanism


@dataclass(frozen=True, kw_only=True)
class NoisePlan:
    """What ``make_private`` set up for the noise and the accounting (``engine.noise_plan``).

    ``mechanism``: ``"gaussian"``, ``"bandmf"``, ``"blt"`` or ``"custom"`` (a ``NoiseMechanism`` passed in).
    ``num_buffers``: BLT's buffers (None otherwise; its ``num_bands`` is the cyclic groups, the min separation).
    ``mechanism_candidates``: what ``noise_mechanism="auto"`` compared (empty otherwise).
    ``coefficients``: the BandMF strategy ``(c_0, ..., c_{b-1})``, None otherwise.
    ``total_steps``: the steps the strategy was optimised for / the noise calibrated over (None
    when neither applies). ``group_size`` and ``max_batch_size``: truncated sampling (the realised
    group size with the largest epsilon, see ``engine.truncation``, and the cap), both None otherwise. ``candidates``: the band counts compared when ``num_bands``
    was chosen automatically (empty otherwise), in increasing b.
    """

    mechanism: str
    num_bands: int
    noise_multiplier: float
    sample_rate: float
    expected_batch_size: float
    coefficients: tuple[float, ...] | None = None
    total_steps: int | None = None
    group_size: int | None = None
    max_batch_size: int | None = None
    candidates: tuple[BandCandidate, ...] = ()
    num_buffers: int | None = None
    mechanism_candidates: tuple[MechanismCandidate, ...] = ()

    @property
    def num_bands_chosen_automatically(self) -> bool:
        """Whether ``num_bands`` was chosen automatically (``candidates`` is not empty)."""
        return bool(self.candidates)


@dataclass(frozen=True, kw_only=True)
class NoiseChoice:
    """The noise mechanism decided before the loader is built (internal to the plan)."""

    mechanism: str
    num_bands: int
    coefficients: tuple[float, ...] | None
    #: Builds the mechanism; called only once nothing can fail any more (it may draw a seed).
    make_noise: Callable[[], Any]
    total_steps: int | None
    noise_multiplier: float  # inf: to be calibrated
    candidates: tuple[BandCandidate, ...] = ()
    #: The privacy event the mechanism states (a custom mechanism's own); None: DP-SGD over ``num_bands``.
    stated_event: EventSpec | None = None
    #: BLT's buffers (None for the others).
    num_buffers: int | None = None
    #: The mechanisms ``noise_mechanism="auto"`` compared (empty otherwise).
    mechanism_candidates: tuple[MechanismCandidate, ...] = ()

    @property
    def event(self) -> EventSpec:
        """What calibration and the accountant are given for this mechanism."""
        return EventSpec(num_bands=self.num_bands) if self.stated_event is None else self.stated_event


@dataclass(frozen=True, kw_only=True)
class LoaderShape:
    """The data loader as the plan counts it (internal).

    ``private_steps_per_epoch``: what the private loaders yield per epoch (the Poisson loader's
    ``round(1 / q)``, the cyclic one the same). It can exceed ``loader_steps_per_epoch`` (drop_last
    with a fractional N / B, a subset sampler): calibration and a BandMF strategy count the steps
    that will actually run. ``accounted_steps_per_epoch``: the steps an epoch records (the loader's
    own without Poisson sampling).
    """

    num_examples: int
    batch_size: int
    loader_steps_per_epoch: int
    private_steps_per_epoch: int
    accounted_steps_per_epoch: int
