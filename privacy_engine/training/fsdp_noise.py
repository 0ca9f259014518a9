"""Correlated noise (BandMF, BLT, or any ``NoiseMechanism``) on the shards of an FSDP2 model: ``ShardMechanismNoise``.

A correlated mechanism keeps rows of past noise the size of the vector it noises (BandMF ``b - 1`` rows,
BLT ``d`` buffers). Under FSDP2 every rank owns a disjoint shard of each parameter, so each rank runs its
own copy of the mechanism on its local shards only: its history holds the rows of its shard, and the
memory per rank falls with the number of ranks. Used in place of ``ShardNoise`` with ``FSDPPrivateStep``::

    noise = ShardMechanismNoise(BandMFNoise(coefficients), noise_multiplier=sigma, max_grad_norm=C, seed=run_seed)
    step = FSDPPrivateStep(optimizer, noise, loader_with_num_groups_b, accountant=accountant)

Why it is the single-process mechanism. BandMF and BLT form each step's noise coordinate by coordinate
from the fresh draws of that coordinate (``x_t = C^{-1} z`` is applied along the steps, never across
coordinates), so running the mechanism on every shard separately, with the same strategy and the same
scale, gives exactly the noise of one mechanism on the full vector whose fresh draws ``Z`` are the union
of the shards' draws. The shards' draws come from independent streams (``derived_seed(seed, key, rank)``;
secure mode: the OS on each rank), so ``Z`` has iid entries as in one process; the privacy event is the
mechanism's own (``privacy_event()``), recorded by ``FSDPPrivateStep``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from accountants.events import EventSpec
from privacy_engine.noise.mechanism import NoiseMechanism
from privacy_engine.settings_checks import check_max_grad_norm, check_noise_multiplier
from privacy_engine.training.distributed_sampling import derived_seed
from privacy_engine.training.fsdp import _local

__all__ = ["ShardMechanismNoise"]

# Spawn key of the per-rank streams of a sharded mechanism (apart from sampling's 7001 and ShardNoise's 7002).
_SHARD_MECHANISM_KEY = 7003
# What a mechanism's state_dict holds that differs between ranks by design (their own streams and shards):
# left out of the settings the ranks compare.
_PER_RANK_STATE = ("seed", "devices", "signature")


class ShardMechanismNoise:
    """Runs ``mechanism`` (``BandMFNoise``, ``BLTNoise``, ``GaussianNoise``, ...) on this rank's shard of
    every gradient, with a stream of its own.

    Guarantee: when every rank calls ``add_(params)`` once per step on the same parameters (FSDP2 shards,
    disjoint and covering each parameter), the gathered full gradient vector receives at step ``t`` row
    ``t`` of the mechanism's noise ``C^{-1} Z`` (the mechanism's strategy, at std ``mechanism.noise_std(
    noise_multiplier, max_grad_norm)`` for ``Z``), where ``Z``'s columns of the coordinates of rank ``r``'s
    shard are drawn from rank ``r``'s own stream: each coordinate is noised exactly once per step, the
    entries of ``Z`` are independent across coordinates, ranks and steps, so the release is that of the
    single-process mechanism on the full vector and its event is ``mechanism.privacy_event()``.
    The history (``b - 1`` rows for BandMF, ``d`` for BLT) covers the local shard only: memory per rank is
    the shard's size times the rows.

    Seeds: ``seed`` is the run seed, the same on every rank; rank ``r``'s mechanism is reseeded with
    ``derived_seed(seed, 7003, r)`` (independent streams). ``seed=None`` outside secure mode: one draw
    from torch's global generator, then the same derivation (distinct per rank even when every rank set
    the same ``torch.manual_seed``). Secure mode (the mechanism's): OS randomness on every rank.

    The strategy (the mechanism's type and everything its ``state_dict`` saves besides seed and layout:
    coefficients, buffers' decays and scales, ``min_sep``, ``total_steps``, ...) is part of ``settings()``,
    which ``FSDPPrivateStep`` compares across ranks before any release.

    ===========================================  ===============================================
    case                                         result
    ===========================================  ===============================================
    mechanism not a ``NoiseMechanism``           TypeError
    mechanism built with a seed (not ``seed``)   ValueError (pass the run seed here instead)
    mechanism built with ``seed`` itself         reseeded per rank from it, as an unseeded one
    mechanism that already took a step           ValueError (build a fresh one)
    secure-mode mechanism and a ``seed``         ValueError (the OS seeds it)
    noise_multiplier < 0 / NaN / inf, bad C      ValueError
    noise_multiplier = 0                         mechanism steps, adds nothing
    a trainable parameter without ``.grad``      ValueError before any noise (the history is laid
                                                 out over every parameter's shard)
    replicated DTensor grad                      NotImplementedError before any noise
    empty local shard (more ranks than rows)     takes part with no entries
    ===========================================  ===============================================
    """

    def __init__(self, mechanism: NoiseMechanism, *, noise_multiplier: float, max_grad_norm: float,
                 seed: int | None = None, rank: int | None = None) -> None:  # fmt: skip
        if not isinstance(mechanism, NoiseMechanism):
            raise TypeError(f"mechanism must be a NoiseMechanism (BandMFNoise, BLTNoise, ...); got "
                            f"{type(mechanism).__name__}")  # fmt: skip
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        state = mechanism.state_dict()
        if mechanism.step != 0 or state["devices"]:
            raise ValueError(f"mechanism has already taken {mechanism.step} step(s): build a fresh mechanism for "
                             "ShardMechanismNoise (its history is laid out over this rank's shards)")  # fmt: skip
        if state["seed"] is not None and (seed is None or int(state["seed"]) != int(seed)):
            # A seed of its own would be every rank's stream; the run seed (the same value) is derived per rank.
            raise ValueError(
                "the mechanism was built with a seed, which every rank would share: build it without one and pass "
                "the run seed to ShardMechanismNoise(seed=...), which derives a distinct stream for each rank"
            )
        self.secure_mode = mechanism.secure_mode
        if self.secure_mode and seed is not None:
            raise ValueError("seed must be None with a secure-mode mechanism (its generators are seeded from the OS)")
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank = int(rank)
        #: What seeds the streams, compared across ranks by ``FSDPPrivateStep``.
        self.seed_fingerprint = (
            ("secure mode",) if self.secure_mode else ("none",) if seed is None else ("seed", int(seed))
        )
        if not self.secure_mode:
            run_seed = int(torch.randint(0, 2**62, (1,)).item()) if seed is None else int(seed)
            mechanism.reseed(derived_seed(run_seed, _SHARD_MECHANISM_KEY, self.rank))
        self.mechanism = mechanism
        self._strategy = {key: value for key, value in state.items() if key not in _PER_RANK_STATE}

    @property
    def std(self) -> float:
        """The std of the mechanism's fresh draws ``Z`` (``mechanism.noise_std``); 0: no noise."""
        return self.mechanism.noise_std(self.noise_multiplier, self.max_grad_norm)

    def privacy_event(self) -> EventSpec:
        """The mechanism's own event: the shards together release exactly its single-process noise."""
        return self.mechanism.privacy_event()

    def settings(self) -> dict[str, Any]:
        """Plain data the ranks must agree on: the mechanism's type and strategy (not its seed or layout)."""
        return self._strategy

    def history_numel(self) -> int:
        """Entries of past noise this rank keeps (rows times the local shards' size; 0 before the first step
        or for a mechanism without history)."""
        return sum(int(device["history"].numel()) for device in self.mechanism.state_dict()["devices"]
                   if device["history"] is not None)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """This rank's noise state for checkpoints: the rank and the mechanism's ``state_dict`` (its shard's
        history, seed and generator states; secure mode: no seed or generator state). Plain data (loads with
        ``weights_only=True``); it holds past noise of this shard: keep it as secret as the data."""
        return {"rank": self.rank, "secure_mode": self.secure_mode, "mechanism": self.mechanism.state_dict()}

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """ValueError naming the mismatch unless ``load_state_dict(state)`` would restore it; changes nothing."""
        if int(state["rank"]) != self.rank:
            raise ValueError(f"the noise state is rank {state['rank']}'s; this is rank {self.rank}: each rank loads "
                             "its own shard's stream and history")  # fmt: skip
        self.mechanism.check_state_dict(state["mechanism"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` saved by the same rank: the next steps add exactly the noise the saved run
        would have added. ValueError, nothing changed, for another rank's state or one the mechanism rejects
        (``NoiseMechanism.load_state_dict``)."""
        self.check_state_dict(state)
        self.mechanism.load_state_dict(state["mechanism"])

    def add_(self, params: Sequence[torch.Tensor]) -> None:
        """Add this step's noise of the mechanism to the local shard of every parameter's ``.grad`` (see the
        class docstring); checks every gradient first, so a refused call changes nothing."""
        locals_ = []
        for index, param in enumerate(params):
            if param.grad is None:
                raise ValueError(
                    f"parameter {index} (shape {tuple(param.shape)}) has no .grad at this step: correlated noise "
                    "is laid out over every trainable parameter's shard; run FSDPGhostClipping.backward first, and "
                    "freeze (requires_grad=False) parameters that never get a gradient"
                )
            placements = getattr(param.grad, "placements", ())
            if any(not placement.is_shard() for placement in placements):
                raise NotImplementedError(
                    f"a gradient has placements {placements}: only sharded (not replicated) gradients are noised"
                )
            locals_.append(_local(param.grad))
        self.mechanism.add_noise_(locals_, self.noise_multiplier, self.max_grad_norm)
