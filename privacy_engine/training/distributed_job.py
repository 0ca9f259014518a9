"""One rank's view of a distributed private training job (``DistributedJob``): its process group,
rank, timeouts, and the collectives private training uses (each bounded by the timeout, each failure
raised as ``DistributedStepError`` naming the step instead of hanging).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import numbers
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from privacy_engine.training.distributed_sampling import DistributedDPDataLoader

__all__ = ["DistributedJob", "DistributedSettingsError", "DistributedStepError", "Timeout"]

Timeout = datetime.timedelta | float | None


class DistributedStepError(RuntimeError):
    """A collective of private training failed or timed out: another rank raised, died or stalled."""


class DistributedSettingsError(ValueError):
    """``make_private`` was given different privacy settings on different ranks."""


def _validated_timeout(timeout: Timeout) -> datetime.timedelta | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta, seconds (a number) or None; got {timeout!r}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout must be finite and > 0 seconds; got {timeout!r}")
    return datetime.timedelta(seconds=seconds)


def _require_initialized(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs torch.distributed to be initialised on every rank first: call "
            "torch.distributed.init_process_group(...) (torchrun sets up the environment for it)"
        )


def _group_timeout(group: Any) -> datetime.timedelta | None:
    """The process group's own timeout (what ``init_process_group(timeout=)`` set), if readable."""
    group = group if group is not None else dist.group.WORLD
    timeouts = []
    for device in ("cpu", "cuda"):
        try:
            timeouts.append(group._get_backend(torch.device(device)).options._timeout)
        except Exception:  # noqa: BLE001 - private API, absent or different across versions/backends
            timeouts.append(None)
    return next((t for t in timeouts if isinstance(t, datetime.timedelta)), None)


def _collective_device(group: Any) -> torch.device:
    # NCCL moves CUDA tensors only; every other backend here (gloo, mpi) takes CPU tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_EXACT_INTEGERS = {torch.float32: 2**24, torch.float64: 2**53, torch.int64: 2**63}  # every integer below is exact


def _holds_exactly(dtype: torch.dtype, value: int) -> bool:
    """Whether ``dtype`` holds the integer ``value`` exactly (a step index in a buffer of that dtype)."""
    return 0 <= value < _EXACT_INTEGERS.get(dtype, 0)


def _os_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1



