"""Private data-parallel training on ``torch.distributed``: one global DP step over all ranks.

Wrap the model in torch's ``DistributedDataParallel`` (or Opacus's name for the same thing,
``DifferentiallyPrivateDistributedDataParallel``) and call ``make_private`` on every rank with the
same arguments and the same loader over the *whole* dataset, whose ``batch_size`` is the expected
*global* batch (``q = batch_size / len(dataset)``, as in a single process)::

    model = DistributedDataParallel(model)
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader, ...)

What one global step does (``make_private`` sets it up; nothing else changes in the loop):

1. Sampling. Every example belongs to exactly one rank's shard; each rank Poisson-samples its own
   shard with the global rate ``q`` (independent draws, from a stream of its own), so the union of
   the ranks' batches is one Poisson sample of the dataset. Cyclic Poisson sampling (BandMF) splits
   the dataset into the same ``b`` global groups on every rank (a permutation from a seed agreed at
   ``make_private``) and each group into one part per rank.
2. Each rank clips its own examples into a local clipped sum (hooks, functorch or ghost mode).
3. Rank 0 adds this step's noise (Gaussian or BandMF, secure mode included) to its local sum;
   then one all-reduce (SUM) over the ranks gives every rank the same ``sum of all clipped
   gradients + noise``. The noise is drawn once per global step, on one rank; no rank ever holds
   the un-noised global sum.
4. Every rank divides by the expected *global* batch size and steps: the parameters stay
   bit-identical across ranks (same reduced values, same deterministic update).
5. Every rank's accountant records the same global step (rate ``q``, sigma, bands), so every
   rank's ``get_epsilon`` equals that of one process running the same global mechanism.

Why DDP's own all-reduce is not used: DDP averages the raw ``.grad`` during ``backward``, bucket by
bucket, before the per-example clipping has happened (the materialised modes clip in
``optimizer.step``; ghost mode at the end of backward); reusing its buckets for the clipped sums
is not possible, and letting it run would send the raw gradient (as much traffic as our
all-reduce) for nothing. So the DDP wrapper is unwrapped: its inner module is hooked and called
directly (DDP's reducer never runs, nor its forward-time buffer broadcast: models here have no
BatchNorm statistics to keep in sync), and exactly one all-reduce of the parameter-sized clipped
sums happens per global step.

Failures. Every collective waits at most ``timeout`` (the process group's timeout by default, or
``DifferentiallyPrivateDistributedDataParallel(timeout=...)``); a rank that raised, died or
stalled makes the others raise ``DistributedStepError`` naming the step, instead of hanging.
``make_private`` compares the privacy settings of all ranks (sigma, clipping, seeds, mechanism,
sample rate, ...) and raises ``DistributedSettingsError`` on every rank, naming what differs.

Not supported: FSDP / FSDP2 (``fully_shard``; sharded parameters would need per-example gradients
of the unsharded weights), ``nn.DataParallel`` (replicas in threads), ``poisson_sampling=False``.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import numbers
import os
import pickle
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from privacy_engine.noise import NoiseMechanism
from privacy_engine.sampling import (
    DPDataLoader,
    _bernoulli_members,
    _DPBatchSampler,
    _expected_batch_size,
    _positive_int,
    _sized_dataset_length,
    _validated_indices,
    _validated_sample_rate,
    loader_index_set,
)

__all__ = [
    "DifferentiallyPrivateDistributedDataParallel",
    "DistributedCyclicPoissonBatchSampler",
    "DistributedDPDataLoader",
    "DistributedJob",
    "DistributedPoissonBatchSampler",
    "DistributedSettingsError",
    "DistributedStepError",
    "RankZeroNoise",
    "agree",
    "configure",
    "distributed_state",
    "load_distributed_state",
    "unwrap",
]

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
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - private API, absent or different across versions/backends
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def _collective_device(group: Any) -> torch.device:
    # NCCL moves CUDA tensors only; every other backend here (gloo, mpi) takes CPU tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _derived_seed(seed: int, *key: int) -> int:
    # SeedSequence gives statistically independent streams per key from one seed (neighbouring
    # integers as seeds would not be).
    sequence = np.random.SeedSequence(entropy=int(seed), spawn_key=tuple(int(k) for k in key))
    return int(sequence.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def _os_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


# Spawn key of the sampling seed derived from the user's noise seed (kept apart from the noise's
# own streams, which noise.py derives with (device, generator) keys).
_SAMPLING_KEY = 7001


# ---------------------------------------------------------------------------------------------
# The job: process group, rank, timeouts and the collectives private training uses
# ---------------------------------------------------------------------------------------------
@dataclass(eq=False)
class DistributedJob:
    """One rank's view of a distributed private training job (built by ``unwrap``).

    ``rank``/``world_size`` are within ``process_group`` (None: the default group). ``timeout``
    bounds every collective of private training (None: the process group's timeout).
    ``sampling_seed`` seeds the sampling streams reproducibly (derived from ``noise_generator`` or
    ``noise_seed``; None: OS entropy). ``seed_fingerprint`` describes what seeds the noise, for
    the cross-rank check. ``communication_seconds`` sums the time spent in (and waiting at) the
    per-step all-reduce.
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

    @property
    def effective_timeout(self) -> datetime.timedelta | None:
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
        except Exception as error:  # noqa: BLE001 - backends raise RuntimeError / DistBackendError / ...
            limit = f" (timeout {timeout.total_seconds():g} s)" if timeout is not None else ""
            raise DistributedStepError(
                f"rank {self.rank} of {self.world_size}: {what} did not complete{limit}: another rank raised, "
                f"died or stalled (see its log). The process group is unusable now; stop this rank. "
                f"Backend said: {error}"
            ) from error

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Sum ``tensors`` over the ranks, in place: one flat all-reduce per (device, dtype)."""
        start = time.perf_counter()
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for tensor in tensors:
            buckets.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        for bucket in buckets.values():
            flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
            self.wait(work, what)
            offset = 0
            for tensor in bucket:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        self.communication_seconds += time.perf_counter() - start

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
            except Exception as error:  # noqa: BLE001
                raise DistributedStepError(
                    f"rank {self.rank} of {self.world_size}: not every rank reached {what} within "
                    f"{timeout.total_seconds():g} s (another rank raised, died or stalled; see its log). "
                    f"Backend said: {error}"
                ) from error
            return
        self.wait(dist.barrier(group=self.process_group, async_op=True), what)

    def all_gather_objects(self, value: Any, what: str) -> list:
        gathered: list = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, value, group=self.process_group)
        except Exception as error:  # noqa: BLE001
            raise DistributedStepError(f"rank {self.rank} of {self.world_size}: {what} failed: {error}") from error
        return gathered

    # ------------------------------------------------------------------ engine wiring
    def private_loader(self, data_loader: DataLoader, *, num_groups: int, max_batch_size: int | None,
                       poisson_sampling: bool, steps: int) -> DistributedDPDataLoader:  # fmt: skip
        """This rank's private loader (``make_private`` calls it while planning, on every rank).

        Collective: the sampling seed is rank 0's (``sampling_seed``, or OS entropy), broadcast,
        so every rank has the same cyclic groups and truncated draws and independent shard streams.
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
        loader = DistributedDPDataLoader.from_data_loader(
            data_loader, rank=self.rank, world_size=self.world_size, seed=seed, num_groups=num_groups,
            max_batch_size=max_batch_size, steps=steps,
        )  # fmt: skip
        loader.distributed_job = self
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


def plan_settings(plan: Any, *, accountant: Any, secure_mode: bool) -> dict[str, Any]:
    """What every rank's ``make_private`` plan must agree on (from the engine's internal plan)."""
    noise_plan = plan.noise_plan
    loader = plan.private_loader
    return {
        "noise_multiplier": noise_plan.noise_multiplier,
        "max_grad_norm": plan.max_grad_norm,
        "clipping": plan.clipping,
        "noise_mechanism": noise_plan.mechanism,
        "num_bands": noise_plan.num_bands,
        "bandmf_coefficients": noise_plan.coefficients,
        "total_steps": noise_plan.total_steps,
        "sample_rate": noise_plan.sample_rate,
        "expected_batch_size": noise_plan.expected_batch_size,
        "max_batch_size": noise_plan.max_batch_size,
        "group_size": noise_plan.group_size,
        "dataset_size": getattr(loader.batch_sampler, "num_samples", None),
        "steps_per_epoch": len(loader),
        "loss_reduction": plan.loss_reduction,
        "grad_sample_mode": plan.grad_sample_mode,
        "nan_safe": plan.nan_safe,
        "rescale_to_unit_norm": plan.rescale_to_unit_norm,
        "parameters": [(tuple(p.shape), str(p.dtype)) for p in plan.params],
        "accountant": (accountant.name, sorted(accountant.settings().items())),
        "secure_mode": secure_mode,
    }


# ---------------------------------------------------------------------------------------------
# Model wrappers
# ---------------------------------------------------------------------------------------------
class DifferentiallyPrivateDistributedDataParallel(nn.Module):
    """Opacus's name for a data-parallel model: marks ``module`` for distributed private training.

    At construction every rank receives rank 0's parameters and buffers (as DDP does); calls go
    straight to ``module``. ``make_private`` recognises it exactly like torch's
    ``DistributedDataParallel`` (and unwraps either). ``timeout`` bounds every collective of
    private training (default: the process group's timeout).
    """

    def __init__(self, module: nn.Module, *, process_group: Any = None, timeout: Timeout = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module; got {type(module).__name__}")
        _require_initialized("DifferentiallyPrivateDistributedDataParallel")
        timeout = _validated_timeout(timeout)
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.timeout = timeout
        job = DistributedJob(process_group=process_group, rank=dist.get_rank(process_group),
                             world_size=dist.get_world_size(process_group), timeout=timeout, wrapper="")  # fmt: skip
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                work = dist.broadcast(tensor.data, src=job._source(), group=process_group, async_op=True)
                job.wait(work, "broadcasting rank 0's parameters")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _sharded_wrapper_problem(model: nn.Module) -> str | None:
    for path, module in model.named_modules():
        where = repr(path) if path else "the model"
        kind = type(module).__name__
        try:
            from torch.distributed.fsdp import FSDPModule

            if isinstance(module, FSDPModule):
                return f"{where} is sharded with FSDP2 (fully_shard, class {kind})"
        except ImportError:
            pass
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel

            if isinstance(module, FullyShardedDataParallel):
                return f"{where} is wrapped in FullyShardedDataParallel"
        except ImportError:
            pass
        if isinstance(module, nn.DataParallel):
            return f"{where} is wrapped in nn.DataParallel (replicas in threads)"
    return None


def unwrap(model: nn.Module, *, noise_seed: int | None = None, noise_generator: torch.Generator | None = None,
           secure_mode: bool = False) -> tuple[nn.Module, DistributedJob | None]:  # fmt: skip
    """The module to hook and, for a data-parallel model, this rank's ``DistributedJob``.

    ``make_private`` calls it first. No communication, nothing changed.

    ============================================  ==============================================
    model                                         result
    ============================================  ==============================================
    DistributedDataParallel(m) (any backend)      (m, job in DDP's process group)
    DifferentiallyPrivateDistributedDataParallel  (m, job with its process group and timeout)
    a plain module, no process group / world 1    (model, None): single-process training
    a plain module, world size > 1                (model, None) and a warning: each rank trains
                                                  alone and reports its own epsilon
    FSDP / FSDP2 (fully_shard) / DataParallel     NotImplementedError saying what is supported
    DDP inside the model / DDP of DDP             ValueError: wrap the whole model once
    ============================================  ==============================================
    """
    problem = _sharded_wrapper_problem(model)
    if problem is not None:
        raise NotImplementedError(
            f"{problem}: private training supports data parallelism with torch's DistributedDataParallel (or "
            "DifferentiallyPrivateDistributedDataParallel) only, in hooks, functorch and ghost modes. Sharded "
            "parameters (FSDP) would need per-example gradients of the unsharded weights. Wrap the unsharded model "
            "in DistributedDataParallel instead."
        )
    wrappers = (DistributedDataParallel, DifferentiallyPrivateDistributedDataParallel)
    if not isinstance(model, wrappers):
        nested = next((path for path, m in model.named_modules() if path and isinstance(m, wrappers)), None)
        if nested is not None:
            raise ValueError(
                f"submodule {nested!r} is wrapped in {type(model.get_submodule(nested)).__name__}: wrap the whole "
                "model (the module passed to make_private) in DistributedDataParallel, once"
            )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            warnings.warn(
                f"torch.distributed is initialised with {dist.get_world_size()} ranks but the model is not wrapped in "
                "DistributedDataParallel: every rank trains its own model on its own batches and reports the "
                "epsilon of its own run. For one private model trained by all ranks, pass "
                "DistributedDataParallel(model) to make_private.",
                stacklevel=3,
            )
        return model, None
    inner = model.module
    if isinstance(inner, wrappers):
        raise ValueError(f"{type(model).__name__} wraps another {type(inner).__name__}: wrap the model once")
    if isinstance(model, DistributedDataParallel):
        process_group, timeout = model.process_group, None
    else:
        process_group, timeout = model.process_group, model.timeout
    if noise_generator is not None:
        # Derived from the generator's state, not drawn from it: planning changes nothing of the caller's.
        state_digest = hashlib.sha256(noise_generator.get_state().numpy().tobytes()).digest()
        fingerprint: tuple = ("generator state", state_digest.hex()[:16])
        sampling_seed: int | None = int.from_bytes(state_digest[:8], "little") >> 1
    elif noise_seed is not None:
        fingerprint = ("seed", int(noise_seed))
        sampling_seed = _derived_seed(int(noise_seed), _SAMPLING_KEY)
    else:
        fingerprint = ("none (secure mode)",) if secure_mode else ("none",)
        sampling_seed = None
    job = DistributedJob(
        process_group=process_group, rank=dist.get_rank(process_group), world_size=dist.get_world_size(process_group),
        timeout=timeout, wrapper=type(model).__name__, sampling_seed=sampling_seed, seed_fingerprint=fingerprint,
        secure_mode=secure_mode,
    )  # fmt: skip
    return inner, job


# ---------------------------------------------------------------------------------------------
# Noise: drawn on rank 0, reduced with the clipped sums
# ---------------------------------------------------------------------------------------------
class RankZeroNoise(NoiseMechanism):
    """The noise of a distributed step: ``inner``'s noise added on rank 0, then one all-reduce.

    ``add_noise_(sums, sigma, C)`` on every rank: rank 0 adds ``inner``'s noise for this step to
    its local clipped sums; then the sums are all-reduced (SUM) over the ranks, in place; then
    ``on_commit`` runs and the step is committed (on rank 0 inside ``inner``'s transaction, so a
    failed all-reduce leaves ``inner`` exactly as before the call).

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
        return self.inner.secure_mode

    @property
    def step(self) -> int:
        return self._released

    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        return self.inner.noise_std(noise_multiplier, max_grad_norm)

    def restart_layout(self) -> None:
        self.inner.restart_layout()

    def add_noise_(self, tensors: Sequence[torch.Tensor], noise_multiplier: float, max_grad_norm: float, *,
                   on_commit: Any = None) -> None:  # fmt: skip
        tensors = list(tensors)
        # Validated on every rank alike, so a bad argument raises everywhere before communicating.
        self._validated_noise_scale(noise_multiplier, max_grad_norm)
        if not tensors:
            raise ValueError("tensors is empty: pass the clipped gradient sum of every parameter")
        for index, tensor in enumerate(tensors):
            if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
                raise ValueError(f"tensors[{index}] must be a floating-point tensor")

        def reduce_then_commit() -> None:
            self.job.all_reduce_sum_(tensors, f"the all-reduce of global step {self._released} (clipped sums + noise)")
            if on_commit is not None:
                on_commit()

        if self.job.rank == 0:
            self.inner.add_noise_(tensors, noise_multiplier, max_grad_norm, on_commit=reduce_then_commit)
        else:
            reduce_then_commit()
        self._released += 1

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.inner.state_dict())
        state["step"] = self._released
        state["distributed"] = {"saved_on_rank": self.job.rank, "world_size": self.job.world_size}
        return state

    def check_state_dict(self, state: Any, tensors: Sequence[torch.Tensor] | None = None) -> None:
        saved = state.get("distributed", {}) if isinstance(state, dict) else {}
        if self.job.rank == 0 and saved.get("saved_on_rank", 0) != 0:
            raise ValueError(
                f"this noise state was saved on rank {saved['saved_on_rank']}, whose noise mechanism never draws: "
                "the job's noise state is rank 0's. Save the optimizer's state dict from rank 0."
            )
        if self.job.rank == 0:
            self.inner.check_state_dict(_without_distributed(state), tensors)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Every rank loads rank 0's state; only rank 0 will draw from it.
        self.check_state_dict(state)
        self.inner.load_state_dict(_without_distributed(state))
        self._released = int(state["step"])

    def __repr__(self) -> str:
        return f"RankZeroNoise({self.inner!r}, rank={self.job.rank}, world_size={self.job.world_size})"


def _without_distributed(state: Any) -> Any:
    return {k: v for k, v in state.items() if k != "distributed"} if isinstance(state, dict) else state


def agree(plan: Any, *, accountant: Any, secure_mode: bool) -> None:
    """``make_private``'s cross-rank check of its plan (collective; see ``DistributedJob.agree``)."""
    plan.distributed.agree(plan_settings(plan, accountant=accountant, secure_mode=secure_mode))


def configure(dp_optimizer: Any, job: DistributedJob) -> None:
    """Make ``dp_optimizer`` run distributed global steps (``make_private`` calls it): its noise
    becomes ``RankZeroNoise(noise, job)`` (noise on rank 0, then the all-reduce). The optimizer's
    ``expected_batch_size`` and ``sample_rate`` must already be the global ones."""
    if dp_optimizer.loss_reduction == "mean" and dp_optimizer.expected_batch_size is None:
        raise ValueError("expected_batch_size (global) is needed")
    if not isinstance(dp_optimizer.noise, RankZeroNoise):
        dp_optimizer.noise = RankZeroNoise(dp_optimizer.noise, job)
    dp_optimizer.distributed_job = job


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------
def _check_rank(rank: Any, world_size: Any) -> tuple[int, int]:
    world_size = _positive_int(world_size, "world_size")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}); got {rank!r}")
    return int(rank), world_size


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, the same on every rank; got {seed!r}")
    return int(seed)


