"""BLT in the plan, and ``noise_mechanism="auto"``: the mechanism with the lowest expected error at equal epsilon.

``plan_blt``: the BLT strategy (``noise.blt.optimize_blt``, cached) for the run's steps, with cyclic sampling over
``num_bands`` groups (the min separation; default the most the loader allows, ``min(steps per epoch,
len(dataset) // batch_size)``: BLT is accounted without amplification, so the fewest participations are best)
and ``num_buffers`` buffers (default ``DEFAULT_NUM_BUFFERS``).

``plan_auto`` (``make_private_with_epsilon`` only): DP-SGD, BandMF for every band count the loader allows
(``engine.bands.CANDIDATE_NUM_BANDS``) and BLT with each of ``CANDIDATE_NUM_BUFFERS`` buffers are each calibrated
to the target (epsilon, delta) over the planned steps (on the comparison accountant, ``engine.calibration``), and
the one with the smallest **expected error** wins: the mean over the steps of the expected squared error per
coordinate of the noisy prefix sums (the sums of released gradients, what SGD's iterates add up), in units of
``max_grad_norm**2`` -- ``strategy_loss * sigma**2`` for DP-SGD and BandMF, ``blt_loss * sigma**2`` for BLT (JAX
Privacy's mean loss; the RMSE is its square root). Candidates whose noise state exceeds ``max_noise_memory``
bytes are left out, and so is BLT with adaptive clipping (which it does not support). The table of candidates
(mechanism, sigma, expected error, memory) is logged (INFO) and kept in
``engine.noise_plan.mechanism_candidates``; ``format_candidates`` prints it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable

import torch

from accountants import Accountant, CalibrationError
from privacy_engine.engine.bands import CANDIDATE_NUM_BANDS, check_num_bands, compare_num_bands, plan_bandmf
from privacy_engine.engine.calibration import COMPARISON_TOLERANCE, calibrate, comparison_accountant
from privacy_engine.engine.noise_plan import LoaderShape, MechanismCandidate, NoiseChoice
from privacy_engine.engine.options import PrivacyOptions
from privacy_engine.noise import GaussianNoise
from privacy_engine.noise.blt import BLTNoise, BLTStrategy, blt_loss, optimize_blt

__all__ = [
    "CANDIDATE_NUM_BUFFERS",
    "DEFAULT_NUM_BUFFERS",
    "blt_min_separation",
    "blt_strategy",
    "format_candidates",
    "noise_vector_bytes",
    "plan_auto",
    "plan_blt",
]

logger = logging.getLogger(__name__)

#: Buffers of BLT when ``num_buffers`` is not given (JAX Privacy finds 3 to 6 usually best).
DEFAULT_NUM_BUFFERS = 4
#: Buffer counts of BLT that ``noise_mechanism="auto"`` compares.
CANDIDATE_NUM_BUFFERS = (2, 4, 6)


@functools.lru_cache(maxsize=128)
def blt_strategy(total_steps: int, num_buffers: int, min_sep: int) -> BLTStrategy:
    """The optimised BLT strategy for ``total_steps`` steps, min separation ``min_sep`` (cached: deterministic,
    and tutorials repeat the same runs over seeds and epsilons)."""
    return optimize_blt(total_steps, num_buffers, min_sep=min_sep)


def noise_vector_bytes(params: Iterable[torch.Tensor]) -> int:
    """The bytes of one noise vector over ``params`` as one process holds it: what ``plan_auto`` counts against
    ``max_noise_memory`` (as ``parameter_bytes``), in each parameter's own dtype.

    A parameter sharded over a device mesh (a DTensor: FSDP2's ``fully_shard``, where each rank noises and keeps
    history for its own shard only) counts its *largest* local shard, the one at mesh coordinate 0 (torch cuts a
    sharded dimension of size ``n`` over ``m`` ranks into chunks of ``ceil(n / m)``, the last ones shorter or
    empty); the sum is then the noise memory of the rank holding the most (rank 0), computed from the global
    shapes alone, so every rank counts the same number without communicating.

    ==========================================  ==============================================
    parameter                                   counted
    ==========================================  ==============================================
    a plain tensor                              ``numel * element_size``
    a DTensor, ``Shard(d)`` on a mesh dim of    dimension ``d`` as ``ceil(n / m)`` (0 if
    size ``m``                                  ``n = 0``), per sharded mesh dimension
    a DTensor, ``Replicate()``                  the full size (every rank holds all of it)
    ==========================================  ==============================================
    """
    total = 0
    for param in params:
        placements = getattr(param, "placements", None)
        shape = list(param.shape)
        if placements is not None:
            mesh = param.device_mesh
            for mesh_dim, placement in enumerate(placements):
                if placement.is_shard():
                    shape[placement.dim] = -(-shape[placement.dim] // mesh.size(mesh_dim))
        total += math.prod(shape) * param.element_size()
    return total


def blt_min_separation(shape: LoaderShape) -> int:
    """The most cyclic groups the loader allows: ``min(steps per epoch, len(dataset) // batch_size)``, >= 1."""
    return max(1, min(shape.private_steps_per_epoch, shape.num_examples // shape.batch_size))


def _total_steps(options: PrivacyOptions, shape: LoaderShape) -> int:
    if options.total_steps is not None:
        return int(options.total_steps)
    return int(options.epochs * shape.private_steps_per_epoch)


def plan_blt(options: PrivacyOptions, shape: LoaderShape, *, seed: Callable[[], int | None],
             secure_mode: bool) -> NoiseChoice:  # fmt: skip
    """BLT's strategy, min separation and builder for ``options`` on this loader; ``seed`` is called when the
    mechanism is built. ValueError naming ``num_bands`` if the loader cannot feed that many cyclic groups."""
    min_sep = blt_min_separation(shape) if options.num_bands is None else options.num_bands
    check_num_bands(min_sep, shape)
    num_buffers = DEFAULT_NUM_BUFFERS if options.num_buffers is None else options.num_buffers
    steps = _total_steps(options, shape)
    strategy = blt_strategy(steps, num_buffers, min_sep)
    # Built once here to validate and to state the event; the real one is built (seeded) when nothing can fail.
    event = BLTNoise(strategy, min_sep=min_sep, total_steps=steps, seed=0).privacy_event()
    return NoiseChoice(
        mechanism="blt", num_bands=min_sep, coefficients=None, total_steps=steps, noise_multiplier=options.sigma,
        stated_event=event, num_buffers=num_buffers,
        make_noise=lambda: BLTNoise(strategy, min_sep=min_sep, total_steps=steps, seed=seed(), secure_mode=secure_mode,
                                    noise_stream=options.noise_stream),
    )  # fmt: skip


def plan_auto(options: PrivacyOptions, shape: LoaderShape, *, accountant: Accountant, parameter_bytes: int,
              seed: Callable[[], int | None], secure_mode: bool) -> NoiseChoice:  # fmt: skip
    """The candidate with the smallest expected error among those within ``options.max_noise_memory``
    (``parameter_bytes``: one noise vector over the trainable parameters, in bytes, as one process holds it:
    ``noise_vector_bytes``, the largest rank's shard under FSDP2), built as if named.

    Raises ValueError if no candidate fits the memory budget; the ``CalibrationError`` of an unreachable target
    if no candidate reaches it."""
    steps = _total_steps(options, shape)
    accounted_steps = options.epochs * shape.accounted_steps_per_epoch
    allowed_bands = [
        b
        for b in CANDIDATE_NUM_BANDS
        if b <= shape.private_steps_per_epoch and b * shape.batch_size <= shape.num_examples and b <= steps
    ]
    band_rows = compare_num_bands(allowed_bands, options, shape, total_steps=steps, accounted_steps=accounted_steps,
                                  accountant=accountant)  # fmt: skip
    candidates = [
        MechanismCandidate(mechanism="gaussian" if row.num_bands == 1 else "bandmf", num_bands=row.num_bands,
                           num_buffers=None, noise_multiplier=row.noise_multiplier, expected_error=row.expected_error,
                           noise_memory_bytes=row.num_bands * parameter_bytes)  # draw + b - 1 history rows
        for row in band_rows
    ]  # fmt: skip
    min_sep = blt_min_separation(shape)
    comparison = comparison_accountant(accountant)
    # BLT keeps one clip norm for the whole run: no candidate with adaptive clipping.
    for num_buffers in CANDIDATE_NUM_BUFFERS if options.adaptive_clipping is None else ():
        strategy = blt_strategy(steps, num_buffers, min_sep)
        event = BLTNoise(strategy, min_sep=min_sep, total_steps=steps, seed=0).privacy_event()
        try:
            sigma = calibrate(comparison, options.target, shape.batch_size * min_sep / shape.num_examples,
                              accounted_steps, event=event, group_size=None, max_batch_size=None,
                              tolerance=COMPARISON_TOLERANCE)  # fmt: skip
        except CalibrationError as error:
            if not error.unreachable:
                raise
            sigma = math.inf
        error_value = math.inf if math.isinf(sigma) else blt_loss(strategy, steps, min_sep=min_sep) * sigma**2
        candidates.append(MechanismCandidate(
            mechanism="blt", num_bands=min_sep, num_buffers=num_buffers, noise_multiplier=sigma,
            expected_error=error_value, noise_memory_bytes=(num_buffers + 1) * parameter_bytes))  # fmt: skip
    budget = options.max_noise_memory
    fitting = [c for c in candidates if budget is None or c.noise_memory_bytes <= budget]
    if not fitting:
        smallest = min(c.noise_memory_bytes for c in candidates)
        raise ValueError(f"max_noise_memory={budget} bytes is below every candidate's noise memory (the smallest, "
                         f"DP-SGD's one noise vector over the trainable parameters, takes {smallest} bytes): raise "
                         "max_noise_memory or leave it out")  # fmt: skip
    best = min(fitting, key=lambda c: (c.expected_error, c.noise_memory_bytes))
    table = tuple(dataclasses.replace(c, chosen=c is best, fits_memory=c in fitting) for c in candidates)
    logger.info("noise_mechanism='auto': %s chosen by the expected squared error of the noisy prefix sums over %d "
                "steps, each candidate calibrated to (epsilon, delta) = %s:\n%s", best.label, steps, options.target,
                format_candidates(table))  # fmt: skip
    # The winner planned as if named: without the memory budget, which options accept with "auto" only (it has
    # been applied above).
    if best.mechanism == "blt":
        named = dataclasses.replace(options, noise_mechanism="blt", num_buffers=best.num_buffers, num_bands=min_sep,
                                    max_noise_memory=None)  # fmt: skip
        choice = plan_blt(named, shape, seed=seed, secure_mode=secure_mode)
    elif best.mechanism == "bandmf":
        named = dataclasses.replace(options, noise_mechanism="bandmf", num_bands=best.num_bands, num_buffers=None,
                                    max_noise_memory=None)  # fmt: skip
        choice = plan_bandmf(named, shape, accountant=accountant, seed=seed, secure_mode=secure_mode)
    else:
        choice = NoiseChoice(mechanism="gaussian", num_bands=1, coefficients=None, total_steps=None,
                             noise_multiplier=options.sigma,
                             make_noise=lambda: GaussianNoise(seed=seed(), secure_mode=secure_mode,
                                                              noise_stream=options.noise_stream))  # fmt: skip
    return dataclasses.replace(choice, mechanism_candidates=table)


def format_candidates(candidates: tuple[MechanismCandidate, ...]) -> str:
    """The candidates as a table a person can read (one row each; ``*`` marks the chosen one, ``-`` those over
    the memory budget)."""
    lines = [f"  {'mechanism':<16} {'sigma':>10} {'expected error':>15} {'RMSE':>10} {'noise memory':>14}"]
    for c in candidates:
        mark = "*" if c.chosen else (" " if c.fits_memory else "-")
        rmse = math.sqrt(c.expected_error) if math.isfinite(c.expected_error) else math.inf
        lines.append(f"{mark} {c.label:<16} {c.noise_multiplier:>10.4g} {c.expected_error:>15.5g} {rmse:>10.4g} "
                     f"{_bytes(c.noise_memory_bytes):>14}")  # fmt: skip
    return "\n".join(lines)


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} B"