# ---------------------------------------------------------------------------------------------
# The job: process group, rank, timeouts and the collectives private training uses
# ---------------------------------------------------------------------------------------------
@dataclass(eq=False)
class DistributedJob:
    """One rank's view of a distributed private training job (built by ``unwrap``).

    ``rank``/``world_size`` are within ``process_group`` (None: the default group). ``timeout``
    bounds every collective of private training (None: the process group's timeout).
    ``sampling_seed`` seeds the sampling streams reproducibly (derived from ``noise_generator``'s
    state or from ``noise_seed``; None: rank 0 draws one from torch's global generator, or from the
    OS in secure mode); rank 0's is the job's. ``seed_fingerprint`` describes what seeds the noise,
    for the cross-rank check. ``communication_seconds`` sums the time spent in (and waiting at)
    the per-step all-reduce.
    """

    process_group: Any
    rank: int
    world_size: int
    timeout: datetime.timedelta | None
    wrapper: str
    sampling_seed: int | None = None
    seed_fingerprint: tuple = ()
    secure_mode: bool = False
    communication_seconds: float = 0.0
    # The global step index of the batch being released (the engine's private loader's next step; it
    # advances on every rank alike whether or not the rank steps); None: not known (a user's own loader).
    loader_step: Callable[[], int] | None = None

    @property
    def effective_timeout(self) -> datetime.timedelta | None:
        """The bound on each collective: ``timeout``, else the process group's own timeout if it can be read,
        else None."""
        return self.timeout if self.timeout is not None else _group_timeout(self.process_group)

    def _source(self) -> int:
        """Global rank of this group's rank 0 (collectives take global ranks)."""
        if self.process_group is None:
            return 0
        return dist.get_global_rank(self.process_group, 0)

    def wait(self, work: Any, what: str) -> None:
        """Wait for an async collective at most ``effective_timeout``; any failure becomes a
        ``DistributedStepError`` naming this rank and what was being done."""
        timeout = self.effective_timeout
        try:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        except Exception as error:
            limit = f" (timeout {timeout.total_seconds():g} s)" if timeout is not None else ""
            raise DistributedStepError(
                f"rank {self.rank} of {self.world_size}: {what} did not complete{limit}: another rank raised, "
                f"died or stalled (see its log). The process group is unusable now; stop this rank. "
                f"Backend said: {error}"
            ) from error

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor], what: str, *, step: int | None = None) -> None:
        """Sum ``tensors`` over the ranks, in place: one flat all-reduce per (device, dtype).

        ``step``: this rank's global step index. Guarantee: the ranks' indices travel in the same
        all-reduce (``world_size`` extra entries of the first bucket, rank r writing its index at entry r;
        a separate tiny int64 all-reduce only when the bucket's dtype cannot hold the index exactly), and
        if they differ every rank raises ``DistributedStepError`` naming its step and the others' before
        any tensor is changed: one rank's step is never summed with another's.
        """
        if self.world_size == 1:
            return  # a job of one rank: the sum is already complete
        start = time.perf_counter()
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for tensor in tensors:
            buckets.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        reduced = []
        for number, bucket in enumerate(buckets.values()):
            parts = [t.reshape(-1) for t in bucket]
            carries_step = step is not None and number == 0 and _holds_exactly(bucket[0].dtype, step)
            if carries_step:
                parts.append(self._step_slots(step, bucket[0].dtype, bucket[0].device))
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
            self.wait(work, what)
            if carries_step:
                self._check_steps(flat[-self.world_size :], step, what)
                step = None
            reduced.append((bucket, flat))
        if step is not None:
            slots = self._step_slots(step, torch.int64, _collective_device(self.process_group))
            self.wait(dist.all_reduce(slots, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True), what)
            self._check_steps(slots, step, what)
        # Only now that every rank is known to be at the same step are the sums written back.
        for bucket, flat in reduced:
            offset = 0
            for tensor in bucket:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        self.communication_seconds += time.perf_counter() - start

    def _step_slots(self, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        slots = torch.zeros(self.world_size, dtype=dtype, device=device)
        slots[self.rank] = step
        return slots

    def _check_steps(self, slots: torch.Tensor, step: int, what: str) -> None:
        steps = [int(v) for v in slots.tolist()]
        if any(other != step for other in steps):
            others = ", ".join(f"rank {r} at step {s}" for r, s in enumerate(steps) if r != self.rank)
            raise DistributedStepError(
                f"rank {self.rank} of {self.world_size}: {what}: this rank is at global step {step}, {others}. "
                "A rank skipped or repeated a step (a NaN-loss guard, a caught exception): every rank must call "
                "optimizer.step() for every batch of the private loader. Nothing was released; stop the job."
            )

    def broadcast_int(self, value: int, what: str) -> int:
        """Rank 0's ``value`` on every rank."""
        tensor = torch.tensor([value if self.rank == 0 else 0], dtype=torch.int64,
                              device=_collective_device(self.process_group))  # fmt: skip
        self.wait(dist.broadcast(tensor, src=self._source(), group=self.process_group, async_op=True), what)
        return int(tensor.item())

    def barrier(self, what: str) -> None:
        """All ranks reach this point; on gloo a monitored barrier names the ranks that did not."""
        timeout = self.effective_timeout
        if dist.get_backend(self.process_group) == "gloo" and timeout is not None:
            try:
                dist.monitored_barrier(group=self.process_group, timeout=timeout, wait_all_ranks=True)
            except Exception as error:
                raise DistributedStepError(
                    f"rank {self.rank} of {self.world_size}: not every rank reached {what} within "
                    f"{timeout.total_seconds():g} s (another rank raised, died or stalled; see its log). "
                    f"Backend said: {error}"
                ) from error
            return
        self.wait(dist.barrier(group=self.process_group, async_op=True), what)

    def all_gather_objects(self, value: Any, what: str) -> list:
        """Every rank's ``value`` (picklable), in rank order. Collective: every rank must call it. Any failure
        raises ``DistributedStepError`` naming this rank and ``what``. A blocking call: ``timeout`` is not
        applied (the process group's own timeout is)."""
        gathered: list = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, value, group=self.process_group)
        except Exception as error:
            raise DistributedStepError(f"rank {self.rank} of {self.world_size}: {what} failed: {error}") from error
        return gathered

    # ------------------------------------------------------------------ engine wiring
    def private_loader(self, data_loader: DataLoader, *, num_groups: int, max_batch_size: int | None,
                       poisson_sampling: bool, steps: int) -> DistributedDPDataLoader:  # fmt: skip
        """This rank's private loader (``make_private`` calls it while planning, on every rank).

        Collective: the sampling seed is rank 0's, broadcast, so every rank has the same cyclic
        groups and truncated draws (and, keyed by rank, independent shard streams). A rank that
        failed earlier in ``make_private`` makes the others raise here, after the timeout.
        """
        if not poisson_sampling:
            raise ValueError(
                "poisson_sampling must be True for distributed training: the ranks sample disjoint shards of the "
                "dataset with the global rate (a plain loader would give every rank the same shuffled batches)"
            )
        if self.sampling_seed is not None:
            proposal = self.sampling_seed
        elif self.secure_mode:
            proposal = _os_seed()
        else:
            # As single-process sampling draws from torch's global generator: torch.manual_seed on
            # rank 0 makes the run reproducible.
            proposal = int(torch.randint(0, 2**62, (1,)).item())
        seed = self.broadcast_int(proposal, "make_private agreeing on the sampling seed")
        shared_seed = None
        if self.secure_mode and max_batch_size is not None:
            shared_seed = self.broadcast_int(_os_seed(), "make_private agreeing on the secure sampling seed")
        loader = DistributedDPDataLoader.from_data_loader(
            data_loader, rank=self.rank, world_size=self.world_size, seed=seed, num_groups=num_groups,
            max_batch_size=max_batch_size, steps=steps, secure=self.secure_mode, shared_seed=shared_seed,
        )  # fmt: skip
        loader.distributed_job = self
        self.loader_step = lambda: loader.batch_sampler._next_step - 1  # the step of the batch last drawn
        return loader

    def agree(self, settings: dict[str, Any]) -> None:
        """Check that every rank has the same ``settings`` (collective: every rank must call it).

        Raises ``DistributedSettingsError`` on every rank, naming each differing setting with its
        value on each rank, or ``DistributedStepError`` when another rank does not arrive in time.
        """
        settings = {key: repr(value) for key, value in settings.items()}
        settings.update(world_size=repr(self.world_size), noise_seed=repr(self.seed_fingerprint))
        self.barrier("make_private's cross-rank settings check")
        digest = hashlib.sha256(repr(sorted(settings.items())).encode()).digest()
        device = _collective_device(self.process_group)
        mine = torch.tensor(list(digest), dtype=torch.uint8, device=device)
        digests = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.wait(dist.all_gather(digests, mine, group=self.process_group, async_op=True),
                  "make_private's cross-rank settings check")  # fmt: skip
        if all(torch.equal(d, digests[0]) for d in digests):
            return
        everyone = self.all_gather_objects(settings, "make_private's cross-rank settings check")
        lines = []
        for key in sorted(set().union(*everyone)):
            values = [s.get(key, "<missing>") for s in everyone]
            if any(v != values[0] for v in values):
                lines.append(f"  {key}: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
        raise DistributedSettingsError(
            "make_private was called with different settings on different ranks; every rank must pass the same "
            "privacy settings (the ranks run one private mechanism together):\n" + "\n".join(lines)
        )
