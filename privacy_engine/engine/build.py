"""From a checked ``Plan`` to the private objects: the DP optimizer (clipper, noise, ledger,
budget, grad scaler), then the wrapped model, last, because wrapping hooks the model; then the engine
connects the three (``connect_private``: this wrapper, this optimizer and this loader, nothing else)."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

from accountants import Accountant
from privacy_engine.auditing.canaries import GradientCanaries
from privacy_engine.auditing.input_canaries import InputCanaries
from privacy_engine.clipping import PerSampleGradientClipper
from privacy_engine.engine.budget import PrivacyBudget
from privacy_engine.engine.connect import connect_private
from privacy_engine.engine.ledger import ledger_for
from privacy_engine.engine.options import PrivacyOptions
from privacy_engine.engine.plan import Plan
from privacy_engine.training import distributed
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.optimizer import DPOptimizer
from privacy_engine.training.optimizer_arguments import build_adaptive_clipping
from privacy_engine.training.sampling import ShuffledBatches

__all__ = ["private_optimizer", "wrap_model"]


def private_optimizer(plan: Plan, *, accountant: Accountant, secure_mode: bool, budget: PrivacyBudget | None,
                      source: str) -> DPOptimizer:  # fmt: skip
    """The ``DPOptimizer`` of ``plan``, recording its steps as ``source`` in ``accountant``.
    Changes neither the model nor the accountant (distributed: agrees with the other ranks first,
    a collective that raises on all of them if their plans differ)."""
    if plan.distributed is not None:
        # Every rank must plan the same mechanism: compared across ranks (collective), raising on all.
        distributed.agree(plan, accountant=accountant, secure_mode=secure_mode)
    options, noise_plan, loader = plan.options, plan.noise_plan, plan.private_loader
    clipper = PerSampleGradientClipper(
        plan.params,
        options.max_grad_norm,
        clipping=options.clipper_mode,
        groups=plan.groups,
        nan_safe=options.nan_safe,
        rescale_to_unit_norm=options.rescale_to_unit_norm,
    )
    noise = plan.make_noise()
    if options.adaptive_clipping is not None:
        # After the noise mechanism: an unseeded count generator takes its seed from torch's global generator.
        clipper = build_adaptive_clipping(clipper, options.adaptive_clipping, noise_seed=_count_seed(options),
                                          secure_mode=secure_mode)  # fmt: skip
    sampled = isinstance(loader, DPDataLoader)
    canaries = audit_canaries(plan, secure_mode=secure_mode)
    if not sampled:
        warnings.warn(
            "poisson_sampling=False: batches are the loader's own (shuffled, fixed size), but the accountant "
            "treats them as Poisson samples with rate 1/len(loader) (k batches in one step: rate k/len(loader)); "
            "the reported epsilon is an approximation"
        )
    optimizer = plan.classes.optimizer(
        plan.optimizer,
        noise_multiplier=noise_plan.noise_multiplier,
        expected_batch_size=noise_plan.expected_batch_size,
        loss_reduction=options.loss_reduction,
        clipper=clipper,
        noise=noise,
        accountant=ledger_for(accountant, noise_plan),
        sample_rate=noise_plan.sample_rate,
        padding_mask_source=(lambda: loader.padding_mask) if sampled else None,
        source=source,
        per_user_clipping=False,
        budget=budget,
        # Only with an audit, so that the optimizer classes of the Opacus namespace are called as before.
        **({} if canaries is None else {"canaries": canaries}),
    )
    if isinstance(canaries, InputCanaries):
        # Examples of the loader's dataset: only the releases are counted (scored on the trained model).
        optimizer.attach_step_hook(canaries.count_release)
    elif canaries is not None:
        # Scored after the noise, from what is released (a public step hook: it sees nothing un-noised).
        optimizer.attach_step_hook(canaries.score_release)
    if options.privacy_unit == "user":
        # Its passes are clipped per user from each batch's ticket; per-sample gradients no user-level batch
        # explains are refused (DPOptimizer.clip_and_accumulate).
        optimizer.privacy_unit = "user"
    if not sampled:
        # The loader's own fixed-size batches: a release of k of them is k disjoint draws of one epoch.
        optimizer.shuffled_batches = ShuffledBatches(batch_size=int(loader.batch_size), batches_per_epoch=len(loader))
    if plan.distributed is not None:
        # Noise drawn on rank 0, then one all-reduce of clipped sums + noise per global step.
        distributed.configure(optimizer, plan.distributed)
    if options.grad_scaler is not None:
        optimizer.attach_grad_scaler(options.grad_scaler)
    return optimizer


def audit_canaries(plan: Plan, *, secure_mode: bool) -> GradientCanaries | InputCanaries | None:
    """The canaries of ``plan.options.audit`` (None without an audit). Input canaries: the plan's (already in
    its loader's dataset; in the optimizer only for their state). Gradient canaries: over the plan's private
    parameters, one cyclic group each among the noise's bands. Seeded from ``audit.seed``, else one draw from
    torch's global generator (taken after the loader's, so an audited run samples the same batches as one
    without); secure mode: the OS. DDP: every rank holds them, only rank 0 adds them (the clipped sums are
    all-reduced after, so they are in each release once); every rank scores the same reduced release."""
    audit = plan.options.audit
    if audit is None:
        return None
    if audit.kind == "input":
        return plan.input_canaries
    seed = audit.canary_seed(secure_mode=secure_mode)
    return GradientCanaries(
        audit.num_canaries, sum(p.numel() for p in plan.params), seed, directions=audit.directions,
        num_groups=plan.noise_plan.num_bands, secure_mode=secure_mode,
        adds_contributions=plan.distributed is None or plan.distributed.rank == 0,
    )  # fmt: skip


def _count_seed(options: PrivacyOptions) -> int | None:
    """The seed of adaptive clipping's count noise: ``noise_seed``, or one draw from ``noise_generator`` (as
    the noise mechanism takes one), or None (torch's global generator; secure mode: the OS)."""
    if options.noise_seed is not None or options.noise_generator is None:
        return options.noise_seed
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=options.noise_generator).item())


