"""dp-accounting `DpEvent`s for the mechanisms privacy-engine trains with.

An event is a description of what was released, not a number: the accountants turn it into an
epsilon with dp-accounting's own RDP or PLD analysis. Nothing in this module computes privacy.

BandMF with cyclic Poisson sampling (Choquette-Choo et al. 2023, arXiv:2306.08153, "amplified
BandMF"; McKenna 2024, arXiv:2405.15913): the data are split into `num_bands` = b disjoint
groups and step t Poisson-samples, with probability `sample_rate`, from group t mod b only. With
the noise already scaled by the strategy's sensitivity, an example takes part in at most
ceil(steps / b) of the steps, each a Poisson-subsampled Gaussian, so the release is accounted as
ceil(steps / b) self-composed Poisson-subsampled Gaussians. b = 1 is DP-SGD.

Mechanisms state their event (``NoiseMechanism.privacy_event``) as plain data, an ``EventSpec``: the
name of an event *kind* and its parameters. A kind is a registered builder (``register_event_kind``)
that turns (noise multiplier, ``Sampling``, step count, ``num_bands``, parameters) into a ``DpEvent``.
An accountant's ledger stores the kind's name and parameters, never a function or an object, so a
ledger stays JSON / ``weights_only`` data and is rebuilt into events through this registry; the
accountant composes whatever the builder returns and knows no mechanism by name. Built in:
``"gaussian"`` (``gaussian_event``), the event of DP-SGD and of BandMF (whose noise, scaled by its
strategy's sensitivity, makes every participation a Gaussian mechanism). A new mechanism with another
analysis registers its own kind in its own module. This module imports nothing from privacy_engine
(the noise mechanisms import it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Protocol

import dp_accounting

from accountants._validation import (
    check_int,
    check_noise_multiplier,
    check_num_bands,
    check_sample_rate,
    check_truncation,
)

__all__ = [
    "DEFAULT_EVENT_KIND",
    "EventBuilder",
    "EventSpec",
    "Sampling",
    "accumulated_dpsgd_event",
    "bandmf_event",
    "build_event",
    "dpsgd_event",
    "entries_compose",
    "event_kinds",
    "gaussian_event",
    "max_participations",
    "register_event_kind",
    "truncated_bandmf_event",
    "truncation_supported",
]


def truncation_supported() -> bool:
    """Whether the installed dp-accounting has `TruncatedSubsampledGaussianDpEvent` (>= 0.6)."""
    return hasattr(dp_accounting, "TruncatedSubsampledGaussianDpEvent")


def max_participations(steps: int, num_bands: int) -> int:
    """Most steps any one example takes part in: ceil(steps / num_bands).

    Any window of `steps` consecutive steps holds at most ceil(steps / b) indices t with
    t mod b equal to a given group, whatever step the window starts at.
    """
    steps = check_int("steps", steps, low=0)
    num_bands = check_num_bands(num_bands)
    return -(-steps // num_bands)


def dpsgd_event(
    noise_multiplier: float, sample_rate: float, steps: int
) -> dp_accounting.DpEvent:
    """`steps` DP-SGD steps: SelfComposed(PoissonSampled(Gaussian(sigma), q), steps).

    Guarantee: the event describes exactly the release of `steps` sums of Poisson-sampled
    (probability `sample_rate`), L2-clipped gradients plus Gaussian noise of standard deviation
    noise_multiplier * clip norm, under add/remove-one adjacency.

    =====================  ======================================================
    case                   result
    =====================  ======================================================
    steps = 0              NoOpDpEvent (epsilon 0)
    noise_multiplier = 0   event as usual; accountants report epsilon = inf if q > 0
    sample_rate = 0        event as usual; epsilon 0 (nothing is ever sampled)
    sample_rate = 1        full-batch Gaussian, composed `steps` times
    negative / NaN / >1 q  ValueError naming the argument
    =====================  ======================================================
    """
    noise_multiplier = check_noise_multiplier(noise_multiplier)
    sample_rate = check_sample_rate(sample_rate)
    steps = check_int("steps", steps, low=0)
    if steps == 0:
        # dp-accounting rejects SelfComposedDpEvent(count=0).
        return dp_accounting.NoOpDpEvent()
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
        ),
        steps,
    )


def accumulated_dpsgd_event(
    noise_multiplier: float, sample_rate: float, steps: int, batches_per_step: int
) -> dp_accounting.DpEvent:
    """`steps` releases, each the noisy sum of `batches_per_step` independent Poisson batches.

    Guarantee: in each release an example is in each of the k = `batches_per_step` batches
    independently with probability q, so (add/remove adjacency) its clipped contribution has norm
    at most m * C with m ~ Binomial(k, q); the event is
    SelfComposed(MixtureOfGaussians(sigma, sensitivities (0, 1, ..., k), Binomial(k, q) pmf), steps)
    in units of the clip norm (arXiv:2310.15526). With k = 1 it equals `dpsgd_event`.

    =====================  ======================================================
    case                   result
    =====================  ======================================================
    batches_per_step = 1   MixtureOfGaussians over (0, 1): the Poisson-sampled Gaussian
    steps = 0              NoOpDpEvent
    RDP accountant         not supported by dp-accounting (use PLD)
    =====================  ======================================================
    """
    noise_multiplier = check_noise_multiplier(noise_multiplier)
    sample_rate = check_sample_rate(sample_rate)
    steps = check_int("steps", steps, low=0)
    batches = check_int("batches_per_step", batches_per_step, low=1)
    if steps == 0:
        return dp_accounting.NoOpDpEvent()
    probabilities = [math.comb(batches, m) * sample_rate**m * (1 - sample_rate) ** (batches - m)
                     for m in range(batches + 1)]  # fmt: skip
    mixture = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
        standard_deviation=noise_multiplier,
        sensitivities=[float(m) for m in range(batches + 1)],
        sampling_probs=probabilities,
    )
    return dp_accounting.SelfComposedDpEvent(mixture, steps)


def bandmf_event(
    noise_multiplier: float, sample_rate: float, steps: int, num_bands: int
) -> dp_accounting.DpEvent:
    """`steps` BandMF steps with cyclic Poisson sampling over `num_bands` groups.

    Guarantee: for a b-banded strategy whose noise is scaled by its sensitivity, each example is
    in at most ceil(steps / b) steps, each a Poisson-subsampled Gaussian (probability
    `sample_rate`, noise multiplier `noise_multiplier`); the event is
    SelfComposed(PoissonSampled(Gaussian(sigma), q), ceil(steps / b)).

    =====================  ======================================================
    case                   result
    =====================  ======================================================
    num_bands = 1          identical to dpsgd_event(sigma, q, steps)
    steps = 0              NoOpDpEvent
    steps < num_bands      one participation: a single subsampled Gaussian
    num_bands < 1          ValueError naming num_bands
    =====================  ======================================================
    """
    return dpsgd_event(
        noise_multiplier, sample_rate, max_participations(steps, num_bands)
    )


def truncated_bandmf_event(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    num_bands: int,
    group_size: int,
    max_batch_size: int,
) -> dp_accounting.DpEvent:
    """BandMF (or DP-SGD when num_bands = 1) with truncated cyclic Poisson sampling.

    Each step Poisson-samples (probability `sample_rate`) from a group of `group_size` examples and,
    if more than `max_batch_size` are drawn, keeps a uniformly random subset of `max_batch_size`.
    Guarantee: the event is SelfComposed(TruncatedSubsampledGaussian(group_size, q, max_batch_size,
    sigma), ceil(steps / num_bands)), dp-accounting's analysis of truncated Poisson sampling
    (arXiv:2508.15089). Only dp-accounting's PLD accountant supports it (0.6.0).

    ================================  ============================================
    case                              result
    ================================  ============================================
    max_batch_size >= group_size      truncation never happens: plain subsampling
    steps = 0                         NoOpDpEvent
    group_size or max_batch_size < 1  ValueError naming the argument
    dp-accounting < 0.6               NotImplementedError (event type missing)
    ================================  ============================================
    """
    noise_multiplier = check_noise_multiplier(noise_multiplier)
    sample_rate = check_sample_rate(sample_rate)
    group_size = check_int(
        "group_size",
        group_size,
        low=1,
        hint="It is the number of examples sampled from.",
    )
    max_batch_size = check_int(
        "max_batch_size", max_batch_size, low=1, hint="It is the cap on the batch size."
    )
    participations = max_participations(steps, num_bands)
    if not truncation_supported():
        raise NotImplementedError(
            "truncated Poisson sampling needs dp_accounting.TruncatedSubsampledGaussianDpEvent "
            "(dp-accounting >= 0.6); upgrade dp-accounting or drop max_batch_size/group_size."
        )
    if participations == 0:
        return dp_accounting.NoOpDpEvent()
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=group_size,
            sampling_probability=sample_rate,
            truncated_batch_size=max_batch_size,
            noise_multiplier=noise_multiplier,
        ),
        participations,
    )


# ------------------------------------------------------------------------------------------------------------
# What a mechanism states: the sampling of a step, its event kind, and the registry of kinds.

#: The kind of the old ledgers (entries saved without a kind) and of DP-SGD and BandMF.
DEFAULT_EVENT_KIND = "gaussian"

_PLAIN_SCALARS = (bool, int, float, str, type(None))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the examples of one release are drawn (what the data loader does), as an event builder sees it.

    ``sample_rate``: each example's Poisson probability q, in [0, 1]. ``group_size`` and
    ``max_batch_size``: truncated sampling (Poisson from ``group_size`` examples, at most
    ``max_batch_size`` kept), both None for plain Poisson sampling. ``batches_per_step``: independent
    Poisson batches summed into one release (gradient accumulation over k draws), >= 1. Validated on
    construction; errors name the field.
    """

    sample_rate: float
    group_size: int | None = None
    max_batch_size: int | None = None
    batches_per_step: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "sample_rate", check_sample_rate(self.sample_rate))
        group_size, max_batch_size = check_truncation(self.group_size, self.max_batch_size)
        object.__setattr__(self, "group_size", group_size)
        object.__setattr__(self, "max_batch_size", max_batch_size)
        object.__setattr__(self, "batches_per_step", check_int("batches_per_step", self.batches_per_step, low=1))

    @property
    def truncated(self) -> bool:
        """Whether this is truncated Poisson sampling (`max_batch_size` set; `group_size` is then set too)."""
        return self.max_batch_size is not None