def _step_generator(seed: int, *key: int) -> torch.Generator:
    # Counter-based streams: the draws of a step depend on (seed, key, step) only, never on how many
    # draws came before, so ranks cannot drift apart (prefetching, an interrupted epoch) and
    # resuming needs only the step counter.
    return torch.Generator().manual_seed(_derived_seed(seed, *key))


_LOCAL_STREAM = 1  # (_LOCAL_STREAM, rank, step): a rank's own draws from its shard
_SHARED_STREAM = 2  # (_SHARED_STREAM, step): the draws every rank makes alike (truncated sampling)
_GROUP_STREAM = 3  # (_GROUP_STREAM,): the cyclic group assignment


class _DistributedSampler(_DPBatchSampler):
    """Common parts: population, rank, the agreed seed and the state of the distributed samplers."""

    kind = ""

    def _setup(self, num_samples: int, sample_rate: float, rank: int, world_size: int, seed: int,
               indices: Any) -> None:  # fmt: skip
        self.num_samples = _positive_int(num_samples, "num_samples")
        self.sample_rate = _validated_sample_rate(sample_rate)
        self.rank, self.world_size = _check_rank(rank, world_size)
        self.indices = _validated_indices(indices, self.num_samples)
        self.seed = _check_seed(seed)

    @property
    def population(self) -> int:
        """How many examples can be drawn, over all ranks (the index set's size)."""
        return int(self.indices.numel())

    def state_dict(self) -> dict[str, Any]:
        """The agreed seed and the next step: with counter-based streams, that is the whole state.
        (The seed determines which examples were and will be sampled: keep it as secret as the data.)"""
        return {"kind": self.kind, "num_samples": self.num_samples, "population": self.population,
                "num_groups": self.num_groups, "rank": self.rank, "world_size": self.world_size,
                "seed": self.seed, "next_step": self._next_step}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {"kind": self.kind, "num_samples": self.num_samples, "population": self.population,
                    "num_groups": self.num_groups, "rank": self.rank, "world_size": self.world_size}  # fmt: skip
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(
                    f"sampling state has {key}={state.get(key)!r} but this sampler has {key}={value!r}: resume with "
                    "the same dataset, grouping and number of ranks (load_distributed_state gives each rank its entry)"
                )
        self.set_seed(_check_seed(state["seed"]))
        self._next_step = int(state["next_step"])

    def set_seed(self, seed: int) -> None:
        self.seed = _check_seed(seed)


