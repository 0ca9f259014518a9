"""DPOptimizer: any ``torch.optim.Optimizer`` turned into a differentially private one.

One logical step is: clip every example's gradient and sum (``PerSampleGradientClipper``), add
Gaussian (or BandMF) noise to the sum once (the noise mechanism), divide by the expected batch
size, record the step with the accountant, and let the wrapped optimizer update the parameters
from these private gradients. Everything else (param_groups, state, LR schedulers, hooks) is the
wrapped optimizer's.

The step itself is here; its parts are next to it in ``privacy_engine/training/``:

* ``optimizer_arguments.py``: the checks on the constructor's arguments;
* ``parameter_sync.py``: which parameters are private (frozen / unfrozen during training);
* ``release_checks.py``: the checks before a release, BandMF noise rows, what the accountant records;
* ``loss_scaling.py``: fp16 loss scaling with ``torch.amp.GradScaler``;
* ``optimizer_state.py``: ``state_dict`` / ``load_state_dict`` (checkpoints);
* ``step_contract.py``: which batches and backward passes one step contains.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

from privacy_engine.batches.tickets import BatchTicket
from privacy_engine.capture.step_binding import wrapper_holding
from privacy_engine.clipping import AdaptiveClippingOptions, ClippingStats, MaxGradNorm, PerSampleGradientClipper
from privacy_engine.clipping.per_user import user_group_ids
from privacy_engine.interrupts import deferred_signals
from privacy_engine.noise import NoiseMechanism
from privacy_engine.training.canary_slot import CanarySlot, ClippedSumCanaries
from privacy_engine.training.loss_scaling import LossScaling
from privacy_engine.training.optimizer_arguments import (
    build_adaptive_clipping,
    build_clipper,
    build_noise,
    check_accounting,
    check_loss_reduction,
    check_noise_multiplier,
    check_sensitivity,
    check_wrapped_optimizer,
    trainable_parameters,
)
from privacy_engine.training.optimizer_state import STATE_DICT_KEY, OptimizerState
from privacy_engine.training.parameter_sync import OWN_IDS_ATTRIBUTE, ParameterSync, parameter_ids
from privacy_engine.training.release_checks import ReleaseChecks
from privacy_engine.training.sampling import ShuffledBatches
from privacy_engine.training.schedules import checked_clip_bounds, checked_noise_multiplier
from privacy_engine.training.step_contract import Release, StepContract

__all__ = ["STATE_DICT_KEY", "DPOptimizer", "trainable_parameters"]

# C-level getters for the per-parameter passes of a step (one map over the parameters instead of a Python loop).
_GRAD, _VERSION = operator.attrgetter("grad"), operator.attrgetter("_version")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_is_not_none = functools.partial(operator.is_not, None)
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled  # what torch.no_grad() calls
#: Whether torch keeps its global step hooks in the module-level tables read below (else torch's own wrapper runs).
_GLOBAL_HOOK_TABLES = hasattr(torch_optimizer, "_global_optimizer_pre_hooks") and hasattr(
    torch_optimizer, "_global_optimizer_post_hooks"
)


class DPOptimizer(ParameterSync, ReleaseChecks, LossScaling, OptimizerState, Optimizer):
    """Differentially private wrapper around ``optimizer`` (SGD, Adam, AdamW, ...).

    ``step()`` does, for one logical batch: (1) ``clip_and_accumulate`` if per-sample gradients
    are waiting; (2) unless ``signal_skip_step()`` asked to skip (a micro-batch of a larger
    logical batch, see ``virtual_steps``), write the clipped sum into ``.grad``, add noise of
    standard deviation ``noise_multiplier * sensitivity`` to every entry, record the step with the
    accountant, divide by ``expected_batch_size`` (``loss_reduction="mean"``) and call the wrapped
    optimizer's ``step()``.

    Guarantee: every step that is not skipped releases ``sum_i clip(g_i) + N(0, (sigma C)^2 I)``
    (C the clipper's sensitivity), whatever the gradients, and is recorded with the accountant
    (sample_rate, noise_multiplier, the event the mechanism states). The ``.grad`` the wrapped
    optimizer sees is never the raw gradient from ``backward``: it is overwritten at every step.

    ====================================  ==============================================
    case                                  result
    ====================================  ==============================================
    empty batch (no per-sample grads)     noise alone is added, the step is recorded
    step() after signal_skip_step()       clip and accumulate only: no noise, no record
    noise_multiplier = 0                  no noise; the accountant reports epsilon = inf
    sensitivity inf and noise_mult. > 0   ValueError at construction
    a parameter never used in forward     zero gradient plus noise (it is still updated)
    frozen parameter (requires_grad off)  read at every forward and step: no clipping, no
                                          noise, no update; unfrozen later: clipped and
                                          noised from then on (``sync_private_parameters``)
    closure given                         evaluated once (with grad), then as above
    zero_grad() between micro-batches     keeps the accumulated sum of the logical step
    gradients without per-sample ones     RuntimeError (eval mode, unwrapped model), nothing
                                          released or counted
    several loader batches in one step    each clipped on its own; accounted as k draws in one
                                          release; divided by k * expected_batch_size
                                          (``shuffled_batches``, no Poisson sampling: one
                                          step at min(1, k q), ``ShuffledBatches``)
    ====================================  ==============================================

    Which batches, backward passes and parameters one step contains, and every check made before
    a release, are the step contract's: see ``privacy_engine.training.step_contract`` for the table of loop
    patterns (accumulation, unfreezing, eval, exceptions, skipping, look-ahead, several optimizers).

    Args:
        optimizer: the optimizer to wrap. Its trainable parameters (``requires_grad``) at
            construction are the ones clipped and noised.
        noise_multiplier: sigma, the noise std in units of the clipping sensitivity.
        max_grad_norm: clipping bound(s), see ``PerSampleGradientClipper`` (ignored if
            ``clipper`` is given).
        expected_batch_size: the expected number of examples per logical batch (users, with
            per-user clipping); the noisy sum is divided by it for ``loss_reduction="mean"``.
        clipping: ``"flat"`` or ``"per_layer"`` (ignored if ``clipper`` is given; per_layer then
            uses one group per parameter).
        loss_reduction: ``"mean"`` or ``"sum"``, as given to ``GradSampleModule``.
        clipper: a ready ``PerSampleGradientClipper`` over exactly these parameters.
        noise: a ``NoiseMechanism`` (default ``GaussianNoise(seed=noise_seed, secure_mode=...)``).
        noise_seed: seed of the default Gaussian noise (``None``: one draw from torch's global generator at the
            first step, so ``torch.manual_seed`` before the first step repeats the run; OS entropy in secure mode).
        secure_mode: OS-entropy noise only; a ``noise_seed`` raises.
        accountant: records every released step (``step(noise_multiplier=, sample_rate=,
            **noise.privacy_event().step_kwargs())``); ``None`` for no accounting.
        sample_rate: the sampling probability recorded with each step (needed with an accountant).
        padding_mask_source: callable giving the padding mask of the batch being clipped (the
            engine passes ``lambda: loader.padding_mask``); ``None`` for no padding.
        budget: a ``privacy_engine.engine.budget.PrivacyBudget`` (needs an accountant): each release is
            checked against it first and refused with ``PrivacyBudgetExceeded``; ``None``: none.
        adaptive_clipping: ``AdaptiveClippingOptions`` for adaptive clipping (``privacy_engine.clipping.adaptive``):
            the clipper's bounds become clip norms that track a quantile of the per-example norms; each release
            also releases the noised count of unclipped examples (noise drawn from a stream of ``noise_seed``,
            or the OS in secure mode) and the sum is noised at ``gradient_noise_multiplier`` (sigma_delta), so
            that the pair is recorded as one step at ``noise_multiplier``. With BandMF noise the mechanism's
            ``clip_norm_may_change`` is set: row t is scaled by the clip norm in force (BandMF's history keeps one
            scale), and the pair is recorded as one BandMF step at ``noise_multiplier``.
        canaries: an audit's canaries (``training.canary_slot.ClippedSumCanaries``, built by the engine
            for ``make_private(audit=...)``): called once per release to add their contributions to the
            clipped sums before the noise; counted in no accounting (they are not data). ``None``: none.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: MaxGradNorm | None = None,
        expected_batch_size: float | None = None,
        clipping: str = "flat",
        loss_reduction: str = "mean",
        clipper: PerSampleGradientClipper | None = None,
        noise: NoiseMechanism | None = None,
        noise_seed: int | None = None,
        secure_mode: bool = False,
        accountant: Any | None = None,
        sample_rate: float | None = None,
        padding_mask_source: Callable[[], torch.Tensor | None] | None = None,
        source: str = "",
        per_user_clipping: bool = True,
        budget: Any | None = None,
        adaptive_clipping: AdaptiveClippingOptions | None = None,
        canaries: ClippedSumCanaries | None = None,
    ) -> None:
        check_wrapped_optimizer(optimizer)
        if canaries is not None and not isinstance(canaries, ClippedSumCanaries):
            raise TypeError(f"canaries must implement training.canary_slot.ClippedSumCanaries; got {canaries!r}")
        if isinstance(optimizer, DPOptimizer):
            raise TypeError("optimizer is already a DPOptimizer; wrap the original optimizer once")
        noise_multiplier = check_noise_multiplier(noise_multiplier)
        check_loss_reduction(loss_reduction, expected_batch_size)
        clipper = build_clipper(trainable_parameters(optimizer), clipper, max_grad_norm, clipping)
        noise = build_noise(noise, noise_seed, secure_mode)
        if adaptive_clipping is not None:
            # After the noise (an unseeded count generator draws its seed from torch's global generator).
            clipper = build_adaptive_clipping(clipper, adaptive_clipping, noise_seed=noise_seed, secure_mode=secure_mode)
        check_sensitivity(noise_multiplier, clipper, expected_batch_size)
        # What the mechanism states each step is (a mechanism that states nothing is refused here, before
        # anything is released or counted); every release records exactly this.
        privacy_event = noise.privacy_event()
        # Correlated noise (BandMF) with adaptive clipping: its rows combine earlier rows' noise, so a clip norm that
        # moves each step needs the mechanism to keep its history in one scale and rescale only the row it adds (row
        # t times C_t: the matrix mechanism on the normalised stream G_t / C_t, post-processed by the public C_t).
        correlated_adaptive = clipper.adaptive is not None and privacy_event.num_bands > 1
        if correlated_adaptive and not isinstance(getattr(noise, "clip_norm_may_change", None), bool):
            raise ValueError(
                f"adaptive clipping with {type(noise).__name__}: its noise is correlated across steps "
                f"(num_bands={privacy_event.num_bands}) and it has no clip_norm_may_change switch to rescale "
                "each row by the clip norm in force. Use BandMFNoise or GaussianNoise with adaptive clipping."
            )
        check_accounting(
            accountant=accountant, sample_rate=sample_rate, noise_multiplier=noise_multiplier,
            privacy_event=privacy_event,
            padding_mask_source=padding_mask_source, budget=budget,
        )  # fmt: skip
        if correlated_adaptive:
            noise.clip_norm_may_change = True  # the clip norms are public: set from earlier released counts only

        self._init_hook_tables()
        self.original_optimizer = optimizer
        self.clipper = clipper
        self.noise = noise
        self.noise_multiplier = noise_multiplier
        #: The sigma this optimizer was built with (a schedule changes ``noise_multiplier``, not this); a checkpoint
        #: saved at another one is a resume at a changed sigma (``load_state_dict`` keeps this run's).
        self.initial_noise_multiplier = noise_multiplier
        self.expected_batch_size = None if expected_batch_size is None else float(expected_batch_size)
        self.loss_reduction = loss_reduction
        self.accountant = accountant
        self.sample_rate = None if sample_rate is None else float(sample_rate)
        #: The noise mechanism's privacy event (``NoiseMechanism.privacy_event``), recorded with every release.
        self.privacy_event = privacy_event
        self.num_bands = privacy_event.num_bands
        self.padding_mask_source = padding_mask_source
        self.last_clipping_stats: ClippingStats | None = None
        self.steps_taken = 0  # released (noised) steps
        self._skip_next_step = False
        self._in_logical_step = False  # a skipped step left clipped sums for the next one
        #: What the open step contains and the checks before a release (privacy_engine.training.step_contract).
        self.contract = StepContract()
        #: Accountant entries of this optimizer are tagged with it, so several private optimizers on one
        #: accountant compose as separate mechanisms.
        self.source = str(source)
        #: Whether ``clip_and_accumulate(group_ids=...)`` is allowed: the engine's optimizers sample and
        #: account per example, so per-user clipping would be accounted wrongly there.
        self.per_user_clipping = bool(per_user_clipping)
        #: ``"user"`` when the engine built this optimizer for user-level privacy (``privacy_unit="user"``): every
        #: pass is then clipped per user from its batch's ticket, and per-sample gradients no user-level batch
        #: explains are refused; ``"example"`` otherwise.
        self.privacy_unit = "example"
        #: A privacy budget consulted before every release (privacy_engine.engine.budget); None for none.
        self.budget: Any | None = budget
        #: An audit's canaries (make_private(audit=...)): their only operation is to add their own contributions to
        #: the clipped sums of each release, before the noise; their state is part of the DP state. None: no audit.
        self.canaries: ClippedSumCanaries | None = canaries
        #: Set by the engine for ``poisson_sampling=False``: the loader's fixed-size batches, for accounting
        #: a release of several of them (``ShuffledBatches``); None: releases hold Poisson batches.
        self.shuffled_batches: ShuffledBatches | None = None
        self._all_params = [p for group in optimizer.param_groups for p in group["params"]]
        self._grad_marks: dict[int, tuple[int, int]] = {}  # id(param) -> (id(.grad), version) we left

    def _init_hook_tables(self) -> None:
        # Optimizer.__init__ would build new param_groups; the wrapped optimizer's are used
        # instead, so only the hook tables it sets up are created here.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    def _patch_step_function(self) -> None:
        # Optimizer wraps each class's step once (``profile_hook_step``: its step hooks inside a profiler range).
        # The range costs ~10 us per step even with no profiler recording (the wrapped optimizer's own step opens
        # one too): this class's step runs exactly torch's wrapper whenever a profiler records or a step hook is
        # registered, and else the step alone (``_profiled_only_when_needed``).
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        cls = type(self)
        if not getattr(cls.step, "hooked", False):
            cls.step = _profiled_only_when_needed(cls.step)

    def __getstate__(self) -> dict[str, Any]:
        # Optimizer.__getstate__ keeps only defaults/state/param_groups; a copy needs everything but the ids of
        # this object's parameters (a copy's are other objects: ParameterSync._own_parameter_ids builds them anew).
        state = dict(self.__dict__)
        state.pop(OWN_IDS_ATTRIBUTE, None)
        return state

    # ------------------------------------------------------------------ the wrapped optimizer
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` (read and set through to it)."""
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state`` (read and set through to it)."""
        return self.original_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's ``defaults`` (read and set through to it)."""
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.original_optimizer.defaults = value

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters that are clipped and noised."""
        return self.clipper.params

    @property
    def gradient_noise_multiplier(self) -> float:
        """The noise multiplier the clipped sum is noised at: ``noise_multiplier``, or with adaptive clipping
        sigma_delta > sigma (``clipping.adaptive.gradient_noise_multiplier``), so that the sum and the count of
        unclipped examples together cost one step at ``noise_multiplier``, the sigma the accountant records."""
        adaptive = self.clipper.adaptive
        return self.noise_multiplier if adaptive is None else adaptive.gradient_noise_multiplier(self.noise_multiplier)

    @property
    def noise_multiplier(self) -> float:
        """sigma, the noise multiplier of the next release (and the one the accountant records for it).

        Settable between steps (a noise schedule, ``privacy_engine.training.schedules``): each release is noised
        at and recorded with the sigma in force when it is released. Refused, before anything changes: a
        changed sigma with correlated noise (BandMF), an invalid sigma (see ``schedules``'s table)."""
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self._noise_multiplier = checked_noise_multiplier(self, value)

    @property
    def max_grad_norm(self) -> MaxGradNorm:
        """The clipping bound(s) in force: the clipper's ``max_grad_norm``, or the last value a clip-norm
        schedule set (flat: the bound; per-layer: the total bound, or one per group when the configured
        ``max_grad_norm`` gave one per group). Settable between steps (``privacy_engine.training.schedules``):
        examples are clipped at, and the noise is drawn at sigma times, the bound in force at each release.
        Refused, before anything changes: adaptive clipping, clipped sums waiting at the old bound, an invalid
        bound."""
        scheduled = self.clipper._scheduled_bounds
        configured = self.clipper.config.max_grad_norm
        if scheduled is None:
            return configured
        if len(scheduled) == 1:
            return scheduled[0]
        return tuple(scheduled) if isinstance(configured, tuple) else self.clipper.total_bound

    @max_grad_norm.setter
    def max_grad_norm(self, value: MaxGradNorm) -> None:
        bounds = checked_clip_bounds(self, value)
        if self.privacy_event.num_bands > 1 and bounds != tuple(self.clipper.bounds):
            self.noise.clip_norm_may_change = True  # row t scaled by C_t / C_0 (BandMFNoise)
        self.clipper.set_bounds(bounds)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Always ``RuntimeError``: the clipper and the noise are laid out over the parameters given at
        construction, so a parameter added later would be neither clipped nor noised."""
        raise RuntimeError(
            "parameters cannot be added to a DPOptimizer: the clipper and the noise are laid out over "
            "the parameters given at construction. Add the group before making the optimizer private."
        )

    def __repr__(self) -> str:
        return (
            f"DPOptimizer(noise_multiplier={self.noise_multiplier}, max_grad_norm={self.max_grad_norm}, "
            f"expected_batch_size={self.expected_batch_size}, noise={self.noise!r}, "
            f"original_optimizer={self.original_optimizer!r})"
        )

    # ------------------------------------------------------------------ the step contract
    # A wrapper is connected to this optimizer by privacy_engine.connect_private only (make_private calls it):
    # it is then in self.contract.modules. Nothing binds by itself.
    def _check_connected(self, *, at_step: bool = False, grad_samples_waiting: bool | None = None) -> None:
        """Raise before anything is clipped, released or counted if per-sample gradients waiting here come
        from a wrapper this optimizer is not connected to: ``grad_sample`` on a parameter a wrapper holds
        (``capture.step_binding.wrapper_holding``), or, at the step, sums in the clipper that no pass of
        this optimizer's explains (a fast-clipping wrapper sharing the clipper). ``grad_sample`` a loop set
        by hand on parameters no wrapper holds (a bare optimizer) is clipped and released as before.
        ``grad_samples_waiting``: ``_has_grad_samples()`` if the caller just read it (None: read here)."""
        if grad_samples_waiting is None:
            grad_samples_waiting = self._has_grad_samples()
        # Nothing can be refused when no held parameter has grad_sample and the step-time case (sums in the
        # clipper that no pass explains) cannot apply: skip the walk over the connected modules (the usual
        # ghost step: the clipper holds sums, and the pass that put them there contributed).
        explained = not (at_step and self.clipper.has_accumulated and not self.contract.has_contributions)
        if explained and not grad_samples_waiting:
            return  # (no parameter has grad_sample, so no held one has)
        held = [(i, p) for i, p in enumerate(self.clipper.params) if wrapper_holding(p) is not None]
        if not held:
            return
        if explained and all(getattr(p, "grad_sample", None) is None for _, p in held):
            return
        connected = {i for module in self.contract.modules for i in parameter_ids(module)}
        strays = [(i, p) for i, p in held if id(p) not in connected]
        waiting = [(i, p) for i, p in strays if getattr(p, "grad_sample", None) is not None]
        if not waiting and at_step and strays and self.clipper.has_accumulated and not self.contract.has_contributions:
            waiting = strays
        if waiting:
            kind = wrapper_holding(waiting[0][1])
            raise RuntimeError(
                f"optimizer parameters {[i for i, _ in waiting]} hold per-sample gradients of a {kind} that is not "
                f"connected to this optimizer: its forwards were tied to no batch, so what they held is unknown to "
                f"the accounting. Nothing was released or counted. Call privacy_engine.connect_private(module, "
                f"optimizer, data_loader) once after building them (make_private connects what it returns)."
            )

    def attach_loader(self, loader: Any) -> None:
        """Tie this optimizer's steps to the batches of a private loader (``DPDataLoader``): it releases
        that loader's batches only (another loader's are refused at ``step()``); ``ValueError`` if it is
        already tied to another loader."""
        self.contract.attach_queue(loader.tickets)

    def accumulate_pass(self, ticket: BatchTicket) -> None:
        """Clip one completed backward pass's per-sample gradients (``grad_sample``) with its own
        batch's padding mask, and note the batch as part of the open step."""
        if not self._has_grad_samples():
            return  # dropped since (zero_grad): nothing of this pass is released
        self._check_connected()
        padding_mask = ticket.mask() if ticket.tracked else self.current_padding_mask()
        # A user-level draw (privacy_unit="user") says which rows are one user's: their summed gradient is
        # clipped once (a pass cutting a user is refused before anything is clipped).
        self.clipper.clip_and_accumulate(padding_mask=padding_mask, group_ids=user_group_ids(ticket))
        self.contract.contributed(ticket)

    # ------------------------------------------------------------------ DP steps
    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Make the next ``step()`` only clip and accumulate (a micro-batch that does not close
        its logical batch). The step after that releases the sum of all of them at once."""
        self._skip_next_step = bool(do_skip)

    def clip_and_accumulate(
        self, *, padding_mask: torch.Tensor | None = None, group_ids: torch.Tensor | None = None
    ) -> None:
        """Clip the waiting per-sample gradients into the accumulator (see
        ``PerSampleGradientClipper.clip_and_accumulate``). ``padding_mask`` defaults to
        ``padding_mask_source()``. Call it yourself for per-user clipping (``group_ids``)."""
        if group_ids is not None and not self.per_user_clipping:
            raise ValueError(
                "group_ids (per-user clipping) with an optimizer from make_private: its loader samples and its "
                "accountant accounts single examples, so removing one example could change a user's clipped sum by "
                "up to 2 * max_grad_norm. For user-level privacy use make_private(privacy_unit='user', user_ids=...): "
                "it samples and accounts users and clips each user's summed gradient itself."
            )
        if group_ids is not None and (self._in_logical_step or self._skip_next_step):
            raise ValueError(
                "group_ids (per-user clipping) inside a logical batch split into micro-batches: a user split across "
                "micro-batches would be clipped once per micro-batch. Clip per user on whole logical batches."
            )
        if group_ids is None and self.privacy_unit == "user" and self._has_grad_samples():
            raise ValueError(
                "per-sample gradients of no user-level batch reached a user-level optimizer (privacy_unit='user'): "
                "clipped per example, one user's rows could add up to examples_per_user * max_grad_norm. Nothing "
                "was clipped. Run the model (the module make_private returned) on the batches of its private loader."
            )
        if padding_mask is None:
            padding_mask = self.current_padding_mask()
        self._check_connected()
        if self._has_grad_samples():
            self.contract.contributed(BatchTicket(loader_step=None, size=0))
        self.clipper.clip_and_accumulate(padding_mask=padding_mask, group_ids=group_ids)

    def current_padding_mask(self) -> torch.Tensor | None:
        """The padding mask of the batch being trained on (from ``padding_mask_source``, which
        ``VirtualSteps`` redirects to the micro-batch's slice), or None. Fast clipping reads it at
        the end of each backward pass."""
        return None if self.padding_mask_source is None else self.padding_mask_source()

    def _has_grad_samples(self) -> bool:
        # ``any(getattr(p, "grad_sample", None) is not None for p in params)`` as C-level maps (read 2-3 times a step).
        params = self.clipper.params
        return any(map(_is_not_none, map(getattr, params, itertools.repeat("grad_sample"), itertools.repeat(None))))

    def pre_step(self) -> bool:
        """Clip what is waiting; if this step is not skipped, check what the release contains (see
        ``privacy_engine.training.step_contract``), write the private gradient (clipped sum + noise, divided by
        the expected batch size) into ``.grad`` and record the step. Returns whether the wrapped
        optimizer should step now. Every check raises before anything is released or counted."""
        self.sync_private_parameters()
        waiting = self._has_grad_samples()
        self._check_connected(at_step=True, grad_samples_waiting=waiting)
        for module in self.contract.modules:
            module.flush_grad_samples()
        # A flush only hands grad_sample already waiting to the clipper: with none waiting there is nothing to clip.
        if waiting and self._has_grad_samples():
            self.clip_and_accumulate()
        if self._skip_next_step:
            self._skip_next_step = False
            self._in_logical_step = True
            return False
        params = self.clipper.params
        # Before close(): raises before any release (0 without shuffled batches, read here: once per step).
        shuffled_batches = 0 if self.shuffled_batches is None else self._shuffled_batches_in_release()
        release = self.contract.close()
        rows, loader_step = self._check_release(release, params)
        self._in_logical_step = False
        # Adaptive clipping: this step's count of unclipped examples, taken with the sums it goes with.
        count = None if self.clipper.adaptive is None else self.clipper.adaptive.take_count(self.clipper.params[0].device)
        self.last_clipping_stats = self.clipper.pre_step()
        grads = self.clipper.released_sums  # float32 at least; half-precision .grad is cast after the noise
        if self.canaries is not None:
            # Before the noise, as examples: the release is noised(clipped examples + included canaries). The
            # contribution is data-independent and the noise too, so no neighbouring distribution changes.
            self.canaries.add_to_clipped_sums(grads, self._canary_slot(release, loader_step, shuffled_batches))
        # Divide by the expected batch size, not the realised one: the realised size depends on which examples
        # were sampled, and dividing by it would release that number without noise (and change the sensitivity).
        divisor = None
        if self.loss_reduction == "mean":
            divisor = self.expected_batch_size * max(release.num_draws, shuffled_batches, 1)
        # A plain mechanism divides in the pass that adds the noise (same roundings); a wrapper (DDP) adds the
        # noise on one rank and reduces inside its commit, so the division waits for the reduced sum.
        fused_divisor = divisor if type(self.noise).add_noise_ is NoiseMechanism.add_noise_ else None
        self._add_noise_and_record(grads, params, release, rows, loader_step, shuffled_batches=shuffled_batches,
                                   unclipped_count=count, divide_by=fused_divisor)  # fmt: skip
        for module in self.contract.modules:
            module.forget_forward_batch()  # a later backward must come from a new forward
        if divisor is not None and fused_divisor is None:
            torch._foreach_div_(grads, divisor)
        released = grads
        if not all(map(operator.is_, map(_GRAD, params), grads)):  # (the clipper wrote each sum of a param's dtype)
            released = []
            for param, grad in zip(params, grads):
                if param.grad is not grad:
                    grad = grad.to(param.dtype)  # the noised sum, rounded once
                    param.grad = grad
                released.append(grad)
        # What this step left in .grad (ReleaseChecks._has_stray_gradient): id(param) -> (id(.grad), its version).
        self._grad_marks = dict(zip(map(id, params), zip(map(id, released), map(_VERSION, released))))
        for param in itertools.filterfalse(_REQUIRES_GRAD, self._all_params):
            param.grad = None  # frozen: no noise, no update
        if self.__dict__.get("_step_hooks"):
            self._run_step_hooks()
        return True

    def _canary_slot(self, release: Release, loader_step: int | None, shuffled_batches: int) -> CanarySlot:
        """This release as a canary taking part like an example sees it; ``RuntimeError`` where a canary could not
        take part exactly as an example (fixed-size shuffled batches, no sample rate)."""
        if shuffled_batches or self.shuffled_batches is not None or self.sample_rate is None:
            raise RuntimeError("canaries are sampled at the Poisson sample rate: they need Poisson sampling")
        # BandMF: the release takes the noise row of its loader step (the next row when no draw contributed), and
        # row t belongs to cyclic group t mod b: the group whose members this release could hold.
        row = self.noise.step if loader_step is None else loader_step
        return CanarySlot(
            sample_rate=self.sample_rate, num_draws=max(release.num_draws, 1), num_groups=self.num_bands,
            group=int(row) % self.num_bands,
            sensitivity=float(self.clipper.sensitivity),
        )  # fmt: skip

    def _shuffled_batches_in_release(self) -> int:
        """Loader batches in the open step without Poisson sampling (``shuffled_batches``): from the rows
        of the distinct batches its passes ran on (no Poisson loader is attached then: every batch is the
        plain loader's); 0 when the batches are Poisson samples."""
        if self.shuffled_batches is None:
            return 0
        rows = {(id(t.draw), t.rows) for t in self.contract._contributions}
        return self.shuffled_batches.batches_in(sum(end - start for _, (start, end) in rows))

    def _add_noise_and_record(
        self, grads: list[torch.Tensor], params: list[nn.Parameter], release: Release, rows: int,
        loader_step: int | None, *, shuffled_batches: int = 0, unclipped_count: torch.Tensor | None = None,
        divide_by: float | None = None,
    ) -> None:  # fmt: skip
        """Noise the clipped sums ``grads`` in place and record the step, in one commit of the noise
        state (after the discarded BandMF rows of the loader steps not released, see ``_noise_rows``).
        On any error the clipped sums are removed from ``.grad`` before it propagates. Adaptive clipping: the
        count (``unclipped_count``) is noised and the next clip norms set inside the same commit; on an error
        the count's generator is rolled back and the clip norms stay. ``divide_by``: passed to ``add_noise_``
        (the expected batch size, divided in the same pass as the noise), or None."""
        adaptive = self.clipper.adaptive
        if adaptive is not None:
            adaptive.seed_if_pending()  # an unseeded run's count seed, drawn at its first release
        count_generator_state = None if adaptive is None else adaptive.generator.get_state()
        try:
            step_kwargs = self._accounting_kwargs(release, rows)
            if shuffled_batches > 1:  # k disjoint batches of one epoch: each example at most once (ShuffledBatches)
                step_kwargs["sample_rate"] = self.shuffled_batches.release_sample_rate(shuffled_batches)
                step_kwargs.pop("batches_per_step", None)  # not independent Poisson draws
            if self.budget is not None:
                self.budget.check_release(self.accountant, **step_kwargs)
            step_kwargs.pop("num_steps", None)
            for _ in range(rows - 1):
                # BandMF rows of batches the loop drew and never released: drawn and discarded, so each
                # released batch gets the noise row of its own step (and its group's min-separation). Each
                # such row is counted (in its own commit): participations never exceed ceil(rows / b).
                self.noise.add_noise_([torch.zeros_like(g) for g in grads], self.gradient_noise_multiplier,
                                      self.clipper.sensitivity,
                                      on_commit=lambda: self.accountant is None or self.accountant.step(**step_kwargs))  # fmt: skip

            def record() -> None:
                # Runs inside the noise step's commit: the step is recorded if and only if its noise
                # state advances. Every released step is recorded, an empty batch's too: its noise was
                # drawn for a batch that could have held any example. All or nothing: what can raise is built
                # first, the accountant's record (itself all or nothing) is the first write, plain assignments follow.
                released_draws = self.contract.released_draws_after(release)
                clip_norms = None
                if adaptive is not None:
                    divisor = (self.expected_batch_size or 0.0) * max(release.num_draws, shuffled_batches, 1)
                    clip_norms = self._next_clip_norms(unclipped_count, divisor)
                if self.accountant is not None:
                    self.accountant.step(**step_kwargs)
                self.steps_taken += 1
                self.contract.released(release, loader_step, released_draws)
                if clip_norms is not None:
                    adaptive.set_clip_norms(clip_norms)  # in force from the next step's clipping on

            if divide_by is None:
                self.noise.add_noise_(grads, self.gradient_noise_multiplier, self.clipper.sensitivity, on_commit=record)
            else:
                self.noise.add_noise_(grads, self.gradient_noise_multiplier, self.clipper.sensitivity, on_commit=record,
                                      divide_by=divide_by)  # fmt: skip
        except BaseException:
            if count_generator_state is not None:
                adaptive.generator.set_state(count_generator_state)
            # The .grad tensors hold the un-noised clipped sum: never leave it where a later
            # optimizer step could use it.
            for param in params:
                param.grad = None
            raise

    def _next_clip_norms(self, unclipped_count: torch.Tensor, divisor: float) -> tuple[float, ...]:
        """Adaptive clipping: release this step's centred count of unclipped examples with its noise, drawn
        once (distributed: on rank 0, then summed over the ranks like the clipped sums, so the job releases
        one noised global count), and return the clip norms it leads to (``AdaptiveClipping.next_clip_norms``,
        divided by the same expected batch size as the sum). Sets nothing."""
        adaptive = self.clipper.adaptive
        job = getattr(self, "distributed_job", None)  # set by training.distributed.configure
        count = unclipped_count
        if job is None or job.rank == 0:
            count = adaptive.noised_count(count)
        if job is not None:
            job.all_reduce_sum_([count], "the all-reduce of the count of unclipped examples")
        return adaptive.next_clip_norms(count, divisor)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Release one private step and let the wrapped optimizer update the parameters; after
        ``signal_skip_step()``, only clip and accumulate (nothing released, nothing recorded). Returns
        ``closure()``'s loss (evaluated once, with grad; None without a closure).

        A released step writes ``sum_i clip(g_i) + noise`` (divided by ``expected_batch_size`` times the
        number of loader batches released, at least 1, for ``loss_reduction="mean"``) into the ``.grad`` of
        the private parameters, records it with the accountant inside the noise commit (recorded if and only
        if the noise state advances; an empty batch's noise-only step too), adds one to ``steps_taken``,
        then calls the wrapped optimizer's ``step()`` (without the closure, which would overwrite the private
        ``.grad``). A signal arriving once the noise is committed is held until the parameters are updated: a
        recorded step is always a step the model took.

        Raises before anything is released or counted:

        =============================================  =========================================
        case                                           result
        =============================================  =========================================
        ``grad_sample`` of a wrapper not connected     ``RuntimeError``
        to this optimizer
        contributions from data the private loader     ``RuntimeError`` (untracked, or another
        did not draw                                   loader's batch)
        a draw already released by an earlier step     ``RuntimeError``
        gradients without per-sample gradients         ``RuntimeError``
        (eval mode, unwrapped model)
        no new batch since the last step               ``RuntimeError``
        parameters changed in place since the          ``RuntimeError``
        step's first forward
        several draws in one step with BandMF or       ``RuntimeError``
        truncated sampling
        BandMF batch released out of loader order      ``RuntimeError``
        release over the privacy budget                ``PrivacyBudgetExceeded``
        ``GradScaler.step`` without an attached        ``RuntimeError``; the open logical step is
        scaler                                         discarded
        =============================================  =========================================

        If noising or recording fails after the checks, the private parameters' ``.grad`` is set to None
        (it held the un-noised clipped sum) before the error propagates; the step's noise commit is all
        or nothing (recorded if and only if its noise state advanced).

        Runs without grad, as under ``torch.no_grad()`` (the mode is set and restored as it does: as a decorator it
        cost ~8 Python calls per step)."""
        grad_enabled = _grad_enabled()
        _set_grad_enabled(False)
        try:
            scaled_step = hasattr(self, "grad_scale") or hasattr(self, "found_inf")
            if not scaled_step:
                return self._step(closure)
            try:
                return self._step(closure, scaled_step=True)
            except BaseException:
                # GradScaler removes the attributes it set only when step() returns: a later plain step must
                # not take them for a scaled one.
                for name in ("grad_scale", "found_inf"):
                    self.__dict__.pop(name, None)
                raise
        finally:
            _set_grad_enabled(grad_enabled)

    def _step(self, closure: Callable[[], Any] | None, *, scaled_step: bool = False) -> Any:
        if scaled_step:
            self._check_scaled_step()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # A signal handler's exception (Ctrl-C, a SIGTERM handler's SystemExit, a SIGALRM TimeoutError) arriving
        # once the noise step is committed is held until the parameters are updated too (the noise commit's own
        # deferral joins this one): a recorded step is always a step the model took.
        with deferred_signals():
            stepped = self.pre_step()
            if stepped:
                # The closure is not passed on: re-evaluating it would overwrite the private .grad.
                self.original_optimizer.step()
        if scaled_step:
            # Nothing released (a virtual step's micro-batch): nothing public to react to.
            released = [p.grad for p in self.clipper.params if p.grad is not None] if stepped else []
            self._report_overflow_to_scaler(released)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` and ``grad_sample`` of the parameters, and the accumulated clipped sum
        unless a logical step is open (the last ``step()`` was skipped): virtual steps call
        ``zero_grad()`` between micro-batches of one logical batch."""
        if self._has_grad_samples():
            for param in self.clipper.params:
                if getattr(param, "grad_sample", None) is not None:
                    param.grad_sample = None
        if not self._in_logical_step:
            # Everything gathered for the open step is dropped: nothing of it is released or counted.
            self.clipper.reset()
            self.contract.discard()
            for module in self.contract.modules:
                module.discard_unflushed_passes()
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def discard_logical_step(self) -> None:
        """Drop a partly accumulated logical step (nothing was released, nothing is recorded) and
        any pending skip: used when a loop stops between micro-batches of one logical batch."""
        for param in self.clipper.params:
            if getattr(param, "grad_sample", None) is not None:
                param.grad_sample = None
        for module in self.contract.modules:
            module.discard_unflushed_passes()
        self.clipper.reset()
        self.contract.discard()
        self._skip_next_step = False
        self._in_logical_step = False

    # ------------------------------------------------------------------ step hooks
    def attach_step_hook(self, hook: Callable[[DPOptimizer], None]) -> None:
        """Call ``hook(optimizer)`` after every released step: once its private gradient is in
        ``.grad`` (noised, divided by the expected batch size) and recorded, before the wrapped
        optimizer updates the parameters. Skipped micro-batch steps do not call it. Hooks add up
        (Opacus keeps one, replaced at each call); the engine's own accounting never depends on
        them. What a hook reads from ``.grad`` is already private (noised); an exception in it
        propagates after the step was recorded."""
        if not callable(hook):
            raise TypeError(f"hook must be callable (it is called with the optimizer); got {hook!r}")
        self.__dict__.setdefault("_step_hooks", []).append(hook)

    def _run_step_hooks(self) -> None:
        for hook in self.__dict__.get("_step_hooks", ()):
            hook(self)


def _profiled_only_when_needed(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` wrapped as ``Optimizer.profile_hook_step`` wraps it, except that with no profiler recording and no
    step pre/post hook registered (on the optimizer or globally) it runs ``step`` alone, without opening a profiler
    range that nobody records: the same calls otherwise (``_optimizer_step_code`` after the step)."""
    profiled = Optimizer.profile_hook_step(step)

    @functools.wraps(step)
    def wrapper(self: Optimizer, *args: Any, **kwargs: Any) -> Any:
        # No profiler recording and no step pre/post hook, on the optimizer or globally (once per step, inline): the
        # tables are read from torch's module at each call, as torch's wrapper reads them.
        if (
            _GLOBAL_HOOK_TABLES
            and not self._optimizer_step_pre_hooks
            and not self._optimizer_step_post_hooks
            and not torch_optimizer._global_optimizer_pre_hooks
            and not torch_optimizer._global_optimizer_post_hooks
            and not torch.autograd._profiler_enabled()
        ):
            out = step(self, *args, **kwargs)
            self._optimizer_step_code()
            return out
        return profiled(self, *args, **kwargs)

    wrapper.hooked = True  # type: ignore[attr-defined]
    return wrapper