class EventBuilder(Protocol):
    """Turns one ledger entry into its ``DpEvent``: ``steps`` identical steps of noise multiplier
    ``noise_multiplier`` (in units of the clipping sensitivity), batches drawn as ``sampling`` says,
    an example taking part in at most one of any ``num_bands`` consecutive steps (cyclic sampling),
    with the kind's own ``parameters`` (plain values, lists as tuples).

    A builder must be a pure function of its arguments (a ledger rebuilds its events from them at any
    time, in another process), return a ``dp_accounting.DpEvent`` that bounds the privacy loss of
    those steps under add/remove-one adjacency, and raise ``ValueError`` (naming the argument) for
    what it cannot account. ``steps`` >= 1 when called from a ledger."""

    def __call__(
        self, *, noise_multiplier: float, sampling: Sampling, steps: int, num_bands: int, **parameters: Any
    ) -> dp_accounting.DpEvent: ...


_EVENT_BUILDERS: dict[str, EventBuilder] = {}


def register_event_kind(kind: str, builder: EventBuilder | None = None) -> Any:
    """Register ``builder`` as the event of ``kind`` (also usable as ``@register_event_kind(kind)``).

    Guarantee: a kind names one analysis for good. Registering another function under a taken name
    raises ``ValueError`` (silently replacing it would change the epsilon of every ledger holding
    that kind); registering the same function again (same module and name, e.g. a reload) is a no-op.
    """
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind must be a non-empty str; got {kind!r}")

    def register(function: EventBuilder) -> EventBuilder:
        if not callable(function):
            raise TypeError(f"the builder of event kind {kind!r} must be callable; got {function!r}")
        known = _EVENT_BUILDERS.get(kind)
        if known is not None and _qualified_name(known) != _qualified_name(function):
            raise ValueError(
                f"event kind {kind!r} is already registered to {_qualified_name(known)}; pick another name for "
                f"{_qualified_name(function)}"
            )
        _EVENT_BUILDERS[kind] = function
        return function

    return register if builder is None else register(builder)


