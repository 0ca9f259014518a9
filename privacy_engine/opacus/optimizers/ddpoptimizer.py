"""``opacus.optimizers.ddpoptimizer``: ``DistributedDPOptimizer``, Opacus's hand-built distributed
optimizer, on the engine's ``DPOptimizer`` and distributed steps (``privacy_engine.training.distributed``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from privacy_engine.opacus._binding import optimizer_built
from privacy_engine.training.distributed import Timeout, configure, current_job, sampling_seed
from privacy_engine.training.optimizer import DPOptimizer

__all__ = ["DistributedDPOptimizer"]


class DistributedDPOptimizer(DPOptimizer):
    """Opacus's distributed optimizer, for scripts that build it by hand: a ``DPOptimizer`` whose
    steps are global (``RankZeroNoise``: noise on rank 0, one all-reduce of clipped sums + noise).

    ``expected_batch_size`` is each rank's, as in Opacus: the summed gradient is divided by
    ``expected_batch_size * world_size``. Accounting, sampling and the cross-rank settings check
    are ``make_private``'s (prefer it); this class does none of them. The noise is seeded from
    ``generator``'s state (not a draw from it), else by one draw from torch's global generator.
    """

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: float | None, loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, secure_mode: bool = False, process_group: Any = None,
                 timeout: Timeout = None, **kwargs: Any) -> None:  # fmt: skip
        job = current_job(process_group, timeout, "DistributedDPOptimizer")
        if expected_batch_size is not None:
            expected_batch_size = expected_batch_size * job.world_size
        seed = None if secure_mode else sampling_seed(generator)
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction=loss_reduction, noise_seed=seed,
                         secure_mode=secure_mode, **kwargs)  # fmt: skip
        configure(self, job)
        # Opacus scripts never connect their pieces: the namespace connects a hand-built pair (opacus._binding).
        optimizer_built(self)
