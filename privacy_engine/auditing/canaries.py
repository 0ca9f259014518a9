"""Gradient canaries for one-run auditing of a ``DPOptimizer``.

Each of ``num_canaries`` canaries is a fixed direction ``u_j`` in parameter space (a random unit vector, or
a coordinate axis for ``directions="dirac"``), included in the run with probability 1/2. At every released
step, each included canary takes part as an example would: with the optimizer's sample rate (Poisson), in
each of the release's loader draws, and, with cyclic groups (BandMF), only at the steps of its own group
(each canary is assigned one of the ``num_groups`` groups uniformly, as the cyclic sampler assigns every
example). Taking part adds the clipped gradient ``C u_j`` (``C`` the clipper's sensitivity) to the clipped
sum. After training, canary ``j``'s score is ``sum_t <released_t, u_j>`` over the released (noised)
gradients: a post-processing of what the optimizer releases, computed without knowing which canaries were
included. That is what one-run auditing needs (``CanaryScoreAuditor.epsilon_one_run``).

A canary is then exactly one more example for the accountant: sampled at the recorded rate (in its group's
steps), a contribution of norm ``C``, added or removed. So the lower bound it gives must stay below the
accountant's epsilon; above it means a bug.

Two ways in:

* the engine (``make_private(audit=AuditConfig(...))``): the ``DPOptimizer`` is given these canaries as its
  declared ``canaries`` component (``training.canary_slot.ClippedSumCanaries``) and calls
  ``add_to_clipped_sums`` before the noise; the engine scores each release through a step hook. Their
  state (inclusion, groups, directions' seed, scores, step) is saved with the optimizer's DP state.
* by hand, on a ``DPOptimizer`` built without them: ``attach`` adds the canary to the *released* gradient
  after the noise (scaled as the optimizer scales the sum), which has the same distribution for noise that is
  added and does not depend on the data (Gaussian, BandMF); Poisson sampling without cyclic groups only.

Randomness: the draws of step ``t`` come from ``numpy.random.default_rng([seed, t])`` (``t`` = releases
scored so far), so a release that failed draws again the same, and a resumed run continues exactly from
``state_dict()``. ``secure_mode``: inclusion, groups and every step's draws come from the OS
(``noise.secure_random``); only the directions come from ``seed`` (drawn from the OS when None): they are
public by design (the scores are computed from them), and say nothing about the training data.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from privacy_engine.auditing.auditor import CanaryScoreAuditor
from privacy_engine.noise.secure_random import secure_randint, secure_uniform
from privacy_engine.settings_checks import check_sample_rate
from privacy_engine.training.canary_slot import CanarySlot

__all__ = ["GradientCanaries"]

_STATE_KEYS = ("kind", "num_canaries", "dim", "directions", "num_groups", "seed", "included", "groups", "scores",
               "steps_scored")  # fmt: skip
_GROUP_STREAM = 0x67726F757073  # entropy word of the group assignment's stream ("groups"), not a step index


class GradientCanaries:
    """``num_canaries`` gradient canaries in a ``dim``-dimensional parameter space, drawn from ``seed``.

    Guarantee: the inclusion of each canary is an independent fair coin (``included``); a canary's
    gradient has L2 norm exactly ``clip_norm`` (the optimizer's sensitivity) at every draw it takes part
    in, and it takes part in each of a release's draws with probability ``sample_rate`` independently of
    everything else, in the steps of its cyclic group only; its contribution depends on its own state and
    the release's public slot, never on the data; scores depend on the released updates and the (public,
    seeded) directions only.

    ==================================  ================================================
    case                                result
    ==================================  ================================================
    num_canaries < 1, dim < 1           ValueError naming the argument
    num_groups < 1                      ValueError naming num_groups
    dirac directions, dim < canaries    ValueError naming ``dim`` (one coordinate each)
    update of the wrong size            ValueError naming ``released_update``
    sample_rate not in (0, 1]           ValueError naming ``sample_rate``
    optimizer without ``dim`` entries   ValueError at ``attach`` naming ``dim``
    no step released                    every score is 0 (the audit finds nothing)
    adds_contributions=False            nothing added (a DDP rank other than 0), scored
    ==================================  ================================================

    Memory: ``num_canaries * dim`` floats for random directions (``dirac``: ``num_canaries`` indices).
    Random directions of different canaries are nearly orthogonal only when ``dim >> num_canaries``; their
    overlap adds noise to the scores (the bound stays valid, it gets weaker). Dirac canaries do not overlap.
    """

    def __init__(
        self, num_canaries: int, dim: int, seed: int | None, *, directions: str = "random", num_groups: int = 1,
        secure_mode: bool = False, adds_contributions: bool = True,
    ) -> None:  # fmt: skip
        if num_canaries < 1:
            raise ValueError(f"num_canaries must be >= 1, got {num_canaries}")
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if directions not in ("random", "dirac"):
            raise ValueError(f'directions must be "random" or "dirac", got {directions!r}')
        if directions == "dirac" and dim < num_canaries:
            raise ValueError(f"directions='dirac' needs dim >= num_canaries, got dim={dim} < {num_canaries}")
        self.num_canaries, self.dim, self.directions = int(num_canaries), int(dim), directions
        self.num_groups, self.secure_mode = int(num_groups), bool(secure_mode)
        #: Whether this copy adds its contributions (False on DDP ranks other than 0: added once per release).
        self.adds_contributions = bool(adds_contributions)
        #: The directions' seed (public: the directions are needed to score).
        self.seed = int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else int(seed)
        included = self._set_directions()
        if self.secure_mode:
            included = secure_uniform(self.num_canaries) < 0.5
        #: Which canaries are in the run (a fair coin each); secret until the audit.
        self.included = included
        #: Each canary's cyclic group (uniform and independent, as the cyclic sampler assigns examples).
        self.groups = self._assign_groups()
        #: ``sum_t <released_t, u_j>`` so far, one per canary (float64).
        self.scores = torch.zeros(self.num_canaries, dtype=torch.float64)
        self.steps_scored = 0

    def _set_directions(self) -> torch.Tensor:
        """Draw the directions from ``seed`` (and return the seeded inclusion coins, drawn first)."""
        generator = torch.Generator().manual_seed(self.seed)
        included = torch.rand(self.num_canaries, generator=generator, dtype=torch.float32) < 0.5
        if self.directions == "dirac":
            self._coordinates = torch.randperm(self.dim, generator=generator)[: self.num_canaries]
            self._directions = None
        else:
            self._coordinates = None
            # float32 whatever torch's default dtype (the weights below are float32)
            vectors = torch.randn(self.num_canaries, self.dim, generator=generator, dtype=torch.float32)
            self._directions = vectors / vectors.norm(dim=1, keepdim=True)
        return included

    def _assign_groups(self) -> torch.Tensor:
        if self.num_groups == 1:
            return torch.zeros(self.num_canaries, dtype=torch.int64)
        if self.secure_mode:
            return secure_randint(self.num_groups, self.num_canaries)
        rng = np.random.default_rng([self.seed, _GROUP_STREAM])
        return torch.from_numpy(rng.integers(0, self.num_groups, self.num_canaries)).to(torch.int64)

    # ------------------------------------------------------------------ the two halves, over flat tensors
    def participations(self, sample_rate: float, *, num_draws: int = 1, group: int = 0) -> torch.Tensor:
        """How many of this release's ``num_draws`` draws each canary takes part in (int64, ``(num_canaries,)``):
        ``Binomial(num_draws, sample_rate)`` for the included canaries of cyclic group ``group``, 0 for the
        others. Drawn for every canary, included or not (the number of draws does not depend on the secret);
        the same values until the release is scored (``score``)."""
        sample_rate = check_sample_rate(sample_rate)
        draws = (int(num_draws), self.num_canaries)
        if self.secure_mode:
            uniforms = secure_uniform(draws[0] * draws[1]).reshape(draws)
        else:
            uniforms = torch.from_numpy(np.random.default_rng([self.seed, self.steps_scored]).random(draws))
        counts = (uniforms < sample_rate).sum(0)
        return counts * (self.included & (self.groups == int(group) % self.num_groups))

    def canary_gradient(self, sample_rate: float, clip_norm: float, *, num_draws: int = 1,
                        group: int = 0) -> torch.Tensor:  # fmt: skip
        """The canaries' clipped gradients of one release, summed (shape ``(dim,)``, float32): each included
        canary of ``group`` adds ``clip_norm * u_j`` once per draw it takes part in (``participations``)."""
        if not (clip_norm >= 0 and math.isfinite(clip_norm)):
            raise ValueError(f"clip_norm must be finite and >= 0, got {clip_norm}")
        weights = self.participations(sample_rate, num_draws=num_draws, group=group).to(torch.float32)
        weights = weights * float(clip_norm)
        if self._directions is None:
            gradient = torch.zeros(self.dim, dtype=torch.float32)
            gradient[self._coordinates] = weights
            return gradient
        return weights @ self._directions

    def score(self, released_update: torch.Tensor) -> None:
        """Add ``<released_update, u_j>`` to every canary's score (``released_update``: the flat released
        gradient of one step, ``dim`` entries), and move on to the next release's draws."""
        update = released_update.detach().reshape(-1).to("cpu", torch.float64)
        if update.numel() != self.dim:
            raise ValueError(f"released_update must have dim={self.dim} entries, got {update.numel()}")
        if self._directions is None:
            self.scores += update[self._coordinates]
        else:
            # float32 products (the directions are stored so), summed over steps in float64
            self.scores += (self._directions @ update.to(torch.float32)).to(torch.float64)
        self.steps_scored += 1

    # ------------------------------------------------------------------ the engine's component
    def add_to_clipped_sums(self, clipped_sums: Sequence[torch.Tensor], slot: CanarySlot) -> None:
        """``training.canary_slot.ClippedSumCanaries``: add this release's canary gradients to ``clipped_sums``
        (one tensor per private parameter, in the optimizer's order, ``dim`` entries in all) in place, before
        the noise. Reads nothing from them. ``ValueError`` if ``slot.num_groups`` is not ``num_groups``."""
        if slot.num_groups != self.num_groups:
            raise ValueError(f"the release has {slot.num_groups} cyclic groups, these canaries {self.num_groups}")
        if not self.adds_contributions:
            return
        gradient = self.canary_gradient(slot.sample_rate, slot.sensitivity, num_draws=slot.num_draws,
                                        group=slot.group)  # fmt: skip
        offset = 0
        for clipped_sum in clipped_sums:
            piece = gradient[offset : offset + clipped_sum.numel()]
            offset += clipped_sum.numel()
            clipped_sum.add_(piece.view_as(clipped_sum).to(clipped_sum.device, clipped_sum.dtype))
        if offset != self.dim:
            raise ValueError(f"dim={self.dim}, but the clipped sums have {offset} entries")

    def score_release(self, optimizer: Any) -> None:
        """A ``DPOptimizer`` step hook: score the release just written into the private parameters' ``.grad``
        (a frozen parameter's entries count as 0)."""
        flat = [
            torch.zeros(p.numel(), dtype=torch.float64) if p.grad is None else p.grad.detach().reshape(-1).to("cpu")
            for p in optimizer.clipper.params
        ]
        self.score(torch.cat([piece.to(torch.float64) for piece in flat]))

    def state_dict(self) -> dict[str, Any]:
        """Plain data (``torch.load(weights_only=True)``): sizes, the directions' seed, inclusion, groups, scores
        and the number of releases scored. As secret as the run (it says which canaries were included)."""
        return {
            "kind": "gradient", "num_canaries": self.num_canaries, "dim": self.dim, "directions": self.directions,
            "num_groups": self.num_groups, "seed": self.seed, "included": self.included.clone(),
            "groups": self.groups.clone(), "scores": self.scores.clone(), "steps_scored": self.steps_scored,
        }  # fmt: skip

    def check_state_dict(self, state: Any) -> None:
        """``ValueError`` naming the first mismatch unless ``load_state_dict(state)`` restores it; changes nothing."""
        if not isinstance(state, dict) or not set(_STATE_KEYS) <= set(state):
            raise ValueError(f"the canaries' state lacks some of {list(_STATE_KEYS)} (it was altered)")
        for key in ("kind", "num_canaries", "dim", "directions", "num_groups"):
            here = "gradient" if key == "kind" else getattr(self, key)
            if state[key] != here:
                raise ValueError(
                    f"the canaries' state has {key}={state[key]!r}, this audit {here!r}: use the saved audit="
                )
        for key, dtype in (("included", torch.bool), ("groups", torch.int64), ("scores", torch.float64)):
            value = state[key]
            if (
                not isinstance(value, torch.Tensor)
                or value.dtype != dtype
                or tuple(value.shape) != (self.num_canaries,)
            ):
                raise ValueError(f"the canaries' state's {key} is not a {dtype} tensor of {self.num_canaries} entries")
        seed, steps = state["seed"], state["steps_scored"]
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"the canaries' state has seed={seed!r}; expected an int >= 0")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"the canaries' state has steps_scored={steps!r}; expected an int >= 0")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (checked first): the run's canaries, directions, scores and draws continue."""
        self.check_state_dict(state)
        if int(state["seed"]) != self.seed:
            self.seed = int(state["seed"])
            self._set_directions()
        self.included = state["included"].clone().cpu()
        self.groups = state["groups"].clone().cpu()
        self.scores = state["scores"].clone().cpu()
        self.steps_scored = int(state["steps_scored"])

    # ------------------------------------------------------------------ by hand: a DPOptimizer's step hook
    def attach(self, optimizer: Any) -> None:
        """Insert the canaries into every step ``optimizer`` (a ``DPOptimizer`` built without ``canaries``)
        releases, and score its releases, through ``optimizer.attach_step_hook`` (after the noise; the engine
        adds them before it: ``make_private(audit=...)``). Uses its ``sample_rate`` (the rate the accountant
        records), ``clipper.sensitivity``, ``loss_reduction`` and ``expected_batch_size``.

        ``ValueError`` if the optimizer's private parameters do not have ``dim`` entries, if it has no
        ``sample_rate``, if it releases fixed-size shuffled batches (``shuffled_batches``: a release may
        then be divided by more than the expected batch size, which would make a canary count more than
        one example), or if these canaries have cyclic groups (the hook cannot see the release's group).
        Assumes one loader batch per release (the usual loop; ``VirtualSteps`` splitting one
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
        if self.num_groups != 1:
            raise ValueError("GradientCanaries.attach takes num_groups=1; use make_private(audit=...) with BandMF")

        def on_release(opt: Any) -> None:
            # The hook runs after the noise: released = (clipped sum + noise) / divisor. Adding
            # canary / divisor now gives the same distribution as adding the canary to the clipped sum before
            # the noise, for any noise that is added and independent of the data (Gaussian, BandMF).
            divisor = opt.expected_batch_size if opt.loss_reduction == "mean" else 1.0
            gradient = self.canary_gradient(sample_rate, opt.clipper.sensitivity) / divisor
            offset = 0
            for param in params:
                piece = gradient[offset : offset + param.numel()]
                offset += param.numel()
                if param.grad is not None:  # frozen: nothing is released for it (the canary is weaker, not stronger)
                    param.grad.add_(piece.view_as(param.grad).to(param.grad.device, param.grad.dtype))
            self.score_release(opt)

        optimizer.attach_step_hook(on_release)

    # ------------------------------------------------------------------ the audit
    def auditor(self) -> CanaryScoreAuditor:
        """A ``CanaryScoreAuditor`` over the scores of the included (held-in) and excluded canaries;
        ValueError if either set is empty (use more canaries)."""
        scores = self.scores.numpy()
        included = self.included.numpy()
        return CanaryScoreAuditor(scores[included], scores[~included])
