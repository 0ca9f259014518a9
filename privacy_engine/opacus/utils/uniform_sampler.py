"""``opacus.utils.uniform_sampler``: Poisson batch samplers with Opacus's constructors."""

from __future__ import annotations

import math

import torch

from privacy_engine.opacus._lazy import lazy_attribute
from privacy_engine.training.sampling import PoissonBatchSampler

__all__ = ["DistributedUniformWithReplacementSampler", "UniformWithReplacementSampler", "opacus_steps_per_epoch"]  # noqa: F822  (served by __getattr__ below)


def opacus_steps_per_epoch(sample_rate: float) -> int:
    """Opacus's batches per pass at ``sample_rate``: ``int(1 / sample_rate)`` (at least 1), so that
    ``1 / steps >= sample_rate``. The tiny allowance keeps ``1 / (1 / n)`` at ``n`` despite rounding."""
    if not 0.0 < float(sample_rate) <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1]; got {sample_rate!r}")
    return max(1, math.floor(1.0 / float(sample_rate) * (1 + 1e-12)))


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


def __getattr__(name: str):
    if name == "DistributedUniformWithReplacementSampler":
        return lazy_attribute(name, "privacy_engine.training.distributed", (name, "DistributedPoissonBatchSampler"),
                              "distributed Poisson sampling")  # fmt: skip
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
