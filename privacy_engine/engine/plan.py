"""From ``PrivacyOptions`` and the three objects to a ``Plan``: everything ``make_private`` will
build, checked before anything is wrapped.

In order: the objects (model, optimizer, loader) and their parameters; the layers the core
supports; the clipping groups; the loader's shape; the noise mechanism (and BandMF's bands,
``engine.bands``); the private loader (Poisson, cyclic or truncated sampling); the noise multiplier
(given, or calibrated: ``engine.calibration``) and the ``NoisePlan``. Nothing here hooks the model,
changes the optimizer or records a step.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset, SubsetRandomSampler

from accountants import Accountant
from privacy_engine.auditing.input_canaries import CanaryDataset, InputCanaries
from privacy_engine.batches.users import UserAssignment
from privacy_engine.capture import GradSampleModule
from privacy_engine.capture.manual import ManualGradSampleModule
from privacy_engine.clipping import parameter_groups
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.engine.bands import check_num_bands, plan_bandmf
from privacy_engine.engine.calibration import calibrate, warn_if_delta_too_large, warn_if_noise_drowns_the_gradient
from privacy_engine.engine.limits import check_accounted_steps
from privacy_engine.engine.mechanism_choice import noise_vector_bytes, plan_auto, plan_blt
from privacy_engine.engine.mode_choice import choose_grad_sample_mode
from privacy_engine.engine.noise_plan import LoaderShape, NoiseChoice, NoisePlan
from privacy_engine.engine.options import PrivacyOptions
from privacy_engine.engine.truncation import worst_group_size
from privacy_engine.models.validation import UnsupportedModuleError, find_problems
from privacy_engine.noise import GaussianNoise, NoiseMechanism
from privacy_engine.noise.secure_random import SecureGenerator
from privacy_engine.settings_checks import check_unseeded_in_secure_mode
from privacy_engine.training import distributed
from privacy_engine.training.data_loader import DPDataLoader, loader_index_set
from privacy_engine.training.optimizer import DPOptimizer
from privacy_engine.training.optimizer_arguments import check_wrapped_optimizer, trainable_parameters
from privacy_engine.training.rewrap import plain_loader_for
from privacy_engine.training.user_sampling import (
    assignment_for_loader,
    distributed_user_level_loader,
    user_level_loader,
)

__all__ = ["BuildClasses", "Plan", "make_plan"]


def _option(name: str) -> property:
    return property(lambda plan: getattr(plan.options, name), doc=f"``options.{name}``")


@dataclass(frozen=True, kw_only=True)
class BuildClasses:
    """The classes ``make_private`` instantiates: the private optimizer and the model wrapper of each
    ``grad_sample_mode``. The defaults are the engine's; an API layer on top of the engine may name
    subclasses of them that take the same constructor arguments (adding methods, not state), and
    ``engine.build`` constructs those directly."""

    optimizer: type[DPOptimizer] = DPOptimizer
    #: "hooks", "functorch" and "ew".
    hooks: type[GradSampleModule] = GradSampleModule
    #: "ghost": fast clipping in the backward pass.
    ghost: type[GhostClippingModule] = GhostClippingModule
    #: "no_op": the loop sets ``p.grad_sample`` itself.
    manual: type[ManualGradSampleModule] = ManualGradSampleModule


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything make_private builds, validated before anything is wrapped."""

    options: PrivacyOptions
    model: nn.Module
    optimizer: Optimizer
    private_loader: DataLoader
    #: The optimizer's trainable parameters, and their clipping groups (None for flat clipping).
    params: list
    groups: list | None
    make_noise: Callable[[], NoiseMechanism]
    noise_plan: NoisePlan
    #: This rank's part of a distributed (DDP) job; None for one process (privacy_engine.training.distributed).
    distributed: distributed.DistributedJob | None = None
    #: The classes built from the plan (the engine's unless its caller names subclasses).
    classes: BuildClasses = BuildClasses()
    #: ``audit=AuditConfig(kind="input")``: the canaries appended to the private loader's dataset; else None.
    input_canaries: InputCanaries | None = None

    # Read by name by distributed.plan_settings, which compares them across ranks.
    max_grad_norm = _option("max_grad_norm")
    clipping = _option("clipping")
    adaptive_clipping = _option("adaptive_clipping")
    loss_reduction = _option("loss_reduction")
    grad_sample_mode = _option("grad_sample_mode")
    nan_safe = _option("nan_safe")
    rescale_to_unit_norm = _option("rescale_to_unit_norm")


