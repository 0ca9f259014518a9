"""``make_private`` for a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): what the
engine can run on shards, and the private optimizer it builds there.

The plan is the ordinary one (``engine.plan.make_plan``): ``training.distributed.unwrap`` gives a
``fully_shard`` model a job in the default process group, so the private loader is the DDP loader
(each rank Poisson-samples its shard of the dataset at the global rate), the noise multiplier is given
or calibrated as for one process, and the ranks compare their settings (``distributed.agree``). Only
the build differs: instead of hooking the model and wrapping the optimizer in a ``DPOptimizer``, the
engine builds ``training.fsdp_private.FSDPPrivateOptimizer`` (ghost clipping in two FSDP backward passes,
each rank noising its own shard from its own stream) and returns the model itself, hooked. BandMF and BLT
(``noise_mechanism="bandmf"``, ``"blt"``, or ``"auto"`` choosing one) are planned exactly as for one process
(``engine.bands``, ``engine.mechanism_choice``: the same strategy, calibration and cyclic groups, the loader
being the DDP one with ``num_groups``); the mechanism the plan builds runs on each rank's shards
(``training.fsdp_noise.ShardMechanismNoise``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from accountants import Accountant
from privacy_engine.engine.budget import PrivacyBudget
from privacy_engine.engine.ledger import ledger_for
from privacy_engine.engine.options import PrivacyOptions
from privacy_engine.engine.plan import Plan
from privacy_engine.noise.mechanism import NoiseMechanism
from privacy_engine.training import distributed
from privacy_engine.training.fsdp import ShardNoise, fsdp_problem, is_fsdp2
from privacy_engine.training.fsdp_noise import ShardMechanismNoise
from privacy_engine.training.fsdp_private import FSDPPrivateOptimizer

__all__ = ["fsdp_options", "is_fsdp2", "private_fsdp_optimizer"]

logger = logging.getLogger(__name__)

#: The settings a sharded run accepts with other values than their defaults (every other one is refused).
_ACCEPTED = frozenset({
    "max_grad_norm", "noise_multiplier", "target_epsilon", "target_delta", "epochs", "max_epsilon",
    "loss_reduction", "noise_seed", "noise_generator", "grad_sample_mode", "noise_mechanism", "num_bands",
    "total_steps", "num_buffers", "bandmf_coefficients", "max_noise_memory",
})  # fmt: skip

#: Why a setting is refused under FSDP, where a reason helps more than "not supported".
_WHY = {
    "clipping": "per-layer clipping needs per-layer norms across the shards; use clipping='flat'",
    "poisson_sampling": "the ranks must Poisson-sample disjoint shards of the dataset at the global rate",
    "max_batch_size": "truncated sampling is not wired for FSDP",
    "audit": "canaries are not added to sharded releases yet",
    "privacy_unit": "user-level sampling is not wired for FSDP",
    "grad_scaler": "fp16 loss scaling is not supported under FSDP; shard in float32",
    "batch_first": "the model's outputs and every layer's must hold the batch in dimension 0",
    "nan_safe": "a non-finite norm always gives factor 0 under FSDP (nan_safe=True)",
    "noise_stream": "each rank's shard noise is drawn on the serial stream; leave noise_stream='mt19937'",
}


def fsdp_options(options: PrivacyOptions, model: nn.Module) -> PrivacyOptions:
    """``options`` for ``model``, sharded with ``fully_shard``: ``grad_sample_mode="auto"`` becomes ``"ghost"`` (logged); every
    setting the sharded build cannot honour is refused before anything changes.

    ==========================================  ==============================================
    setting                                     result
    ==========================================  ==============================================
    "hooks", "functorch", "ew", "no_op"         NotImplementedError: use grad_sample_mode="ghost"
    "auto" / "ghost"                            "ghost"
    noise_mechanism "gaussian", "bandmf",       accepted (the plan picks and builds it; each
    "blt", "auto"; num_bands, total_steps,      rank runs it on its shard, cyclic sampling)
    num_buffers, bandmf_coefficients
    max_noise_memory (with "auto")              accepted: the budget of one rank's noise state
                                                (each rank noises its shards only: the
                                                candidates count the largest rank's shards,
                                                ``mechanism_choice.noise_vector_bytes``)
    noise_mechanism=``BandMFNoise(...)`` etc.   NotImplementedError: pass the mechanism's name
    any other setting not at its default        NotImplementedError naming it (per-layer or
    except sigma, C, the target and budget,     adaptive clipping, canaries, user-level DP,
    epochs, loss_reduction, the noise seed      truncation, grad_scaler, ...)
    ==========================================  ==============================================
    """
    if options.grad_sample_mode not in ("auto", "ghost"):
        raise NotImplementedError(fsdp_problem(model, options.grad_sample_mode) or (
            f"grad_sample_mode={options.grad_sample_mode!r} cannot run on a fully_shard model: use "
            "grad_sample_mode='ghost'"))  # fmt: skip
    for field in dataclasses.fields(PrivacyOptions):
        name = field.name
        if name in _ACCEPTED:
            continue
        value, default = getattr(options, name), field.default
        if value is default or (type(value) is type(default) and value == default):
            continue
        why = _WHY.get(name, "not supported with a fully_shard model yet")
        raise NotImplementedError(f"{name}={value!r} with a model sharded by fully_shard (FSDP2): {why}")
    if isinstance(options.noise_mechanism, NoiseMechanism):
        raise NotImplementedError(
            f"noise_mechanism={type(options.noise_mechanism).__name__}(...) with a model sharded by fully_shard "
            "(FSDP2): a mechanism object would be one stream shared by the ranks; pass its name "
            "(noise_mechanism='gaussian', 'bandmf', 'blt' or 'auto'), which each rank builds on its own shard"
        )
    if not isinstance(options.max_grad_norm, (int, float)):
        raise NotImplementedError("max_grad_norm must be one number with a fully_shard model (flat clipping)")
    if options.grad_sample_mode == "auto":
        logger.info("grad_sample_mode='auto' with a fully_shard model: ghost (the only mode on shards)")
        options = dataclasses.replace(options, grad_sample_mode="ghost")
    return options


def _check_mesh(plan: Plan) -> None:
    """The parameters' mesh must span the default group (the job's collectives and the loader's shards)."""
    meshes = {p.device_mesh for p in plan.params if hasattr(p, "device_mesh")}
    sizes = {int(mesh.size()) for mesh in meshes}
    world = dist.get_world_size()
    if sizes != {world}:
        raise NotImplementedError(
            f"the trainable parameters are sharded over meshes of sizes {sorted(sizes)}; the default process group "
            f"has {world} ranks: shard over one mesh spanning all ranks (init_device_mesh(..., ({world},)))"
        )


