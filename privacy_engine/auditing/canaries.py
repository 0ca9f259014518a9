"""Gradient canaries for one-run auditing of a ``DPOptimizer``, added through its public hooks.

Each of ``num_canaries`` canaries is a fixed direction ``u_j`` in parameter space (a random unit vector, or
a coordinate axis for ``directions="dirac"``), included in the run with probability 1/2. At every released
step, each included canary takes part with the optimizer's sample rate, as an example would under Poisson
sampling, and adds the clipped gradient ``C u_j`` (``C`` the clipper's sensitivity) to the clipped sum
before the noise. After training, canary ``j``'s score is ``sum_t <released_t, u_j>`` over the released
(noised) gradients: a post-processing of what the optimizer releases, computed without knowing which
canaries were included. That is what one-run auditing needs (``CanaryScoreAuditor.epsilon_one_run``).

A canary is then exactly one more example for the accountant: Poisson-sampled at the recorded rate, a
contribution of norm ``C``, added or removed. So the lower bound it gives must stay below the
accountant's epsilon; above it means a bug.

Hook used (no engine code changed): ``DPOptimizer.attach_step_hook``, which runs after the noise is added.
The optimizer has no public hook on the clipped sum before the noise, so the canary is added to the released
gradient there (scaled as the optimizer scales the sum); with noise that is added and does not depend on the
data (Gaussian, BandMF) the update has the same distribution as with the canary in the clipped sum. The
engine integration should add it before the noise instead (a hook called once per release with the clipped
sums). Without an optimizer, ``canary_gradient`` and ``score`` are the two halves over flat tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from privacy_engine.auditing.auditor import CanaryScoreAuditor
from privacy_engine.settings_checks import check_sample_rate


class GradientCanaries:
    """``num_canaries`` gradient canaries in a ``dim``-dimensional parameter space, drawn from ``seed``.

    Guarantee: the inclusion of each canary is an independent fair coin (``included``); a canary's
    gradient has L2 norm exactly ``clip_norm`` (the optimizer's sensitivity) at every step it takes part
    in, and it takes part in a step with probability ``sample_rate`` independently of everything else;
    scores depend on the released updates and the (public, seeded) directions only.

    ==================================  ================================================
    case                                result
    ==================================  ================================================
    num_canaries < 1, dim < 1           ValueError naming the argument
    dirac directions, dim < canaries    ValueError naming ``dim`` (one coordinate each)
    update of the wrong size            ValueError naming ``released_update``
    sample_rate not in (0, 1]           ValueError naming ``sample_rate``
    optimizer without ``dim`` entries   ValueError at ``attach`` naming ``dim``
    no step released                    every score is 0 (the audit finds nothing)
    ==================================  ================================================

    Memory: ``num_canaries * dim`` floats for random directions (``dirac``: ``num_canaries`` indices).
    Random directions of different canaries are nearly orthogonal only when ``dim >> num_canaries``; their
    overlap adds noise to the scores (the bound stays valid, it gets weaker). Dirac canaries do not overlap.
    """

    def __init__(self, num_canaries: int, dim: int, seed: int, *, directions: str = "random") -> None:
        if num_canaries < 1:
            raise ValueError(f"num_canaries must be >= 1, got {num_canaries}")
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if directions not in ("random", "dirac"):
            raise ValueError(f'directions must be "random" or "dirac", got {directions!r}')
        if directions == "dirac" and dim < num_canaries:
            raise ValueError(f"directions='dirac' needs dim >= num_canaries, got dim={dim} < {num_canaries}")
        self.num_canaries, self.dim, self.directions = int(num_canaries), int(dim), directions
        self._generator = torch.Generator().manual_seed(int(seed))
        #: Which canaries are in the run (a fair coin each); secret until the audit.
        self.included = torch.rand(self.num_canaries, generator=self._generator) < 0.5
        if directions == "dirac":
            self._coordinates = torch.randperm(self.dim, generator=self._generator)[: self.num_canaries]
            self._directions = None
        else:
            vectors = torch.randn(self.num_canaries, self.dim, generator=self._generator)
            self._directions = vectors / vectors.norm(dim=1, keepdim=True)
        #: ``sum_t <released_t, u_j>`` so far, one per canary (float64).
        self.scores = torch.zeros(self.num_canaries, dtype=torch.float64)
        self.steps_scored = 0

    # ------------------------------------------------------------------ the two halves, over flat tensors
    def canary_gradient(self, sample_rate: float, clip_norm: float) -> torch.Tensor:
        """The canaries' clipped gradients of one step, summed (shape ``(dim,)``, float32): each included
        canary takes part with probability ``sample_rate`` and adds ``clip_norm * u_j``."""
        sample_rate = check_sample_rate(sample_rate)
        if not (clip_norm >= 0 and math.isfinite(clip_norm)):
            raise ValueError(f"clip_norm must be finite and >= 0, got {clip_norm}")
        # Drawn for every canary, included or not: the number of draws does not depend on the secret.
        takes_part = torch.rand(self.num_canaries, generator=self._generator) < sample_rate
        weights = (takes_part & self.included).to(torch.float32) * float(clip_norm)
        if self._directions is None:
            gradient = torch.zeros(self.dim)
            gradient[self._coordinates] = weights
            return gradient
        return weights @ self._directions

    def score(self, released_update: torch.Tensor) -> None:
        """Add ``<released_update, u_j>`` to every canary's score (``released_update``: the flat released
        gradient of one step, ``dim`` entries)."""
        update = released_update.detach().reshape(-1).to("cpu", torch.float64)
        if update.numel() != self.dim:
            raise ValueError(f"released_update must have dim={self.dim} entries, got {update.numel()}")
        if self._directions is None:
            self.scores += update[self._coordinates]
        else:
            # float32 products (the directions are stored so), summed over steps in float64
            self.scores += (self._directions @ update.to(torch.float32)).to(torch.float64)
        self.steps_scored += 1

    # ------------------------------------------------------------------ a DPOptimizer's step hook
    def attach(self, optimizer: Any) -> None:
        """Insert the canaries into every step ``optimizer`` (a ``DPOptimizer``) releases, and score its
        releases, through ``optimizer.attach_step_hook``. Uses its ``sample_rate`` (the rate the accountant
        records), ``clipper.sensitivity``, ``loss_reduction`` and ``expected_batch_size``.

        ``ValueError`` if the optimizer's private parameters do not have ``dim`` entries, if it has no
        ``sample_rate``, or if it releases fixed-size shuffled batches (``shuffled_batches``: a release may
        then be divided by more than the expected batch size, which would make a canary count more than
        one example). Assumes one loader batch per release (the usual loop; ``VirtualSteps`` splitting one
        batch is fine): a loop that steps once over several loader batches has its release divided by that
        number too, which the step hook cannot see, and a canary would then count as several examples (a
        lower bound too high, never too low)."""
        params = list(optimizer.clipper.params)
        numel = sum(p.numel() for p in params)
        if numel != self.dim:
            raise ValueError(f"dim={self.dim}, but the optimizer's private parameters have {numel} entries")
        sample_rate = optimizer.sample_rate
        if sample_rate is None:
            raise ValueError("the optimizer has no sample_rate: canaries are sampled at the rate it accounts for")
        if getattr(optimizer, "shuffled_batches", None) is not None:
            raise ValueError("GradientCanaries.attach needs Poisson sampling (poisson_sampling=True)")

        def on_release(opt: Any) -> None:
            # The hook runs after the noise: released = (clipped sum + noise) / divisor. Adding
            # canary / divisor now gives the same distribution as adding the canary to the clipped sum before
            # the noise, for any noise that is added and independent of the data (Gaussian, BandMF).
            divisor = opt.expected_batch_size if opt.loss_reduction == "mean" else 1.0
            gradient = self.canary_gradient(sample_rate, opt.clipper.sensitivity) / divisor
            offset, flat = 0, []
            for param in params:
                piece = gradient[offset : offset + param.numel()]
                offset += param.numel()
                if param.grad is None:  # frozen: nothing is released for it (the canary is weaker, not stronger)
                    flat.append(torch.zeros(param.numel(), dtype=torch.float64))
                    continue
                param.grad.add_(piece.view_as(param.grad).to(param.grad.device, param.grad.dtype))
                flat.append(param.grad.detach().reshape(-1).to("cpu", torch.float64))
            self.score(torch.cat(flat))

        optimizer.attach_step_hook(on_release)

    # ------------------------------------------------------------------ the audit
    def auditor(self) -> CanaryScoreAuditor:
        """A ``CanaryScoreAuditor`` over the scores of the included (held-in) and excluded canaries;
        ValueError if either set is empty (use more canaries)."""
        scores = self.scores.numpy()
        included = self.included.numpy()
        return CanaryScoreAuditor(scores[included], scores[~included])