def make_plan(options: PrivacyOptions, *, model: Any, optimizer: Any, data_loader: Any, accountant: Accountant,
              secure_mode: bool) -> Plan:  # fmt: skip
    """The plan of one ``make_private`` call; raises (see its table) with nothing changed. The
    accountant is only asked (a fresh copy, or a zero-step record that validates its arguments).
    Warns (``engine.calibration``) when ``target_delta >= 1/N`` and when a calibrated DP-SGD noise
    multiplier exceeds the expected batch size."""
    model, optimizer, data_loader = _check_objects(model, optimizer, data_loader)
    check_unseeded_in_secure_mode("noise_seed", options.noise_seed, secure_mode=secure_mode)
    check_unseeded_in_secure_mode("noise_generator", options.noise_generator, secure_mode=secure_mode)
    # A DDP-wrapped model is unwrapped (its inner module is hooked).
    model, job = distributed.unwrap(model, noise_seed=options.noise_seed, noise_generator=options.noise_generator,
                                    secure_mode=secure_mode, grad_sample_mode=options.grad_sample_mode)  # fmt: skip
    params = _check_parameters(model, optimizer)
    # Layers the core cannot handle (checked again by GradSampleModule, before it hooks anything).
    if isinstance(model, GradSampleModule):
        raise TypeError("module is already a GradSampleModule: pass the original module")
    problems = find_problems(model)
    if problems:
        raise UnsupportedModuleError("cannot compute per-sample gradients:\n- " + "\n- ".join(problems))
    # grad_sample_mode="auto" (the default) becomes hooks or ghost here, once, and is logged (engine.mode_choice).
    mode = choose_grad_sample_mode(model, options, distributed=job is not None)
    if mode.mode != options.grad_sample_mode:
        options = dataclasses.replace(options, grad_sample_mode=mode.mode)
    groups = _clipping_groups(model, params, options)
    # Input canaries are examples: appended before the loader's shape is read, so that the sample rate, the
    # steps of an epoch and the accounting are those of the enlarged dataset the private loader samples.
    input_canaries, data_loader = _with_input_canaries(data_loader, options, secure_mode=secure_mode, job=job)
    shape = _loader_shape(data_loader, options)
    users, shape = _users(data_loader, options, shape, job=job)  # privacy_unit="user": users are the unit
    if options.target is not None:
        # Calibration time grows with the accounted steps: refused before any search.
        check_accounted_steps(options.epochs * shape.accounted_steps_per_epoch, epochs=options.epochs)
    if options.max_batch_size is not None:
        # Raises NotImplementedError naming PLDAccountant if this accountant cannot account for it.
        accountant.fresh().step(noise_multiplier=1.0, sample_rate=0.5, num_steps=0, group_size=1,
                                max_batch_size=options.max_batch_size)  # fmt: skip
    choice = _choose_noise(options, shape, accountant=accountant, secure_mode=secure_mode, params=params)
    private_loader = _private_loader(data_loader, options, shape, num_bands=choice.num_bands,
                                     secure_mode=secure_mode, job=job, users=users)  # fmt: skip
    noise_plan = _noise_plan(options, shape, choice, private_loader, accountant)
    # Accepted, but likely not what the user wants: said once everything else has been checked.
    warn_if_delta_too_large(options.target_delta, shape.num_examples)
    if options.target is not None and noise_plan.num_bands == 1 and noise_plan.mechanism != "blt":
        warn_if_noise_drowns_the_gradient(noise_multiplier=noise_plan.noise_multiplier, target=options.target,
                                          expected_batch_size=noise_plan.expected_batch_size,
                                          steps=options.epochs * shape.accounted_steps_per_epoch)  # fmt: skip
    return Plan(
        options=options, model=model, optimizer=optimizer, private_loader=private_loader, params=params,
        groups=groups, make_noise=choice.make_noise, distributed=job, noise_plan=noise_plan,
        input_canaries=input_canaries,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- the objects
def _check_objects(model: Any, optimizer: Any, data_loader: Any) -> tuple[nn.Module, Optimizer, DataLoader]:
    if model is None or optimizer is None or data_loader is None:
        named = (("module", model), ("optimizer", optimizer), ("data_loader", data_loader))
        missing = [name for name, value in named if value is None]
        raise TypeError(f"make_private needs {', '.join(missing)}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"module must be an nn.Module; got {type(model).__name__}")
    check_wrapped_optimizer(optimizer)  # a first-order torch optimizer, as DPOptimizer checks it
    if isinstance(optimizer, DPOptimizer):
        raise TypeError("optimizer is already a DPOptimizer: pass the original optimizer")
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch.utils.data.DataLoader; got {type(data_loader).__name__}")
    if isinstance(data_loader, DPDataLoader):
        # A loader an earlier make_private returned (a script passes it again on a second run, as Opacus allows):
        # planned from the plain loader it stands for (same examples, expected batch size).
        data_loader = plain_loader_for(data_loader)
    return model, optimizer, data_loader


def _check_parameters(model: nn.Module, optimizer: Optimizer) -> list:
    """The optimizer's trainable parameters, which must be exactly the model's trainable ones."""
    model_params = {id(p) for p in model.parameters()}
    params = trainable_parameters(optimizer)
    for position, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        if id(param) not in model_params:
            raise ValueError(
                f"optimizer parameter #{position} (shape {tuple(param.shape)}) is not a parameter of the module: "
                f"build the optimizer from this module's parameters"
            )
    if not params:
        raise ValueError("optimizer has no parameter with requires_grad=True: nothing to train")
    in_optimizer = {id(p) for p in params}
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in in_optimizer:
            raise ValueError(
                f"module parameter {name!r} requires grad but is not in the optimizer: its per-sample "
                f"gradients would pile up unused. Freeze it (requires_grad_(False)) or add it to the optimizer."
            )
    return params


def _clipping_groups(model: nn.Module, params: list, options: PrivacyOptions) -> list | None:
    """Per-layer clipping: one group per bound (the bounds themselves are checked by the options)."""
    if options.clipper_mode == "flat":
        return None
    layers = parameter_groups(model, params, per="layer")
    bounds = options.max_grad_norm
    if isinstance(bounds, numbers.Real) and not isinstance(bounds, bool):
        return layers  # one bound, split evenly over the layers
    if len(bounds) == len(layers):
        return layers
    if len(bounds) == len(params):
        return [[p] for p in params]
    raise ValueError(
        f"max_grad_norm has {len(bounds)} bounds; clipping='per_layer' needs one per layer "
        f"({len(layers)} layers own trainable parameters) or one per trainable parameter ({len(params)})"
    )


def _loader_shape(data_loader: DataLoader, options: PrivacyOptions) -> LoaderShape:
    """The examples and steps the plan counts with: a sized, map-style dataset (Poisson and cyclic
    sampling index into it)."""
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(type(dataset), "__len__"):
        why = (
            "cyclic Poisson sampling (noise_mechanism='bandmf') splits the examples into fixed groups and "
            "samples each one independently"
            if options.wants_bandmf
            else "the sample rate and Poisson sampling need the number of examples"
        )
        raise TypeError(
            f"data_loader.dataset ({type(dataset).__name__}) must be a sized, map-style dataset (len(dataset) and "
            f"dataset[i]): {why}"
        )
    if len(data_loader) < 1:
        raise ValueError("data_loader is empty")
    if data_loader.batch_size is None:
        raise ValueError(
            "data_loader.batch_size is None: build the loader with batch_size set (the expected batch size)"
        )
    num_examples, batch_size, steps_per_epoch = len(dataset), int(data_loader.batch_size), len(data_loader)
    if options.poisson_sampling:
        # Poisson sampling stays within the loader's own examples (a SubsetRandomSampler's split);
        # samplers without a Poisson equivalent (weighted sampling) raise here, before any wrapping.
        index_set = loader_index_set(data_loader)
        num_examples = num_examples if index_set is None else int(index_set.numel())
    private_steps_per_epoch = max(1, round(num_examples / batch_size))
    return LoaderShape(
        num_examples=num_examples, batch_size=batch_size, loader_steps_per_epoch=steps_per_epoch,
        private_steps_per_epoch=private_steps_per_epoch,
        accounted_steps_per_epoch=private_steps_per_epoch if options.poisson_sampling else steps_per_epoch,
    )  # fmt: skip


def _users(data_loader: DataLoader, options: PrivacyOptions, shape: LoaderShape, *,
           job: distributed.DistributedJob | None) -> tuple[UserAssignment | None, LoaderShape]:  # fmt: skip
    """``privacy_unit="user"``: the users of the loader's examples, and the loader's shape counted in users
    (the sampled unit: ``num_examples`` is the number of users, an epoch ``round(users / batch_size)``
    steps). ``(None, shape)`` for examples. Refuses a batch size above the number of users. Under DDP the
    users are those of the whole dataset on every rank (``user_sampling.distributed_user_level_loader`` gives
    each rank its own)."""
    if options.privacy_unit != "user":
        return None, shape
    users = assignment_for_loader(data_loader, options.user_ids)
    if shape.batch_size > users.num_users:
        raise ValueError(
            f"data_loader.batch_size={shape.batch_size} exceeds the {users.num_users} users: with privacy_unit='user' "
            f"the batch size is the expected number of users per batch (q = batch_size / users must be <= 1)"
        )
    steps = max(1, round(users.num_users / shape.batch_size))
    return users, dataclasses.replace(shape, num_examples=users.num_users, private_steps_per_epoch=steps,
                                      accounted_steps_per_epoch=steps)  # fmt: skip


def _with_input_canaries(data_loader: DataLoader, options: PrivacyOptions, *, secure_mode: bool,
                         job: distributed.DistributedJob | None) -> tuple[InputCanaries | None, DataLoader]:  # fmt: skip
    """``audit=AuditConfig(kind="input")``: the canaries, and a loader like ``data_loader`` over its dataset
    followed by the included canaries (``CanaryDataset``); otherwise ``(None, data_loader)``. The canaries are
    seeded from ``audit.seed``, else one draw from torch's global generator (secure mode: the OS, and the
    inclusion too). Raises (nothing built) where a canary could not be sampled exactly as an example."""
    audit = options.audit
    if audit is None or audit.kind != "input":
        return None, data_loader
    if job is not None:
        raise ValueError(
            'audit=AuditConfig(kind="input") with DDP is refused: each rank would have to append the same canaries '
            "(drawn once and broadcast, the OS's in secure mode) to its dataset; not implemented. Use "
            'kind="gradient" (added once per release on rank 0) or one process'
        )
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(type(dataset), "__len__"):
        raise TypeError(
            f'audit=AuditConfig(kind="input") needs data_loader.dataset ({type(dataset).__name__}) to be a sized, '
            "map-style dataset (len(dataset) and dataset[i]): the canaries are appended to it and sampled as its examples"
        )
    if len(dataset) < 1:
        raise ValueError("data_loader is empty")
    seed = audit.canary_seed(secure_mode=secure_mode)
    canaries = InputCanaries(
        audit.num_canaries, seed, example_like=None if audit.canary_fn is not None else dataset[0],
        num_classes=audit.num_classes, canary_fn=audit.canary_fn, score_fn=audit.score_fn, secure_mode=secure_mode,
    )  # fmt: skip
    augmented = CanaryDataset(dataset, canaries)
    kwargs = DPDataLoader._loader_kwargs(data_loader)
    sampler = data_loader.sampler
    if isinstance(sampler, SubsetRandomSampler):
        # The loader's split, and every appended canary (they belong to no other split).
        indices = [int(i) for i in sampler.indices] + list(range(augmented.num_real, len(augmented)))
        loader = DataLoader(augmented, batch_size=data_loader.batch_size,
                            sampler=SubsetRandomSampler(indices), **kwargs)  # fmt: skip
    else:
        # Sequential / shuffled loaders; other samplers are refused by the loader's shape, as without canaries.
        loader_index_set(data_loader)
        loader = DataLoader(augmented, batch_size=data_loader.batch_size, **kwargs)
    return canaries, loader


# ---------------------------------------------------------------------------------------------- the noise
def _noise_seed(options: PrivacyOptions) -> int | None:
    if options.noise_generator is not None:
        # One draw from the generator seeds the noise (Opacus draws its noise from the generator itself).
        return int(torch.randint(0, 2**62, (1,), generator=options.noise_generator).item())
    return options.noise_seed


def _choose_noise(options: PrivacyOptions, shape: LoaderShape, *, accountant: Accountant,
                  secure_mode: bool, params: list) -> NoiseChoice:  # fmt: skip
    """The noise mechanism: a builder (called only once nothing can fail), its bands and, for
    BandMF without ``num_bands``, the band counts compared and the one chosen."""
    mechanism = options.noise_mechanism
    seed = functools.partial(_noise_seed, options)
    if isinstance(mechanism, NoiseMechanism):
        if mechanism.secure_mode != secure_mode:
            raise ValueError(f"noise_mechanism.secure_mode must match the engine's secure_mode={secure_mode}")
        if mechanism.step != 0:
            raise ValueError("noise_mechanism has already been used; pass a fresh one")
        event = mechanism.privacy_event()  # as it states (one that states nothing is refused here)
        bands = event.num_bands
        if bands > 1:
            check_num_bands(bands, shape)
        coefficients = getattr(mechanism, "coefficients", None)
        return NoiseChoice(
            mechanism="custom", num_bands=bands, stated_event=event, make_noise=lambda: mechanism, total_steps=None,
            coefficients=None if coefficients is None else tuple(float(c) for c in coefficients),
            noise_multiplier=options.sigma,
        )  # fmt: skip
    if mechanism == "gaussian":
        return NoiseChoice(
            mechanism="gaussian", num_bands=1, coefficients=None, total_steps=None, noise_multiplier=options.sigma,
            make_noise=lambda: GaussianNoise(seed=seed(), secure_mode=secure_mode, noise_stream=options.noise_stream),
        )  # fmt: skip
    if mechanism == "blt":
        return plan_blt(options, shape, seed=seed, secure_mode=secure_mode)
    if mechanism == "auto":
        # One noise vector over the trainable parameters, in the dtype the noise is drawn in.
        parameter_bytes = noise_vector_bytes(params)
        return plan_auto(options, shape, accountant=accountant, parameter_bytes=parameter_bytes, seed=seed,
                         secure_mode=secure_mode)  # fmt: skip
    return plan_bandmf(options, shape, accountant=accountant, seed=seed, secure_mode=secure_mode)


# ---------------------------------------------------------------------------------------------- sampling
def _private_loader(data_loader: DataLoader, options: PrivacyOptions, shape: LoaderShape, *, num_bands: int,
                    secure_mode: bool, job: distributed.DistributedJob | None,
                    users: UserAssignment | None = None) -> DataLoader:  # fmt: skip
    """Poisson sampling (DP-SGD), Poisson sampling over ``users`` (user-level), cyclic Poisson sampling over
    ``num_bands`` groups (BandMF) or truncated sampling; the loader itself without Poisson sampling."""
    sampling_generator = options.noise_generator
    seed_lazily = False
    if secure_mode:
        # Every sampling choice straight from the OS (manual_seed would keep 32 bits of a seed); the
        # loader's own generator= is not used either.
        sampling_generator = SecureGenerator()
    elif sampling_generator is None:
        # The sampler's own generator, seeded by one draw from the user's DataLoader(generator=...) when there
        # is one (it drives the sampling, as in Opacus), else from torch's global generator (torch.manual_seed
        # still makes the run reproducible). Its own state is checkpointed, and other draws from the source
        # (every DataLoader iterator takes one for its base seed) do not shift the batches, so a resume is
        # exact. Poisson sampling draws that seed at the first batch, so a (generator.)manual_seed after
        # make_private counts; cyclic groups are drawn here (the truncation's calibration needs them) and
        # user-level sampling shuffles each user's examples at construction: those are seeded now.
        source = data_loader.generator
        sampling_generator = torch.Generator()
        if num_bands > 1 or options.max_batch_size is not None or users is not None:
            sampling_generator.manual_seed(int(torch.randint(0, 2**62, (1,), generator=source).item()))
        else:
            seed_lazily = True
    steps = shape.private_steps_per_epoch
    if users is not None and job is not None:
        # Each rank samples its own users (u mod world_size) at the global rate; collective (agrees on a seed).
        return distributed_user_level_loader(data_loader, users, job, examples_per_user=options.examples_per_user,
                                             shuffle=options.shuffle_user_examples, steps=steps,
                                             num_groups=num_bands, secure=secure_mode)  # fmt: skip
    if users is not None:
        return user_level_loader(data_loader, users, examples_per_user=options.examples_per_user,
                                 shuffle=options.shuffle_user_examples, generator=sampling_generator, steps=steps,
                                 num_groups=num_bands)  # fmt: skip
    if job is not None:
        # Each rank samples its part of one global (cyclic) Poisson sample; collective (agrees on a seed).
        return job.private_loader(data_loader, num_groups=num_bands, max_batch_size=options.max_batch_size,
                                  poisson_sampling=options.poisson_sampling, steps=steps)  # fmt: skip
    if num_bands > 1 or options.max_batch_size is not None:
        # The group counter runs on across epochs, so an epoch need not be a multiple of b.
        return DPDataLoader.cyclic(data_loader, num_bands, max_batch_size=options.max_batch_size,
                                   generator=sampling_generator, steps=steps)  # fmt: skip
    if options.poisson_sampling:
        private = DPDataLoader.from_data_loader(data_loader, generator=sampling_generator)
        if seed_lazily:
            private.batch_sampler.seed_lazily(source=data_loader.generator)
        return private
    return data_loader


def _noise_plan(options: PrivacyOptions, shape: LoaderShape, choice: NoiseChoice, private_loader: DataLoader,
                accountant: Accountant) -> NoisePlan:  # fmt: skip
    """The sampling the private loader runs, and the noise multiplier: given, or calibrated for
    the mechanism now fixed over ``epochs`` epochs of accounted steps."""
    if isinstance(private_loader, DPDataLoader):
        sample_rate, expected_batch_size = private_loader.sample_rate, private_loader.expected_batch_size
    else:
        sample_rate, expected_batch_size = 1.0 / shape.loader_steps_per_epoch, float(shape.batch_size)
    group_size = None
    noise_multiplier, calibrated_steps = choice.noise_multiplier, None
    if options.target is not None:
        calibrated_steps = options.epochs * shape.accounted_steps_per_epoch
    if options.max_batch_size is not None:
        # Truncation's privacy depends on the number of examples sampled from, not monotonically:
        # accounted at the realised group size with the largest epsilon (every group is covered).
        group_size, noise_multiplier = worst_group_size(
            (group.numel() for group in private_loader.batch_sampler.groups), accountant=accountant,
            target=options.target, noise_multiplier=noise_multiplier, sample_rate=sample_rate,
            steps=calibrated_steps or choice.total_steps or len(private_loader), event=choice.event,
            max_batch_size=options.max_batch_size, delta=options.target_delta,
        )  # fmt: skip
    elif options.target is not None:
        noise_multiplier = calibrate(accountant, options.target, sample_rate, calibrated_steps,
                                     event=choice.event, group_size=None, max_batch_size=None)  # fmt: skip
    # Validates what the accountant will be given, recording nothing.
    accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=0, group_size=group_size,
                    max_batch_size=options.max_batch_size, **choice.event.step_kwargs())  # fmt: skip
    return NoisePlan(
        mechanism=choice.mechanism, num_bands=choice.num_bands, noise_multiplier=noise_multiplier,
        sample_rate=sample_rate, expected_batch_size=expected_batch_size, coefficients=choice.coefficients,
        total_steps=choice.total_steps or calibrated_steps, group_size=group_size,
        max_batch_size=options.max_batch_size, candidates=choice.candidates, num_buffers=choice.num_buffers,
        mechanism_candidates=choice.mechanism_candidates,
    )  # fmt: skip
