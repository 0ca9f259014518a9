"""dp-accounting `DpEvent`s for the mechanisms privacy-engine trains with.

An event is a description of what was released, not a number: the accountants turn it into an
epsilon with dp-accounting's own RDP or PLD analysis. Nothing in this module computes privacy.

BandMF with cyclic Poisson sampling (Choquette-Choo et al. 2023, arXiv:2306.08153, "amplified
BandMF"; McKenna 2024, arXiv:2405.15913): the data are split into `num_bands` = b disjoint
groups and step t Poisson-samples, with probability `sample_rate`, from group t mod b only. With
the noise already scaled by the strategy's sensitivity, an example takes part in at most
ceil(steps / b) of the steps, each a Poisson-subsampled Gaussian, so the release is accounted as
ceil(steps / b) self-composed Poisson-subsampled Gaussians. b = 1 is DP-SGD.
"""

from __future__ import annotations

import math

import dp_accounting

from accountants._validation import (
    check_int,
    check_noise_multiplier,
    check_num_bands,
    check_sample_rate,
)

__all__ = [
    "accumulated_dpsgd_event",
    "bandmf_event",
    "dpsgd_event",
    "max_participations",
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
