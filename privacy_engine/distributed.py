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
   the dataset into the same ``b`` global groups on every rank (drawn from a seed agreed at
   ``make_private``) and each group into one part per rank. Truncated sampling (``max_batch_size``,
   the cap on the global batch): every rank draws the same truncated sample and keeps its slice of
   ``max_batch_size / world_size`` entries, so it is accounted exactly as in one process
   (``privacy_engine.distributed_sampling`` says why a cap per rank on its own draw would not be).
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
Every rank must call ``optimizer.step()`` at every step, an empty local batch included: a rank
that skips one leaves the others waiting at the all-reduce until the timeout.

Checkpoints: the job's noise state is rank 0's (``optimizer.state_dict()`` on rank 0; the
accountant is the same on every rank); the sampling state of all ranks is
``distributed_state(loader)`` (collective). Save both from rank 0; on resume every rank loads the
same file (``optimizer.load_state_dict``, ``load_distributed_state(loader, state)``). Save between
steps: a clipped sum accumulated on another rank mid-step is not in rank 0's state.

Not supported: FSDP / FSDP2 (``fully_shard``; sharded parameters would need per-example gradients
of the unsharded weights), ``nn.DataParallel`` (replicas in threads), ``poisson_sampling=False``.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import numbers
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from privacy_engine.distributed_sampling import (
    DistributedCyclicPoissonBatchSampler,
    DistributedDPDataLoader,
    DistributedPoissonBatchSampler,
    derived_seed,
)
from privacy_engine.noise import NoiseMechanism
from privacy_engine.optimizer import DPOptimizer

