"""BandMF in the plan: the number of bands (given, or chosen among ``CANDIDATE_NUM_BANDS``), the
strategy coefficients, and the checks that the loader can feed b cyclic groups.

The automatic choice (``make_private_with_epsilon`` without ``num_bands``) compares, for every b the loader
allows, the expected squared error of the noisy prefix sums, ``strategy_loss(c_b, total_steps) * sigma_b^2``,
sigma_b calibrated for b's own mechanism at the target (b compared at a fixed budget). The choice is logged
(INFO). ``make_private`` (a given sigma) needs ``num_bands``: at one sigma more bands always give less error
while each costs more epsilon, so there is no fair choice there.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

from accountants import Accountant, CalibrationError
from accountants.events import EventSpec
from privacy_engine.engine.calibration import COMPARISON_TOLERANCE, calibrate, comparison_accountant
from privacy_engine.engine.limits import check_bandmf_size
from privacy_engine.engine.noise_plan import BandCandidate, LoaderShape, NoiseChoice
from privacy_engine.engine.options import PrivacyOptions
from privacy_engine.noise import BandMFNoise
from privacy_engine.noise.strategy import expected_error, optimize_banded_toeplitz, strategy_loss

__all__ = ["CANDIDATE_NUM_BANDS", "check_num_bands", "compare_num_bands", "plan_bandmf"]

logger = logging.getLogger(__name__)

#: Band counts tried when ``noise_mechanism="bandmf"`` is given without ``num_bands`` (those the
#: loader and the number of steps allow).
CANDIDATE_NUM_BANDS = (1, 2, 4, 8, 16, 32, 64)


@functools.lru_cache(maxsize=256)
def strategy_coefficients(total_steps: int, num_bands: int) -> tuple[float, ...]:
    """The optimal b-banded Toeplitz strategy for ``total_steps`` steps."""
    # Deterministic and ~0.1 s for thousands of steps: cached because choosing b optimises one
    # strategy per candidate, and tutorials repeat the same runs over seeds and epsilons.
    return tuple(float(c) for c in optimize_banded_toeplitz(total_steps, num_bands))


def check_num_bands(num_bands: int, shape: LoaderShape) -> None:
    """ValueError naming ``num_bands`` unless every one of the b cyclic groups gets a step each
    epoch and enough examples for its sample rate ``b * batch_size / len(dataset)``."""
    steps_per_epoch, batch_size, num_examples = shape.private_steps_per_epoch, shape.batch_size, shape.num_examples
    if num_bands > steps_per_epoch:
        raise ValueError(
            f"num_bands={num_bands} exceeds the {steps_per_epoch} steps per epoch (round(len(dataset) / batch_size)): "
            f"cyclic sampling gives each of the b groups its own steps, and every group needs at least one step "
            f"per epoch. Use num_bands <= {steps_per_epoch}, or a smaller batch_size (more steps per epoch)."
        )
    if num_bands * batch_size > num_examples:
        raise ValueError(
            f"num_bands={num_bands} with batch_size={batch_size} needs {num_bands * batch_size} examples per cycle "
            f"but the dataset has {num_examples}: each group of ~{num_examples // num_bands} examples would be "
            f"sampled with probability > 1. Use num_bands <= {num_examples // batch_size} or a smaller batch_size."
        )


def plan_bandmf(options: PrivacyOptions, shape: LoaderShape, *, accountant: Accountant,
                seed: Callable[[], int | None], secure_mode: bool) -> NoiseChoice:  # fmt: skip
    """BandMF's bands, coefficients and builder for ``options`` (already checked on their own) on
    this loader; ``seed`` is called when the mechanism is built."""
    num_bands, coefficients = options.num_bands, options.bandmf_coefficients
    if num_bands is not None:
        check_num_bands(num_bands, shape)
    steps = options.total_steps
    if steps is None and options.epochs is not None:
        steps = options.epochs * shape.private_steps_per_epoch
    steps = None if steps is None else int(steps)
    setting = "total_steps" if options.total_steps is not None else "epochs * steps per epoch (total_steps)"
    # Before any strategy is optimised: its memory and time grow with the steps (and the bands).
    check_bandmf_size(total_steps=steps, num_bands=num_bands, optimised=coefficients is None, setting=setting)
    if coefficients is None and num_bands is not None and steps < num_bands:
        raise ValueError(f"total_steps={steps} is smaller than num_bands={num_bands}: use num_bands <= total_steps")
    candidates: tuple[BandCandidate, ...] = ()
    if num_bands is None and options.target is None:
        raise ValueError(
            "noise_mechanism='bandmf' with a given noise_multiplier needs num_bands: at one sigma more bands always "
            "give less error but each costs more epsilon (fewer cyclic groups, less amplification), so no choice is "
            "fair. Give num_bands=b, or use make_private_with_epsilon, which compares the band counts at equal "
            "epsilon (noise_mechanism='bandmf' without num_bands, or noise_mechanism='auto')"
        )
    if num_bands is None:
        allowed = [
            b for b in CANDIDATE_NUM_BANDS
            if b <= shape.private_steps_per_epoch and b * shape.batch_size <= shape.num_examples and b <= steps
        ]  # fmt: skip
        check_bandmf_size(total_steps=steps, num_bands=max(allowed, default=None), setting=setting)
        accounted_steps = None if options.epochs is None else options.epochs * shape.accounted_steps_per_epoch
        candidates = compare_num_bands(allowed, options, shape, total_steps=steps, accounted_steps=accounted_steps,
                                       accountant=accountant)  # fmt: skip
        num_bands = _best(candidates, total_steps=steps, target=options.target)
    if coefficients is None:
        coefficients = strategy_coefficients(steps, num_bands)
    # Built once here to validate; the real one is built (seeded) when nothing can fail any more.
    BandMFNoise(coefficients, seed=0)
    return NoiseChoice(
        mechanism="bandmf", num_bands=num_bands, coefficients=coefficients, total_steps=steps,
        noise_multiplier=options.sigma, candidates=candidates,
        make_noise=lambda: BandMFNoise(coefficients, seed=seed(), secure_mode=secure_mode,
                                       noise_stream=options.noise_stream),
    )  # fmt: skip


def _best(candidates: tuple[BandCandidate, ...], *, total_steps: int, target: tuple[float, float] | None) -> int:
    """The b with the smallest criterion (ties: smaller strategy loss, then fewer bands), logged."""
    best = min(candidates, key=lambda c: (c.expected_error, c.strategy_loss, c.num_bands))
    how = ("at the given noise_multiplier" if target is None
           else f"each b with its own noise_multiplier calibrated to (epsilon, delta) = {target}")  # fmt: skip
    logger.info(
        "noise_mechanism='bandmf': num_bands=%d chosen among %s by the expected squared error of the noisy "
        "prefix sums over %d steps (strategy_loss * noise_multiplier^2, %s): %s",
        best.num_bands, [c.num_bands for c in candidates], total_steps, how,
        ", ".join(f"b={c.num_bands}: {c.expected_error:.4g} (sigma {c.noise_multiplier:.4g})" for c in candidates),
    )  # fmt: skip
    return best.num_bands


def compare_num_bands(allowed: list[int], options: PrivacyOptions, shape: LoaderShape, *, total_steps: int,
                      accounted_steps: int | None, accountant: Accountant) -> tuple[BandCandidate, ...]:  # fmt: skip
    """The criterion ``strategy_loss(c_b, total_steps) * sigma_b^2`` for every allowed b.

    sigma_b is ``options.noise_multiplier`` (given) or calibrated to ``options.target`` for b's own
    mechanism: sample rate ``b * batch_size / num_examples``, ``ceil(steps / b)`` participations,
    and truncation from a group of ``ceil(num_examples / b)`` (the largest of the equal split).
    Raises the ``CalibrationError`` of an unreachable target only if no b reaches it.
    """
    comparison = comparison_accountant(accountant)
    num_examples, max_batch_size = shape.num_examples, options.max_batch_size
    candidates = []
    unreachable: CalibrationError | None = None
    for bands in allowed:
        coefficients = strategy_coefficients(total_steps, bands)
        loss = strategy_loss(coefficients, total_steps)
        sigma = options.sigma
        if options.target is not None:
            group_size = -(-num_examples // bands) if max_batch_size is not None else None
            try:
                sigma = calibrate(comparison, options.target, bands * shape.batch_size / num_examples, accounted_steps,
                                  event=EventSpec(num_bands=bands), group_size=group_size, max_batch_size=max_batch_size,
                                  tolerance=COMPARISON_TOLERANCE)  # fmt: skip
            except CalibrationError as error:
                if not error.unreachable:
                    raise
                unreachable, sigma = error, math.inf
        error = math.inf if math.isinf(sigma) else expected_error(coefficients, total_steps, sigma)
        candidates.append(
            BandCandidate(num_bands=bands, noise_multiplier=sigma, strategy_loss=loss, expected_error=error)
        )
    if unreachable is not None and all(math.isinf(c.noise_multiplier) for c in candidates):
        raise unreachable
    return tuple(candidates)
