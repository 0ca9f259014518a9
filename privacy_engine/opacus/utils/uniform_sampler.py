"""``opacus.utils.uniform_sampler``: Poisson batch samplers with Opacus's constructors."""

from __future__ import annotations

import math

import torch

from privacy_engine.settings_checks import check_sample_rate
from privacy_engine.training.distributed import current_job, sampling_seed
from privacy_engine.training.distributed_sampling import DistributedPoissonBatchSampler
from privacy_engine.training.sampling import PoissonBatchSampler

__all__ = ["DistributedUniformWithReplacementSampler", "UniformWithReplacementSampler", "opacus_steps_per_epoch"]


def opacus_steps_per_epoch(sample_rate: float) -> int:
    """Opacus's batches per pass at ``sample_rate``: ``int(1 / sample_rate)`` (at least 1), so that
    ``1 / steps >= sample_rate``. The tiny allowance keeps ``1 / (1 / n)`` at ``n`` despite rounding."""
    sample_rate = check_sample_rate(sample_rate)  # the samplers' own check
    return max(1, math.floor(1.0 / sample_rate * (1 + 1e-12)))


class UniformWithReplacementSampler(PoissonBatchSampler):
    """Opacus's name for Poisson sampling (each example independently with ``sample_rate``), the
    engine's ``PoissonBatchSampler`` (its guarantee). ``steps`` defaults to Opacus's ``int(1 / sample_rate)``
    batches per pass, so ``1 / len(sampler) >= sample_rate``: an accountant hook given
    ``1 / len(loader)`` (as Opacus's examples write it) never records less than the rate sampled."""

    def __init__(
        self, *, num_samples: int, sample_rate: float, generator: torch.Generator | None = None, steps: int | None = None
    ) -> None:
        if steps is None:
            steps = opacus_steps_per_epoch(sample_rate)
        super().__init__(num_samples, sample_rate, steps=steps, generator=generator)


class DistributedUniformWithReplacementSampler(DistributedPoissonBatchSampler):
    """Opacus's distributed Poisson sampler (its keyword arguments): this rank's part of one global
    Poisson sample, see ``DistributedPoissonBatchSampler`` (rank and world size from the default
    process group); ``steps`` defaults to Opacus's ``int(1 / sample_rate)`` batches per pass, as for
    ``UniformWithReplacementSampler``. ``shuffle``/``shuffle_seed`` are accepted and unused: the shards here are
    strided, and which rank holds an example does not change its inclusion probability."""

    def __init__(self, *, total_size: int, sample_rate: float, shuffle: bool = True, shuffle_seed: int = 0,
                 steps: int | None = None, generator: torch.Generator | None = None) -> None:  # fmt: skip
        job = current_job(None, None, "DistributedUniformWithReplacementSampler")
        if steps is None:  # Opacus's count, so that an accountant given 1 / len(loader) records >= the rate
            steps = opacus_steps_per_epoch(sample_rate)
        super().__init__(total_size, sample_rate, rank=job.rank, world_size=job.world_size,
                         seed=sampling_seed(generator), steps=steps)  # fmt: skip