__all__ = [
    "DifferentiallyPrivateDistributedDataParallel",
    "DistributedCyclicPoissonBatchSampler",
    "DistributedDPDataLoader",
    "DistributedDPOptimizer",
    "DistributedJob",
    "DistributedPoissonBatchSampler",
    "DistributedSettingsError",
    "DistributedStepError",
    "DistributedUniformWithReplacementSampler",
    "RankZeroNoise",
    "agree",
    "configure",
    "distributed_data_loader",
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
        except Exception as error:
            limit = f" (timeout {timeout.total_seconds():g} s)" if timeout is not None else ""
            raise DistributedStepError(
                f"rank {self.rank} of {self.world_size}: {what} did not complete{limit}: another rank raised, "
                f"died or stalled (see its log). The process group is unusable now; stop this rank. "
                f"Backend said: {error}"
            ) from error

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Sum ``tensors`` over the ranks, in place: one flat all-reduce per (device, dtype)."""
        if self.world_size == 1:
            return  # a job of one rank: the sum is already complete
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
            except Exception as error:
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
    DDP inside the model                          ValueError: wrap the whole model once
    DDP of DDP                                    TypeError: wrap the model once
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
        raise TypeError(f"{type(model).__name__} wraps another {type(inner).__name__}: wrap the model once")
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
        sampling_seed = derived_seed(int(noise_seed), _SAMPLING_KEY)
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
# Opacus's names (privacy_engine.opacus looks them up here)
# ---------------------------------------------------------------------------------------------
def _current_job(process_group: Any, timeout: Timeout, wrapper: str) -> DistributedJob:
    _require_initialized(wrapper)
    return DistributedJob(process_group=process_group, rank=dist.get_rank(process_group),
                          world_size=dist.get_world_size(process_group), timeout=_validated_timeout(timeout),
                          wrapper=wrapper)  # fmt: skip


def _seed_from(generator: torch.Generator | None) -> int:
    # From the generator's state (not a draw: the caller's generator is left as it is), else one
    # draw from torch's global generator, as Opacus samples from it.
    if generator is not None:
        return int.from_bytes(hashlib.sha256(generator.get_state().numpy().tobytes()).digest()[:8], "little") >> 1
    return int(torch.randint(0, 2**62, (1,)).item())


class DistributedDPOptimizer(DPOptimizer):
    """Opacus's distributed optimizer, for scripts that build it by hand: a ``DPOptimizer`` whose
    steps are global (``RankZeroNoise``: noise on rank 0, one all-reduce of clipped sums + noise).

    ``expected_batch_size`` is each rank's, as in Opacus: the summed gradient is divided by
    ``expected_batch_size * world_size``. Accounting, sampling and the cross-rank settings check
    are ``make_private``'s (prefer it); this class does none of them.
    """

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: float | None, loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, secure_mode: bool = False, process_group: Any = None,
                 timeout: Timeout = None, **kwargs: Any) -> None:  # fmt: skip
        job = _current_job(process_group, timeout, "DistributedDPOptimizer")
        if expected_batch_size is not None:
            expected_batch_size = expected_batch_size * job.world_size
        seed = None if secure_mode else _seed_from(generator)
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction=loss_reduction, noise_seed=seed,
                         secure_mode=secure_mode, **kwargs)  # fmt: skip
        configure(self, job)


class DistributedUniformWithReplacementSampler(DistributedPoissonBatchSampler):
    """Opacus's distributed Poisson sampler (its keyword arguments): this rank's part of one global
    Poisson sample, see ``DistributedPoissonBatchSampler`` (rank and world size from the default
    process group). ``shuffle``/``shuffle_seed`` are accepted and unused: the shards here are
    strided, and which rank holds an example does not change its inclusion probability."""

    def __init__(self, *, total_size: int, sample_rate: float, shuffle: bool = True, shuffle_seed: int = 0,
                 steps: int | None = None, generator: torch.Generator | None = None) -> None:  # fmt: skip
        job = _current_job(None, None, "DistributedUniformWithReplacementSampler")
        super().__init__(total_size, sample_rate, rank=job.rank, world_size=job.world_size, seed=_seed_from(generator),
                         steps=steps)  # fmt: skip


def distributed_data_loader(data_loader: DataLoader, *, generator: torch.Generator | None = None,
                            process_group: Any = None) -> DistributedDPDataLoader:  # fmt: skip
    """This rank's distributed Poisson loader over ``data_loader``'s examples (Opacus's
    ``DPDataLoader.from_data_loader(loader, distributed=True)``): ``q = batch_size / N`` with
    ``batch_size`` the expected *global* batch. No communication: the ranks' streams are keyed by
    rank, so they are independent whatever seeds the ranks hold."""
    job = _current_job(process_group, None, "distributed_data_loader")
    loader = DistributedDPDataLoader.from_data_loader(data_loader, rank=job.rank, world_size=job.world_size,
                                                      seed=_seed_from(generator))  # fmt: skip
    loader.distributed_job = job
    return loader


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
    """Restore this rank's entry of ``distributed_state``. Raises, changing nothing, if the job had
    another number of ranks or another dataset / grouping. No communication, except with secure
    truncated sampling: its shared seed is never saved, so the ranks agree on a fresh one from rank
    0's OS randomness (call it on every rank)."""
    if not isinstance(data_loader, DistributedDPDataLoader):
        raise TypeError("data_loader must be the distributed loader make_private returned")
    sampler = data_loader.batch_sampler
    if state.get("format") != "privacy_engine.distributed/1":
        raise ValueError("state is not a distributed_state() result")
    if int(state["world_size"]) != sampler.world_size:
        raise ValueError(
            f"the checkpoint was taken with {state['world_size']} ranks; this job has {sampler.world_size}. Resume "
            "with the same number of ranks (the shards and per-rank streams depend on it)."
        )
    data_loader.load_state_dict(state["ranks"][sampler.rank])
    if getattr(sampler, "secure", False) and sampler.max_batch_size is not None:
        job = data_loader.distributed_job or _current_job(None, None, "load_distributed_state")
        sampler.set_shared_seed(job.broadcast_int(_os_seed(), "agreeing on a fresh secure sampling seed"))