class DistributedPoissonBatchSampler(_DistributedSampler):
    """Rank ``rank``'s part of one Poisson sample of the whole dataset.

    Shard: every ``world_size``-th example of the index set (``indices``, default
    ``range(num_samples)``), starting at position ``rank``. Each step includes every shard member
    independently with the *global* rate ``sample_rate`` (float64 uniform < q), from a stream of
    this rank's own: derived from ``(seed, rank, step)``, so give every rank the same ``seed``.

    Guarantee: over the ranks, the shards partition the index set, so every example is on exactly
    one rank, and the union of the ranks' batches at a step is a Poisson sample of the index set
    with rate ``q``: each example in with probability q, independently of the others (the ranks'
    streams are independent), of other steps and of the data. Which rank holds an example does
    not matter for privacy: its inclusion probability is q wherever it is.

    ``expected_batch_size`` is the *global* ``q * population`` (what the noisy sum is divided by);
    ``local_expected_batch_size`` is this rank's ``q * len(shard)``.

    ==================================  ==========================================
    case                                result
    ==================================  ==========================================
    empty local batch                   yielded (zero-length through the loader)
    world_size > population             ranks past the end have an empty shard
    rank not in [0, world_size)         ValueError naming rank
    sample_rate not in (0, 1]           ValueError naming sample_rate
    ==================================  ==========================================
    """

    kind = "poisson"
    num_groups = 1
    max_batch_size = None

    def __init__(self, num_samples: int, sample_rate: float, *, rank: int, world_size: int, seed: int,
                 steps: int | None = None, indices: Any = None) -> None:  # fmt: skip
        self._setup(num_samples, sample_rate, rank, world_size, seed, indices)
        default_steps = max(1, round(1.0 / self.sample_rate))
        super().__init__(default_steps if steps is None else _positive_int(steps, "steps"))
        self.shard = self.indices[self.rank :: self.world_size].clone()

    @property
    def groups(self) -> list[torch.Tensor]:
        return [self.indices]

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.population

    @property
    def local_expected_batch_size(self) -> float:
        return self.sample_rate * self.shard.numel()

    def _draw(self, step: int) -> tuple[list[int], None]:
        generator = _step_generator(self.seed, _LOCAL_STREAM, self.rank, step)
        return _bernoulli_members(self.shard, self.sample_rate, generator).tolist(), None

    def __repr__(self) -> str:
        return (f"DistributedPoissonBatchSampler(num_samples={self.num_samples}, population={self.population}, "
                f"sample_rate={self.sample_rate}, rank={self.rank}, world_size={self.world_size}, steps={self.steps})")  # fmt: skip