def _qualified_name(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def entries_compose(kind: str) -> bool:
    """Whether separate ledger entries of ``kind`` from one source may be composed as independent mechanisms.

    True unless the kind's builder is marked ``whole_run = True``: its event for ``steps`` steps describes the
    first ``steps`` steps of one mechanism run from its start (correlated noise analysed as one Gaussian
    mechanism on the whole run, e.g. BLT's ``"blt"``), so a second entry of it for the same source cannot be
    composed with the first (the accountant refuses to record one)."""
    return not getattr(_builder(kind), "whole_run", False)


def event_kinds() -> tuple[str, ...]:
    """The registered event kinds, sorted."""
    return tuple(sorted(_EVENT_BUILDERS))


def _builder(kind: str) -> EventBuilder:
    try:
        return _EVENT_BUILDERS[kind]
    except KeyError:
        raise ValueError(
            f"no event builder is registered for kind {kind!r} (registered: {list(event_kinds())}): register one "
            "with accountants.events.register_event_kind, or import the module that does (usually the noise "
            "mechanism's own module) before using or loading it"
        ) from None


def _plain(name: str, value: Any) -> Any:
    """``value`` as plain, hashable data (lists become tuples); TypeError naming ``name`` otherwise."""
    if isinstance(value, (list, tuple)):
        return tuple(_plain(name, item) for item in value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        return float(value)
    if isinstance(value, int):
        return int(value)
    raise TypeError(
        f"event parameter {name!r} must be plain data (int, float, str, bool, None, or lists of them) so that a "
        f"ledger holding it stays serialisable; got {type(value).__name__}"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventSpec:
    """A mechanism's privacy event as plain data: what ``NoiseMechanism.privacy_event`` states.

    ``kind``: a registered event builder (``register_event_kind``). ``num_bands``: the cyclic sampling
    the mechanism needs (an example takes part in at most one of any ``num_bands`` consecutive steps;
    1: plain Poisson sampling); the engine builds its loader with that many groups and ties each batch
    to the noise row of its own step when it is > 1. ``parameters``: the kind's other parameters, plain
    values sorted by name (give a dict; lists are kept as tuples). Validated on construction: an
    unknown kind, ``num_bands`` < 1 or a non-plain parameter raise, naming it.

    An accountant's ledger stores exactly these three fields (``Accountant.step(num_bands=,
    mechanism=kind, mechanism_parameters=parameters)``), never the mechanism, so it can be saved as
    plain data and its events rebuilt from the registry.
    """

    kind: str = DEFAULT_EVENT_KIND
    num_bands: int = 1
    parameters: Any = ()

    def __post_init__(self) -> None:
        _builder(self.kind)
        object.__setattr__(self, "num_bands", check_num_bands(self.num_bands))
        parameters = self.parameters
        if isinstance(parameters, Mapping):
            parameters = parameters.items()
        try:
            pairs = [(name, value) for name, value in parameters]
        except (TypeError, ValueError):
            raise TypeError(f"parameters must be a dict of plain values; got {self.parameters!r}") from None
        for name, _ in pairs:
            if not isinstance(name, str) or name in ("noise_multiplier", "sampling", "steps", "num_bands"):
                raise ValueError(f"event parameter name {name!r} is not a str or is one every builder already takes")
        object.__setattr__(self, "parameters", tuple(sorted((name, _plain(name, value)) for name, value in pairs)))

    def dp_event(self, *, noise_multiplier: float, sampling: Sampling, steps: int) -> dp_accounting.DpEvent:
        """The ``DpEvent`` of ``steps`` identical steps (``build_event``)."""
        return build_event(self, noise_multiplier=noise_multiplier, sampling=sampling, steps=steps)

    def step_kwargs(self) -> dict[str, Any]:
        """The ``Accountant.step`` keyword arguments that record this event (the kind and its
        parameters only when they are not the default, so that a DP-SGD / BandMF step is recorded
        with exactly the arguments of the public API)."""
        kwargs: dict[str, Any] = {"num_bands": self.num_bands}
        if self.kind != DEFAULT_EVENT_KIND or self.parameters:
            kwargs["mechanism"] = self.kind
            kwargs["mechanism_parameters"] = dict(self.parameters)
        return kwargs


def build_event(
    spec: EventSpec, *, noise_multiplier: float, sampling: Sampling, steps: int
) -> dp_accounting.DpEvent:
    """The ``DpEvent`` the builder of ``spec.kind`` returns for ``steps`` identical steps.

    Guarantee: exactly the registered builder's event, checked to be a ``dp_accounting.DpEvent``
    (anything else raises ``TypeError`` naming the kind). The arguments are validated first
    (``ValueError`` naming them); ``steps = 0`` is passed on (builders return ``NoOpDpEvent``).
    """
    if not isinstance(spec, EventSpec):
        raise TypeError(f"spec must be an EventSpec; got {type(spec).__name__}")
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be an accountants.events.Sampling; got {type(sampling).__name__}")
    event = _builder(spec.kind)(
        noise_multiplier=check_noise_multiplier(noise_multiplier),
        sampling=sampling,
        steps=check_int("steps", steps, low=0),
        num_bands=spec.num_bands,
        **dict(spec.parameters),
    )
    if not isinstance(event, dp_accounting.DpEvent):
        raise TypeError(f"the builder of event kind {spec.kind!r} returned {type(event).__name__}, not a DpEvent")
    return event


@register_event_kind(DEFAULT_EVENT_KIND)
def gaussian_event(
    *, noise_multiplier: float, sampling: Sampling, steps: int, num_bands: int = 1
) -> dp_accounting.DpEvent:
    """The event of DP-SGD (``num_bands`` = 1) and of BandMF with ``num_bands`` bands: every
    participation is the Gaussian mechanism with noise multiplier ``noise_multiplier`` on the
    clipped sum of a batch drawn as ``sampling`` says, and an example takes part in at most
    ceil(steps / num_bands) of the steps.

    Guarantee: the event the functions above build for that release, chosen by the sampling:

    ==============================  ==================================================
    sampling                        event
    ==============================  ==================================================
    Poisson (one batch per step)    ``bandmf_event`` (``dpsgd_event`` for b = 1)
    truncated (group_size, cap)     ``truncated_bandmf_event`` (PLD only)
    batches_per_step = k > 1        ``accumulated_dpsgd_event`` (PLD only)
    k > 1 with b > 1 or truncation  ValueError: not accounted (one batch per step)
    ==============================  ==================================================
    """
    if sampling.batches_per_step > 1:
        if num_bands > 1 or sampling.truncated:
            raise ValueError(
                "batches_per_step > 1 (several Poisson batches in one release) is accounted for plain "
                "DP-SGD only; BandMF and truncated sampling need exactly one batch per step"
            )
        return accumulated_dpsgd_event(noise_multiplier, sampling.sample_rate, steps, sampling.batches_per_step)
    if sampling.truncated:
        return truncated_bandmf_event(
            noise_multiplier, sampling.sample_rate, steps, num_bands, sampling.group_size, sampling.max_batch_size
        )
    return bandmf_event(noise_multiplier, sampling.sample_rate, steps, num_bands)