def private_fsdp_optimizer(plan: Plan, optimizer: Optimizer, *, accountant: Accountant, secure_mode: bool,
                           budget: PrivacyBudget | None, source: str) -> FSDPPrivateOptimizer:  # fmt: skip
    """The private optimizer of a sharded ``plan`` (collective: the ranks compare their plans first, then
    their step settings; a difference raises ``DistributedSettingsError`` on every rank before anything is
    hooked). The noise: DP-SGD: ``ShardNoise``; BandMF/BLT: the plan's mechanism (the one a single process
    would build) run per shard by ``ShardMechanismNoise``, with the loader's cyclic groups and the mechanism's
    own event. The run seed is ``noise_seed`` (``noise_generator``: one draw from it; none: one draw from
    torch's global generator; secure mode: the OS), each rank its own stream derived from it."""
    _check_mesh(plan)
    distributed.agree(plan, accountant=accountant, secure_mode=secure_mode)
    options, noise_plan = plan.options, plan.noise_plan
    sigma, max_grad_norm, rank = noise_plan.noise_multiplier, float(options.max_grad_norm), plan.distributed.rank
    noise: ShardNoise | ShardMechanismNoise
    if noise_plan.mechanism == "gaussian":
        seed = options.noise_seed
        if options.noise_generator is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=options.noise_generator).item())
        noise = ShardNoise(noise_multiplier=sigma, max_grad_norm=max_grad_norm, seed=seed, secure_mode=secure_mode,
                           rank=rank)  # fmt: skip
    else:
        # Built by the plan as for one process: seeded with noise_seed (or one draw of noise_generator), which
        # is then the run seed each rank's stream is derived from.
        mechanism = plan.make_noise()
        noise = ShardMechanismNoise(mechanism, noise_multiplier=sigma, max_grad_norm=max_grad_norm,
                                    seed=mechanism.state_dict()["seed"], rank=rank)  # fmt: skip
    return FSDPPrivateOptimizer(
        optimizer, model=plan.model, noise=noise, data_loader=plan.private_loader,
        accountant=ledger_for(accountant, noise_plan), budget=budget, loss_reduction=options.loss_reduction,
        source=source, privacy_event=noise.privacy_event(), job=plan.distributed,
    )  # fmt: skip
