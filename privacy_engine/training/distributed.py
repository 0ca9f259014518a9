"""Private data-parallel training on ``torch.distributed``: one global DP step over all ranks.

Wrap the model in torch's ``DistributedDataParallel`` (or ``PrivateDataParallel``,
which also sets the collectives' timeout) and call ``make_private`` on every rank with the
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
   (``privacy_engine.training.distributed_sampling`` says why a cap per rank on its own draw would not be).
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
``PrivateDataParallel(timeout=...)``); a rank that raised, died or
stalled makes the others raise ``DistributedStepError`` naming the step, instead of hanging.
``make_private`` compares the privacy settings of all ranks (sigma, clipping, seeds, mechanism,
sample rate, ..., and a digest of the dataset's contents and order: ``distributed_dataset``) and
raises ``DistributedSettingsError`` on every rank, naming what differs.
Every rank must call ``optimizer.step()`` at every step, an empty local batch included: a rank
that skips one leaves the others waiting at the all-reduce until the timeout.

Checkpoints: the job's noise state is rank 0's (``optimizer.state_dict()`` on rank 0; the
accountant is the same on every rank); the sampling state of all ranks is
``distributed_state(loader)`` (collective). Save both from rank 0; on resume every rank loads the
same file (``optimizer.load_state_dict``, ``load_distributed_state(loader, state)``). Save between
steps: a clipped sum accumulated on another rank mid-step is not in rank 0's state.

Not supported here: FSDP1 (refused, pointing to ``fully_shard``), FSDP2 (``fully_shard``: ``make_private``
builds ghost clipping with sharded noise instead, ``privacy_engine.engine.sharded``),
``nn.DataParallel`` (replicas in threads), ``poisson_sampling=False``.

This module: the model wrapper, ``make_private``'s wiring (``unwrap``, ``agree``, ``configure``),
what pieces built by hand need (``current_job``, ``sampling_seed``, ``distributed_data_loader``) and
the sampling checkpoints (``distributed_state``). Beside it:
``distributed_job.py`` (the job, its timeouts and collectives), ``distributed_noise.py``
(``RankZeroNoise``), ``distributed_sampling.py`` (each rank's samplers and loader) and
``distributed_dataset.py`` (the digest that tells whether the ranks hold the same dataset in the same
order, compared with the settings).
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from privacy_engine.training.distributed_dataset import dataset_settings
from privacy_engine.training.distributed_job import (
    DistributedJob,
    DistributedSettingsError,
    DistributedStepError,
    Timeout,
    _os_seed,
    _require_initialized,
    _validated_timeout,
)
from privacy_engine.training.distributed_noise import RankZeroNoise
from privacy_engine.training.distributed_sampling import (
    DistributedCyclicPoissonBatchSampler,
    DistributedDPDataLoader,
    DistributedPoissonBatchSampler,
    derived_seed,
)
from privacy_engine.training.fsdp import fsdp_problem, is_fsdp2

__all__ = [
    "DistributedCyclicPoissonBatchSampler",
    "DistributedDPDataLoader",
    "DistributedJob",
    "DistributedPoissonBatchSampler",
    "DistributedSettingsError",
    "DistributedStepError",
    "PrivateDataParallel",
    "RankZeroNoise",
    "agree",
    "configure",
    "current_job",
    "distributed_data_loader",
    "distributed_state",
    "load_distributed_state",
    "sampling_seed",
    "unwrap",
]


# Spawn key of the sampling seed derived from the user's noise seed (kept apart from the noise's
# own streams, which privacy_engine.noise.layout derives with (device, generator) keys).
_SAMPLING_KEY = 7001


def plan_settings(plan: Any, *, accountant: Any, secure_mode: bool) -> dict[str, Any]:
    """What every rank's ``make_private`` plan must agree on (from the engine's internal plan)."""
    noise_plan = plan.noise_plan
    loader = plan.private_loader
    return {
        "noise_multiplier": noise_plan.noise_multiplier,
        "max_grad_norm": plan.max_grad_norm,
        "clipping": plan.clipping,
        "adaptive_clipping": repr(getattr(plan, "adaptive_clipping", None)),  # options of a frozen dataclass
        "noise_mechanism": noise_plan.mechanism,
        "num_bands": noise_plan.num_bands,
        "bandmf_coefficients": noise_plan.coefficients,
        "total_steps": noise_plan.total_steps,
        "sample_rate": noise_plan.sample_rate,
        "expected_batch_size": noise_plan.expected_batch_size,
        "max_batch_size": noise_plan.max_batch_size,
        "group_size": noise_plan.group_size,
        "dataset_size": getattr(loader.batch_sampler, "num_samples", None),
        **dataset_settings(loader.dataset),
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
class PrivateDataParallel(nn.Module):
    """A data-parallel model for private training (Opacus's ``DifferentiallyPrivateDistributedDataParallel``
    plays the same part): marks ``module`` for
    distributed private training and sets how long its collectives may wait.

    At construction every rank receives rank 0's parameters and buffers (as DDP does); calls go
    straight to ``module``. ``make_private`` recognises it exactly like torch's
    ``DistributedDataParallel`` (and unwraps either). ``timeout`` bounds every collective of
    private training (default: the process group's timeout).
    """

    def __init__(self, module: nn.Module, *, process_group: Any = None, timeout: Timeout = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module; got {type(module).__name__}")
        _require_initialized("PrivateDataParallel")
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
        """``module``'s forward (the wrapper adds nothing to it)."""
        return self.module(*args, **kwargs)


def _sharded_wrapper_problem(model: nn.Module, grad_sample_mode: str | None) -> str | None:
    problem = fsdp_problem(model, grad_sample_mode)
    if problem is not None:
        return problem
    for path, module in model.named_modules():
        if isinstance(module, nn.DataParallel):
            where = repr(path) if path else "the model"
            return f"{where} is wrapped in nn.DataParallel (replicas in threads)"
    return None


def unwrap(model: nn.Module, *, noise_seed: int | None = None, noise_generator: torch.Generator | None = None,
           secure_mode: bool = False, grad_sample_mode: str | None = None) -> tuple[nn.Module, DistributedJob | None]:  # fmt: skip
    """The module to hook and, for a data-parallel model, this rank's ``DistributedJob``.

    ``make_private`` calls it first. No communication, nothing changed.

    ============================================  ==============================================
    model                                         result
    ============================================  ==============================================
    DistributedDataParallel(m) (any backend)      (m, job in DDP's process group)
    PrivateDataParallel                           (m, job with its process group and timeout)
    a plain module, no process group / world 1    (model, None): single-process training
    a plain module, world size > 1                (model, None) and a warning: each rank trains
                                                  alone and reports its own epsilon
    FSDP1 (FullyShardedDataParallel)              NotImplementedError pointing to fully_shard
    FSDP2 (fully_shard), grad_sample_mode         NotImplementedError: use "ghost"
    other than "ghost"
    FSDP2 (fully_shard), "ghost" or "auto"        (model, job in the default group): sharded ghost
                                                  clipping (``privacy_engine.engine.sharded``)
    DataParallel                                  NotImplementedError saying what is supported
    DDP inside the model                          ValueError: wrap the whole model once
    DDP of DDP                                    TypeError: wrap the model once
    ============================================  ==============================================
    """
    problem = _sharded_wrapper_problem(model, grad_sample_mode)
    if problem is not None:
        raise NotImplementedError(
            f"{problem}. (make_private supports data parallelism with torch's DistributedDataParallel or "
            "PrivateDataParallel, in hooks, functorch and ghost modes.)"
        )
    if is_fsdp2(model):
        # Sharded (fully_shard), ghost mode: the model is kept as it is; the job is that of the default group
        # (privacy_engine.engine.sharded checks that the parameters' mesh spans it).
        _require_initialized("make_private with a fully_shard model")
        return model, _job(None, None, "fully_shard", noise_seed=noise_seed, noise_generator=noise_generator,
                           secure_mode=secure_mode)  # fmt: skip
    wrappers = (DistributedDataParallel, PrivateDataParallel)
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
    return inner, _job(process_group, timeout, type(model).__name__, noise_seed=noise_seed,
                       noise_generator=noise_generator, secure_mode=secure_mode)  # fmt: skip


def _job(process_group: Any, timeout: Any, wrapper: str, *, noise_seed: int | None,
         noise_generator: torch.Generator | None, secure_mode: bool) -> DistributedJob:  # fmt: skip
    """This rank's job, its sampling seed and noise fingerprint derived from the user's seed or generator."""
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
    return DistributedJob(
        process_group=process_group, rank=dist.get_rank(process_group), world_size=dist.get_world_size(process_group),
        timeout=timeout, wrapper=wrapper, sampling_seed=sampling_seed, seed_fingerprint=fingerprint,
        secure_mode=secure_mode,
    )  # fmt: skip



def agree(plan: Any, *, accountant: Any, secure_mode: bool) -> None:
    """``make_private``'s cross-rank check of its plan (collective; see ``DistributedJob.agree``)."""
    plan.distributed.agree(plan_settings(plan, accountant=accountant, secure_mode=secure_mode))


def configure(dp_optimizer: Any, job: DistributedJob) -> None:
    """Make ``dp_optimizer`` run distributed global steps (``make_private`` calls it): its noise
    becomes ``RankZeroNoise(noise, job)`` (noise on rank 0, then the all-reduce). The optimizer's
    ``expected_batch_size`` and ``sample_rate`` must already be the global ones."""
    if not isinstance(dp_optimizer.noise, RankZeroNoise):
        dp_optimizer.noise = RankZeroNoise(dp_optimizer.noise, job)
    dp_optimizer.distributed_job = job


# ---------------------------------------------------------------------------------------------
# Pieces built by hand (outside make_private): the current job, seeds, the distributed loader
# ---------------------------------------------------------------------------------------------
def current_job(process_group: Any, timeout: Timeout, wrapper: str) -> DistributedJob:
    """This rank's job in ``process_group`` (default: the default group), for pieces built by hand;
    ``wrapper`` names the piece in errors (RuntimeError if no process group is initialised)."""
    _require_initialized(wrapper)
    return DistributedJob(process_group=process_group, rank=dist.get_rank(process_group),
                          world_size=dist.get_world_size(process_group), timeout=_validated_timeout(timeout),
                          wrapper=wrapper)  # fmt: skip


def sampling_seed(generator: torch.Generator | None) -> int:
    """A seed from ``generator``'s state (not a draw: the caller's generator is left as it is), else
    one draw from torch's global generator (so ``torch.manual_seed`` makes a run reproducible)."""
    if generator is not None:
        return int.from_bytes(hashlib.sha256(generator.get_state().numpy().tobytes()).digest()[:8], "little") >> 1
    return int(torch.randint(0, 2**62, (1,)).item())


def distributed_data_loader(data_loader: DataLoader, *, generator: torch.Generator | None = None,
                            process_group: Any = None) -> DistributedDPDataLoader:  # fmt: skip
    """This rank's distributed Poisson loader over ``data_loader``'s examples, built by hand (what
    Opacus's ``DPDataLoader.from_data_loader(loader, distributed=True)`` gives): ``q = batch_size / N`` with
    ``batch_size`` the expected *global* batch. The ranks' streams are keyed by rank, so they are
    independent whatever seeds the ranks hold. Collective (every rank calls it, as in Opacus's
    scripts): the ranks compare the dataset's size and digest (``distributed_dataset``) and raise
    ``DistributedSettingsError`` on every rank if index ``i`` is not the same example everywhere."""
    job = current_job(process_group, None, "distributed_data_loader")
    job.agree(dataset_settings(data_loader.dataset))
    loader = DistributedDPDataLoader.from_data_loader(data_loader, rank=job.rank, world_size=job.world_size,
                                                      seed=sampling_seed(generator))  # fmt: skip
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
        job = data_loader.distributed_job or current_job(None, None, "load_distributed_state")
        sampler.set_shared_seed(job.broadcast_int(_os_seed(), "agreeing on a fresh secure sampling seed"))