class DistributedCyclicPoissonBatchSampler(_DistributedSampler):
    """Rank ``rank``'s part of cyclic Poisson sampling over ``num_groups`` global groups.

    Groups: as ``CyclicPoissonBatchSampler`` draws them (``public_size=False``: each example picks
    its group uniformly and independently; ``True``: a permutation cut into equal parts), but from
    a stream of ``seed`` alone, so every rank holding the same ``seed`` has the same global groups.
    Step ``t`` samples group ``t mod b`` with rate ``sample_rate``.

    Untruncated: this rank's part of a group is every ``world_size``-th member of it, starting at
    ``rank``, Poisson-sampled from this rank's own stream (``(seed, rank, step)``).

    Truncated (``max_batch_size``: the cap on the *global* batch, a multiple of ``world_size``;
    each rank's batches have exactly ``max_batch_size / world_size`` entries): every rank draws
    the same truncated Poisson sample of the whole group from the shared stream ``(seed, step)``
    (Bernoulli draws, then a random subset of at most ``max_batch_size``, padded to exactly
    ``max_batch_size``) and keeps its own slice of ``max_batch_size / world_size`` entries. The
    union of the slices is exactly one single-process truncated sample, so the steps are accounted
    as the single-process truncated event (group size, global cap). Why not let each rank truncate
    its own draw: an example's privacy would then depend on the size of its own rank's part, which
    changes when examples are added or removed, and the truncated epsilon is not monotone in that
    size (dp-accounting, q = 0.1, cap 8, sigma 1, 100 steps: epsilon 14.0 / 24.0 / 17.0 at sizes
    50 / 100 / 200), so no single size would bound every example.

    Guarantee: at step ``t`` only members of global group ``t mod b`` appear on any rank; the
    ranks' batches are disjoint and their union is one (truncated) Poisson sample of that group
    with rate ``sample_rate``, independent of the data; the step counter runs on across epochs,
    so an example's participations are at least ``b`` steps apart.

    ==================================  ==========================================
    case                                result
    ==================================  ==========================================
    num_groups = 1 with max_batch_size  truncated Poisson sampling
    max_batch_size % world_size != 0    ValueError naming max_batch_size
    num_groups > population             ValueError naming num_groups
    empty group / draw                  empty batch (all padding when truncated)
    ==================================  ==========================================
    """

    kind = "cyclic"

    def __init__(self, num_samples: int, num_groups: int, sample_rate: float, *, rank: int, world_size: int,
                 seed: int, steps: int | None = None, public_size: bool = False, max_batch_size: int | None = None,
                 indices: Any = None) -> None:  # fmt: skip
        self._setup(num_samples, sample_rate, rank, world_size, seed, indices)
        self.num_groups = _positive_int(num_groups, "num_groups")
        if self.num_groups > self.population:
            raise ValueError(f"num_groups={self.num_groups} exceeds the {self.population} examples to sample from")
        self.public_size = bool(public_size)
        self.max_batch_size = None if max_batch_size is None else _positive_int(max_batch_size, "max_batch_size")
        if self.max_batch_size is not None and self.max_batch_size % self.world_size:
            raise ValueError(
                f"max_batch_size={self.max_batch_size} (the cap on the global batch) must be a multiple of "
                f"world_size={self.world_size}: every rank's batch holds max_batch_size / world_size entries"
            )
        default_steps = self.num_groups * max(1, round(1.0 / self.sample_rate))
        super().__init__(default_steps if steps is None else _positive_int(steps, "steps"))
        self.set_seed(self.seed)

    def set_seed(self, seed: int) -> None:
        """Take ``seed`` (the same on every rank) and draw the global groups from it."""
        self.seed = _check_seed(seed)
        generator = _step_generator(self.seed, _GROUP_STREAM)
        population = self.population
        if self.public_size:
            permutation = self.indices[torch.randperm(population, generator=generator)]
            self.groups = list(torch.tensor_split(permutation, self.num_groups))
        else:
            assignment = torch.randint(self.num_groups, (population,), generator=generator)
            self.groups = [self.indices[assignment == group] for group in range(self.num_groups)]
        self.local_groups = [group[self.rank :: self.world_size].clone() for group in self.groups]

    @property
    def local_batch_size(self) -> int | None:
        """Entries of each of this rank's batches when truncated (None otherwise)."""
        return None if self.max_batch_size is None else self.max_batch_size // self.world_size

    @property
    def expected_batch_size(self) -> float:
        """Expected *global* number of real examples per step (before truncation)."""
        return self.sample_rate * self.population / self.num_groups

    def group_of_step(self, step: int) -> int:
        return step % self.num_groups

    def _draw(self, step: int) -> tuple[list[int], torch.Tensor | None]:
        group = self.group_of_step(step)
        if self.max_batch_size is None:
            generator = _step_generator(self.seed, _LOCAL_STREAM, self.rank, step)
            return _bernoulli_members(self.local_groups[group], self.sample_rate, generator).tolist(), None
        members = self.groups[group]
        generator = _step_generator(self.seed, _SHARED_STREAM, step)
        chosen = _bernoulli_members(members, self.sample_rate, generator)
        if chosen.numel() > self.max_batch_size:
            chosen = chosen[torch.randperm(chosen.numel(), generator=generator)[: self.max_batch_size]]
        real = torch.zeros(self.max_batch_size, dtype=torch.bool)
        real[: chosen.numel()] = True
        filler = int(members[0]) if members.numel() else int(self.indices[0])
        padded = torch.full((self.max_batch_size,), filler, dtype=torch.long)
        padded[: chosen.numel()] = chosen
        width = self.local_batch_size
        mine = slice(self.rank * width, (self.rank + 1) * width)
        return padded[mine].tolist(), ~real[mine]

    def __repr__(self) -> str:
        return (f"DistributedCyclicPoissonBatchSampler(num_samples={self.num_samples}, num_groups={self.num_groups}, "
                f"sample_rate={self.sample_rate}, rank={self.rank}, world_size={self.world_size}, steps={self.steps}, "
                f"public_size={self.public_size}, max_batch_size={self.max_batch_size})")  # fmt: skip