def wrap_model(plan: Plan, optimizer: DPOptimizer) -> tuple[nn.Module, DPOptimizer, DataLoader]:
    """Hook the model for ``plan.options.grad_sample_mode``, connect it to ``optimizer`` and the private
    loader, and return ``(module, optimizer, loader)`` in every mode: ``module`` is a
    ``GradSampleModule`` ("hooks", "functorch", "ew"), a ``GhostClippingModule`` ("ghost", with
    ``optimizer.clipper`` attached) or a ``ManualGradSampleModule`` ("no_op"); ``optimizer`` is the one
    given; ``loader`` is ``plan.private_loader``. Unlike Opacus's ghost mode, no criterion is wrapped
    or returned: clipping happens inside the ordinary backward pass."""
    options, loader = plan.options, plan.private_loader
    classes = plan.classes
    # "hooks", "functorch" and "ew" hook the model; "ghost" clips in backward; "no_op" leaves it to the loop.
    wrapper_class = {"no_op": classes.manual, "ghost": classes.ghost}.get(options.grad_sample_mode, classes.hooks)
    wrapped = wrapper_class(plan.model, batch_first=options.batch_first, loss_reduction=options.loss_reduction)
    # The engine owns the binding: this wrapper, this optimizer and (Poisson sampling) this loader, for good.
    # Without Poisson sampling the loader's plain batches carry no ticket: no loader is attached.
    try:
        connect_private(wrapped, optimizer, loader if isinstance(loader, DPDataLoader) else None)
    except BaseException:
        wrapped.to_standard_module()  # the model as it was given: hooks and marks removed
        raise
    return wrapped, optimizer, loader
