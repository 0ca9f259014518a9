"""The noise of a distributed step (``RankZeroNoise``): drawn on rank 0, reduced with the clipped sums."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from accountants.events import EventSpec
from privacy_engine.interrupts import deferred_signals
from privacy_engine.noise import NoiseMechanism
from privacy_engine.training.distributed_job import DistributedJob

__all__ = ["RankZeroNoise"]


class RankZeroNoise(NoiseMechanism):
    """The noise of a distributed step: ``inner``'s noise added on rank 0, then one all-reduce.

    ``add_noise_(sums, sigma, C)`` on every rank: rank 0 adds ``inner``'s noise for this step to
    its local clipped sums; then the sums are all-reduced (SUM) over the ranks, in place; then
    ``on_commit`` runs and the step is committed (on rank 0 inside ``inner``'s transaction, so a
    failed all-reduce leaves ``inner`` exactly as before the call). The all-reduce carries each rank's
    global step index (the engine's private loader's step; without it, the number of releases) and
    fails fast on a mismatch (``DistributedJob.all_reduce_sum_``).

    Guarantee: after the call, every rank holds the same values
    ``sum over all ranks' clipped sums + exactly one draw of inner's noise`` (Gaussian or BandMF,
    secure or not: rank 0's mechanism is the only one that draws). The un-noised global sum is
    never formed on any rank. All noise state (generators, BandMF history) is rank 0's: save the
    optimizer's state from rank 0.

    ==================================  ==================================================
    case                                result
    ==================================  ==================================================
    noise_multiplier = 0                sums reduced, no noise
    bad sigma / C (e.g. inf C)          ValueError on every rank, before communicating
    another rank failed / timed out     DistributedStepError; rank 0's noise state is
                                        rolled back (the optimizer drops the .grad)
    ranks at different global steps     DistributedStepError on every rank naming both
    (one skipped a batch)               steps, before any sum is written back; nothing
                                        recorded, rank 0's noise state rolled back
    state saved on a rank other than 0  loading it on rank 0 raises ValueError
    ==================================  ==================================================
    """

    def __init__(self, inner: NoiseMechanism, job: DistributedJob) -> None:
        # NoiseMechanism.__init__ is not called: every piece of noise state is inner's, and every
        # public method below goes to inner.
        if isinstance(inner, RankZeroNoise):
            raise TypeError("inner is already a RankZeroNoise")
        self.inner = inner
        self.job = job
        self._released = inner.step

    def __getattr__(self, name: str) -> Any:
        # Mechanism attributes (num_bands, coefficients, ...) are inner's. Dunders and our own
        # fields are not forwarded (copy/pickle probe them before __init__ has run).
        if name.startswith("__") or name in ("inner", "job", "_released"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def secure_mode(self) -> bool:  # type: ignore[override]
        """``inner``'s secure mode (only rank 0's mechanism draws)."""
        return self.inner.secure_mode

    @property
    def step(self) -> int:
        """Steps completed on this rank (successful ``add_noise_`` calls; a call that raised is not counted).
        On every rank, not only rank 0, so that the ranks' global step indices can be compared."""
        return self._released

    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        """``inner``'s standard deviation of the fresh Gaussian draws (drawn on rank 0 only)."""
        return self.inner.noise_std(noise_multiplier, max_grad_norm)

    def privacy_event(self) -> EventSpec:
        """``inner``'s: exactly one draw of its noise is in every released sum."""
        return self.inner.privacy_event()

    def restart_layout(self) -> None:
        """``inner.restart_layout()``: the next step lays the noise out over the tensors it is given (step
        count and seeded stream continue)."""
        self.inner.restart_layout()

    def add_noise_(self, tensors: Sequence[torch.Tensor], noise_multiplier: float, max_grad_norm: float, *,
                   on_commit: Any = None) -> None:  # fmt: skip
        """Add this step's noise (rank 0: one draw of ``inner``'s) to ``tensors`` and all-reduce them (SUM)
        over the ranks, in place; then ``on_commit()``, then the step counts. Call on every rank with the
        same arguments. See the class docstring for the guarantee and the cases.

        Raises before anything is communicated, drawn or recorded (on every rank alike): ``ValueError`` for
        an invalid ``noise_multiplier`` / ``max_grad_norm``, an empty ``tensors``, or a tensor that is not
        floating point. A failed or mismatched all-reduce (``DistributedStepError``) rolls rank 0's noise
        state back and does not call ``on_commit``; ``tensors`` must then be discarded."""
        tensors = list(tensors)
        # Validated on every rank alike, so a bad argument raises everywhere before communicating.
        self._validated_noise_scale(noise_multiplier, max_grad_norm)
        if not tensors:
            raise ValueError("tensors is empty: pass the clipped gradient sum of every parameter")
        for index, tensor in enumerate(tensors):
            if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
                raise ValueError(f"tensors[{index}] must be a floating-point tensor")

        def reduce_then_commit() -> None:
            # The loader's step, when the engine's loader feeds the job: a rank that skipped a batch is at a later
            # loader step while its release count is the same, and must not be summed with the others.
            step = self._released if self.job.loader_step is None else self.job.loader_step()
            self.job.all_reduce_sum_(tensors, f"the all-reduce of global step {step} (clipped sums + noise)",
                                     step=step)
            if on_commit is not None:
                on_commit()

        with deferred_signals():  # the release and its count move together (inner's own commit joins this)
            if self.job.rank == 0:
                self.inner.add_noise_(tensors, noise_multiplier, max_grad_norm, on_commit=reduce_then_commit)
            else:
                reduce_then_commit()
            self._released += 1

    def state_dict(self) -> dict[str, Any]:
        """``inner``'s state with this rank's step count and where it was saved (``saved_on_rank``,
        ``world_size``). Only rank 0's is the job's noise state: save from rank 0."""
        state = dict(self.inner.state_dict())
        state["step"] = self._released
        state["distributed"] = {"saved_on_rank": self.job.rank, "world_size": self.job.world_size}
        return state

    def check_state_dict(self, state: Any, tensors: Sequence[torch.Tensor] | None = None) -> None:
        """Check ``state`` before loading, changing nothing: on rank 0, ``ValueError`` if it was saved on another
        rank (whose mechanism never drew), then ``inner``'s own checks. Other ranks accept any state (they
        never draw)."""
        saved = state.get("distributed", {}) if isinstance(state, dict) else {}
        if self.job.rank == 0 and saved.get("saved_on_rank", 0) != 0:
            raise ValueError(
                f"this noise state was saved on rank {saved['saved_on_rank']}, whose noise mechanism never draws: "
                "the job's noise state is rank 0's. Save the optimizer's state dict from rank 0."
            )
        if self.job.rank == 0:
            self.inner.check_state_dict(_without_distributed(state), tensors)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load rank 0's saved state on this rank (after ``check_state_dict``; ``ValueError`` before anything is
        loaded if rank 0 is given another rank's state), including the step count."""
        # Every rank loads rank 0's state; only rank 0 will draw from it.
        self.check_state_dict(state)
        self.inner.load_state_dict(_without_distributed(state))
        self._released = int(state["step"])

    def __repr__(self) -> str:
        return f"RankZeroNoise({self.inner!r}, rank={self.job.rank}, world_size={self.job.world_size})"


def _without_distributed(state: Any) -> Any:
    return {k: v for k, v in state.items() if k != "distributed"} if isinstance(state, dict) else state