class DistributedDPDataLoader(DPDataLoader):
    """``DPDataLoader`` over this rank's part of a distributed Poisson / cyclic Poisson sample.

    Build it with ``from_data_loader`` from the loader every rank passes (over the whole dataset,
    ``batch_size`` = expected global batch). ``sample_rate`` and ``expected_batch_size`` are the
    global ones; ``state_dict`` is this rank's sampling state (see ``distributed_state`` for the
    whole job's).
    """

    distributed_job: DistributedJob | None = None

    @classmethod
    def from_data_loader(cls, loader: DataLoader, *, rank: int, world_size: int, seed: int,  # type: ignore[override]
                         num_groups: int = 1, max_batch_size: int | None = None, public_size: bool = False,
                         steps: int | None = None) -> DistributedDPDataLoader:  # fmt: skip
        """Rank ``rank``'s private loader: ``q = batch_size / len(examples)`` (Poisson) or
        ``p = num_groups * batch_size / len(examples)`` (cyclic; truncated with ``max_batch_size``,
        the cap on the global batch). ``seed``: the same on every rank. The examples are the
        dataset's, or a ``SubsetRandomSampler``'s (``sampling.loader_index_set``).

        ============================  ===========================================
        case                          result
        ============================  ===========================================
        dataset has no __len__        TypeError naming loader.dataset
        loader.batch_size None        ValueError naming loader.batch_size
        batch_size * num_groups > N   ValueError (the rate would exceed 1)
        ============================  ===========================================
        """
        num_samples = _sized_dataset_length(loader)
        batch_size = _expected_batch_size(loader)
        num_groups = _positive_int(num_groups, "num_groups")
        indices = loader_index_set(loader)
        population = num_samples if indices is None else int(indices.numel())
        if batch_size * num_groups > population:
            raise ValueError(
                f"loader.batch_size * num_groups = {batch_size} * {num_groups} exceeds the {population} examples the "
                "loader draws from: the sample rate would exceed 1; lower batch_size or num_groups"
            )
        rate = batch_size * num_groups / population
        if num_groups == 1 and max_batch_size is None:
            sampler: _DPBatchSampler = DistributedPoissonBatchSampler(
                num_samples, rate, rank=rank, world_size=world_size, seed=seed, steps=steps, indices=indices)  # fmt: skip
        else:
            sampler = DistributedCyclicPoissonBatchSampler(
                num_samples, num_groups, rate, rank=rank, world_size=world_size, seed=seed, steps=steps,
                public_size=public_size, max_batch_size=max_batch_size, indices=indices,
            )  # fmt: skip
        return cls(loader.dataset, sampler, **cls._loader_kwargs(loader))

    def state_dict(self) -> dict[str, Any]:
        """This rank's sampling state as of the last yielded batch (seed, next step)."""
        state = self.batch_sampler.state_dict()
        state["next_step"] = self._consumed_steps
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)
        self._consumed_steps = int(state["next_step"])


