"""``opacus.utils.uniform_sampler``: Poisson batch samplers with Opacus's constructors."""

from __future__ import annotations

import torch

from privacy_engine.opacus._lazy import lazy_attribute
from privacy_engine.training.sampling import PoissonBatchSampler

__all__ = ["DistributedUniformWithReplacementSampler", "UniformWithReplacementSampler"]  # noqa: F822  (served by __getattr__ below)


class UniformWithReplacementSampler(PoissonBatchSampler):
    """Opacus's name for Poisson sampling (each example independently with ``sample_rate``), the
    engine's ``PoissonBatchSampler`` (its guarantee). ``steps`` defaults to ``round(1 / sample_rate)``
    batches per pass (Opacus: ``int(1 / sample_rate)``)."""

    def __init__(
        self, *, num_samples: int, sample_rate: float, generator: torch.Generator | None = None, steps: int | None = None
    ) -> None:
        super().__init__(num_samples, sample_rate, steps=steps, generator=generator)


def __getattr__(name: str):
    if name == "DistributedUniformWithReplacementSampler":
        return lazy_attribute(name, "privacy_engine.training.distributed", (name, "DistributedPoissonBatchSampler"),
                              "distributed Poisson sampling")  # fmt: skip
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