def distributed_state(data_loader: DistributedDPDataLoader) -> dict[str, Any]:
    """The sampling state of the whole job, on every rank (collective: call it on every rank).

    For checkpoints: every rank calls it, rank 0 saves the result (with the optimizer state dict
    of rank 0, which holds the job's noise state, and the engine's accountant, equal on all
    ranks); on resume every rank loads the same file and calls ``load_distributed_state``.
    """
    if not isinstance(data_loader, DistributedDPDataLoader):
        raise TypeError("data_loader must be the distributed loader make_private returned")
    job = data_loader.distributed_job
    if job is None:
        sampler = data_loader.batch_sampler
        job = DistributedJob(process_group=None, rank=sampler.rank, world_size=sampler.world_size, timeout=None,
                             wrapper="")  # fmt: skip
    states = job.all_gather_objects(data_loader.state_dict(), "gathering the sampling state of every rank")
    return {"format": "privacy_engine.distributed/1", "world_size": job.world_size, "ranks": states}


def load_distributed_state(data_loader: DistributedDPDataLoader, state: dict[str, Any]) -> None:
    """Restore this rank's entry of ``distributed_state`` (no communication). Raises, changing
    nothing, if the job had another number of ranks or another dataset / grouping."""
    if not isinstance(data_loader, DistributedDPDataLoader):
        raise TypeError("data_loader must be the distributed loader make_private returned")
    sampler = data_loader.batch_sampler
    if state.get("format") != "privacy_engine.distributed/1":
        raise ValueError("state is not a distributed_state() result")
    if int(state["world_size"]) != sampler.world_size:
        raise ValueError(
            f"the checkpoint was taken with {state['world_size']} ranks; this job has {sampler.world_size}. Resume with "
            "the same number of ranks (the shards and per-rank streams depend on it)."
        )
    data_loader.load_state_dict(state["ranks"][sampler.rank])
