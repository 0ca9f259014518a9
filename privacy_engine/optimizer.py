"""DPOptimizer: any ``torch.optim.Optimizer`` turned into a differentially private one.

One logical step is: clip every example's gradient and sum (``PerSampleGradientClipper``), add
Gaussian (or BandMF) noise to the sum once (the noise mechanism), divide by the expected batch
size, record the step with the accountant, and let the wrapped optimizer update the parameters
from these private gradients. Everything else (param_groups, state, LR schedulers, hooks) is the
wrapped optimizer's.
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from privacy_engine.clipper import ClippingStats, MaxGradNorm, PerSampleGradientClipper
from privacy_engine.grad_sample_module import LOSS_REDUCTIONS
from privacy_engine.noise import GaussianNoise, NoiseMechanism
from privacy_engine.step_contract import BatchTicket, Release, StepContract, register_optimizer

__all__ = ["DPOptimizer"]

STATE_DICT_KEY = "privacy_engine.dp_state"


def _check_noise_multiplier(noise_multiplier: Any) -> float:
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, numbers.Real):
        raise TypeError(f"noise_multiplier must be a real number >= 0; got {noise_multiplier!r}")
    value = float(noise_multiplier)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"noise_multiplier must be finite and >= 0 (0: no noise, no privacy); got {noise_multiplier!r}")
    return value


class DPOptimizer(Optimizer):
    """Differentially private wrapper around ``optimizer`` (SGD, Adam, AdamW, ...).

    ``step()`` does, for one logical batch: (1) ``clip_and_accumulate`` if per-sample gradients
    are waiting; (2) unless ``signal_skip_step()`` asked to skip (a micro-batch of a larger
    logical batch, see ``virtual_steps``), write the clipped sum into ``.grad``, add noise of
    standard deviation ``noise_multiplier * sensitivity`` to every entry, record the step with the
    accountant, divide by ``expected_batch_size`` (``loss_reduction="mean"``) and call the wrapped
    optimizer's ``step()``.

    Guarantee: every step that is not skipped releases ``sum_i clip(g_i) + N(0, (sigma C)^2 I)``
    (C the clipper's sensitivity), whatever the gradients, and is recorded with the accountant
    (sample_rate, noise_multiplier, the mechanism's num_bands). The ``.grad`` the wrapped
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
    ====================================  ==============================================

    Which batches, backward passes and parameters one step contains, and every check made before
    a release, are the step contract's: see ``privacy_engine.step_contract`` for the table of loop
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
        noise_seed: seed of the default Gaussian noise (``None``: OS entropy).
        secure_mode: OS-entropy noise only; a ``noise_seed`` raises.
        accountant: records every released step (``step(noise_multiplier=, sample_rate=,
            num_bands=)``); ``None`` for no accounting.
        sample_rate: the sampling probability recorded with each step (needed with an accountant).
        padding_mask_source: callable giving the padding mask of the batch being clipped (the
            engine passes ``lambda: loader.padding_mask``); ``None`` for no padding.
        budget: a ``privacy_engine.budget.PrivacyBudget`` (needs an accountant): each release is
            checked against it first and refused with ``PrivacyBudgetExceeded``; ``None``: none.
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
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        if isinstance(optimizer, DPOptimizer):
            raise TypeError("optimizer is already a DPOptimizer; wrap the original optimizer once")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "optimizer is LBFGS, which re-evaluates the loss several times per step: each evaluation "
                "would need its own noise and privacy budget. Use a first-order optimizer (SGD, Adam, ...)."
            )
        noise_multiplier = _check_noise_multiplier(noise_multiplier)
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}; got {loss_reduction!r}")
        if loss_reduction == "mean":
            if expected_batch_size is None:
                raise ValueError("expected_batch_size is needed for loss_reduction='mean' (the noisy sum is divided by it)")
            if isinstance(expected_batch_size, bool) or not isinstance(expected_batch_size, numbers.Real):
                raise TypeError(f"expected_batch_size must be a number > 0; got {expected_batch_size!r}")
            if not (math.isfinite(expected_batch_size) and expected_batch_size > 0):
                raise ValueError(f"expected_batch_size must be finite and > 0; got {expected_batch_size!r}")
        params = trainable_parameters(optimizer)
        if not params:
            raise ValueError("optimizer has no parameter with requires_grad=True: nothing to train privately")
        if clipper is None:
            if max_grad_norm is None:
                raise ValueError("give max_grad_norm (or a ready clipper)")
            clipper = PerSampleGradientClipper(params, max_grad_norm, clipping=clipping)
        elif [id(p) for p in clipper.params] != [id(p) for p in params]:
            raise ValueError(
                "clipper.params must be the optimizer's trainable parameters, in param_groups order"
            )
        if noise is None:
            noise = GaussianNoise(seed=noise_seed, secure_mode=secure_mode)
        elif noise_seed is not None:
            raise ValueError("noise_seed is for the default noise; seed the noise mechanism you pass instead")
        if not isinstance(noise, NoiseMechanism):
            raise TypeError(f"noise must be a NoiseMechanism; got {type(noise).__name__}")
        if noise_multiplier > 0 and not math.isfinite(clipper.sensitivity):
            raise ValueError(
                "max_grad_norm is inf (no clipping) with noise_multiplier > 0: no finite noise makes "
                "unclipped gradients private. Set a finite max_grad_norm, or noise_multiplier=0."
            )
        num_bands = int(getattr(noise, "num_bands", 1))
        if accountant is not None:
            if sample_rate is None:
                raise ValueError("sample_rate is needed with an accountant (it is recorded with every step)")
            # Validates the arguments the accountant will receive, recording nothing.
            accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=0, num_bands=num_bands)
        if padding_mask_source is not None and not callable(padding_mask_source):
            raise TypeError("padding_mask_source must be a callable returning a bool tensor or None")
        if budget is not None and (accountant is None or not callable(getattr(budget, "check_release", None))):
            raise ValueError("budget must be a privacy_engine.budget.PrivacyBudget, and needs an accountant to check")

        # Optimizer.__init__ would build new param_groups; the wrapped optimizer's are used
        # instead, so only the hook tables it sets up are created here.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

        self.original_optimizer = optimizer
        self.clipper = clipper
        self.noise = noise
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = None if expected_batch_size is None else float(expected_batch_size)
        self.loss_reduction = loss_reduction
        self.accountant = accountant
        self.sample_rate = None if sample_rate is None else float(sample_rate)
        self.num_bands = num_bands
        self.padding_mask_source = padding_mask_source
        self.last_clipping_stats: ClippingStats | None = None
        self.steps_taken = 0  # released (noised) steps
        self._skip_next_step = False
        self._in_logical_step = False  # a skipped step left clipped sums for the next one
        #: What the open step contains and the checks before a release (privacy_engine.step_contract).
        self.contract = StepContract()
        #: Accountant entries of this optimizer are tagged with it, so several private optimizers on one
        #: accountant compose as separate mechanisms.
        self.source = str(source)
        #: Whether ``clip_and_accumulate(group_ids=...)`` is allowed: the engine's optimizers sample and
        #: account per example, so per-user clipping would be accounted wrongly there.
        self.per_user_clipping = bool(per_user_clipping)
        #: Called with the clipped sums (the .grad tensors) before noise is added: the distributed
        #: all-reduce hooks in here (privacy_engine.distributed).
        self.reduce_clipped_sums: Callable[[list[torch.Tensor]], None] | None = None
        #: A privacy budget consulted before every release (privacy_engine.budget); None for none.
        self.budget: Any | None = budget
        self._all_params = [p for group in optimizer.param_groups for p in group["params"]]
        self._grad_marks: dict[int, tuple[int, int]] = {}  # id(param) -> (id(.grad), version) we left
        register_optimizer(self)

    def __getstate__(self) -> dict[str, Any]:
        # Optimizer.__getstate__ keeps only defaults/state/param_groups; a copy needs everything.
        return dict(self.__dict__)

    # ------------------------------------------------------------------ the wrapped optimizer
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.original_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.original_optimizer.defaults = value

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters that are clipped and noised."""
        return self.clipper.params

    @property
    def max_grad_norm(self) -> MaxGradNorm:
        return self.clipper.config.max_grad_norm

    def add_param_group(self, param_group: dict[str, Any]) -> None:
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
    def _bind_if_ours(self, wrapper: Any) -> None:
        """Bind a GradSampleModule whose trainable parameters this optimizer clips (or a fast-clipping
        wrapper attached to this optimizer's clipper)."""
        if hasattr(wrapper, "attach_clipper"):
            if wrapper.clipper is not self.clipper:
                return
        else:
            mine = {id(p) for p in self._all_params}
            theirs = [p for p in wrapper.wrapped_module.parameters() if p.requires_grad]
            if not theirs or any(id(p) not in mine for p in theirs):
                return
        wrapper.bind(self)
        self.contract.attach_module(wrapper)

    def attach_loader(self, loader: Any) -> None:
        """Tie this optimizer's steps to the batches of a private loader (``DPDataLoader``)."""
        self.contract.attach_queue(loader.tickets)

    def sync_private_parameters(self) -> None:
        """Read which of the optimizer's parameters are trainable now, and clip and noise exactly those.

        A parameter unfrozen since the last step joins the clipper (flat clipping: under the same
        bound; per-layer with one total bound: as a group of its own, the bound split anew) and the
        noise layout restarts over the new set (BandMF: a fresh correlation, which keeps the
        guarantee); a parameter frozen since gets no noise and no update. Raises ``ValueError``
        naming the parameter, changing nothing, when the set changes in the middle of a step (after
        a backward pass) or when per-layer bounds were given one by one.
        """
        active = [p for p in self._all_params if p.requires_grad]
        current = self.clipper.params
        if len(active) == len(current) and all(a is b for a, b in zip(active, current)):
            return
        changed = [p for p in active if all(p is not q for q in current)] or [
            p for p in current if all(p is not q for q in active)
        ]
        position = next(i for i, p in enumerate(self._all_params) if p is changed[0])
        what = f"optimizer parameter #{position} (shape {tuple(changed[0].shape)})"
        if self.clipper.has_accumulated or self._in_logical_step or any(
            getattr(p, "grad_sample", None) is not None for p in current
        ):
            raise ValueError(
                f"{what} was frozen or unfrozen in the middle of a step (after a backward pass): change "
                f"requires_grad between optimizer.step() and the next forward"
            )
        if not active:
            raise ValueError("every parameter of the optimizer is frozen: nothing to train privately")
        config = self.clipper.config
        if isinstance(config.max_grad_norm, tuple):
            raise ValueError(
                f"{what} changed requires_grad, but max_grad_norm gives one bound per group: the new set of "
                f"parameters has no bounds. Give one total bound (clipping='per_layer' splits it) or freeze "
                f"parameters before make_private."
            )
        groups = None
        if config.clipping == "per_layer":
            kept = [[p for p in group if any(p is a for a in active)] for group in self.clipper.groups]
            grouped = {id(p) for group in kept for p in group}
            groups = [g for g in kept if g] + [[p] for p in active if id(p) not in grouped]
        clipper = PerSampleGradientClipper(active, config.max_grad_norm, clipping=config.clipping, groups=groups,
                                           nan_safe=config.nan_safe,
                                           rescale_to_unit_norm=config.rescale_to_unit_norm)  # fmt: skip
        for module in self.contract.modules:
            if hasattr(module, "attach_clipper"):
                module.attach_clipper(clipper, padding_mask_source=module._padding_mask_source)
        clipper.grad_scaler = self.clipper.grad_scaler
        self.noise.restart_layout()
        self.clipper = clipper

    def accumulate_pass(self, ticket: BatchTicket) -> None:
        """Clip one completed backward pass's per-sample gradients (``grad_sample``) with its own
        batch's padding mask, and note the batch as part of the open step."""
        if not self._has_grad_samples():
            return  # dropped since (zero_grad): nothing of this pass is released
        padding_mask = ticket.mask() if ticket.tracked else self.current_padding_mask()
        self.clipper.clip_and_accumulate(padding_mask=padding_mask)
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
                "up to 2 * max_grad_norm. Sample users (one entry per user, holding all their examples) and clip "
                "per entry instead."
            )
        if group_ids is not None and (self._in_logical_step or self._skip_next_step):
            raise ValueError(
                "group_ids (per-user clipping) inside a logical batch split into micro-batches: a user split across "
                "micro-batches would be clipped once per micro-batch. Clip per user on whole logical batches."
            )
        if padding_mask is None:
            padding_mask = self.current_padding_mask()
        if self._has_grad_samples():
            self.contract.contributed(BatchTicket(loader_step=None, size=0))
        self.clipper.clip_and_accumulate(padding_mask=padding_mask, group_ids=group_ids)

    def current_padding_mask(self) -> torch.Tensor | None:
        """The padding mask of the batch being trained on (from ``padding_mask_source``, which
        ``VirtualSteps`` redirects to the micro-batch's slice), or None. Fast clipping reads it at
        the end of each backward pass."""
        return None if self.padding_mask_source is None else self.padding_mask_source()

    def _has_grad_samples(self) -> bool:
        return any(getattr(p, "grad_sample", None) is not None for p in self.clipper.params)

    def pre_step(self) -> bool:
        """Clip what is waiting; if this step is not skipped, check what the release contains (see
        ``privacy_engine.step_contract``), write the private gradient (clipped sum + noise, divided by
        the expected batch size) into ``.grad`` and record the step. Returns whether the wrapped
        optimizer should step now. Every check raises before anything is released or counted."""
        self.sync_private_parameters()
        for module in self.contract.modules:
            module.flush_grad_samples()
        if self._has_grad_samples():
            self.clip_and_accumulate()
        if self._skip_next_step:
            self._skip_next_step = False
            self._in_logical_step = True
            return False
        params = self.clipper.params
        release = self.contract.close()
        rows, loader_step = self._check_release(release, params)
        self._in_logical_step = False
        self.last_clipping_stats = self.clipper.pre_step()
        grads = self.clipper.released_sums  # float32 at least; half-precision .grad is cast after the noise
        try:
            if self.reduce_clipped_sums is not None:
                self.reduce_clipped_sums(grads)
            step_kwargs = self._accounting_kwargs(release, rows)
            if self.budget is not None:
                self.budget.check_release(self.accountant, **step_kwargs)
            step_kwargs.pop("num_steps", None)
            for _ in range(rows - 1):
                # BandMF rows of batches the loop drew and never released: drawn and discarded, so each
                # released batch gets the noise row of its own step (and its group's min-separation). Each
                # such row is counted (in its own commit): participations never exceed ceil(rows / b).
                self.noise.add_noise_([torch.zeros_like(g) for g in grads], self.noise_multiplier,
                                      self.clipper.sensitivity,
                                      on_commit=lambda: self.accountant is None or self.accountant.step(**step_kwargs))  # fmt: skip

            def record() -> None:
                # Runs inside the noise step's commit: the step is recorded if and only if its noise
                # state advances. Every released step is recorded, an empty batch's too: its noise was
                # drawn for a batch that could have held any example.
                if self.accountant is not None:
                    self.accountant.step(**step_kwargs)
                self.steps_taken += 1
                self.contract.released(release, loader_step)

            self.noise.add_noise_(grads, self.noise_multiplier, self.clipper.sensitivity, on_commit=record)
        except BaseException:
            # The .grad tensors hold the un-noised clipped sum: never leave it where a later
            # optimizer step could use it.
            for param in params:
                param.grad = None
            raise
        for module in self.contract.modules:
            module._forward_ticket = None  # a later backward must come from a new forward
        if self.loss_reduction == "mean":
            # Divide by the expected batch size, not the realised one: the realised size depends
            # on which examples were sampled, and dividing by it would release that number
            # without noise (and change the sensitivity).
            torch._foreach_div_(grads, self.expected_batch_size * max(release.num_draws, 1))
        for param, grad in zip(params, grads):
            if param.grad is not grad:
                param.grad = grad.to(param.dtype)  # the noised sum, rounded once
        for param in self._all_params:
            if not param.requires_grad:
                param.grad = None  # frozen: no noise, no update
        self._grad_marks = {id(p): (id(p.grad), p.grad._version) for p in params}
        self._run_step_hooks()
        return True

    def _accounting_kwargs(self, release: Release, rows: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "num_bands": self.num_bands,
        }  # fmt: skip
        if rows != 1:
            kwargs["num_steps"] = rows
        if self.source:
            kwargs["source"] = self.source
        if release.num_draws > 1:
            kwargs["batches_per_step"] = release.num_draws
        return kwargs

    def _check_release(self, release: Release, params: list[nn.Parameter]) -> tuple[int, int | None]:
        """Check what the step is about to release; return (noise rows to advance, loader step)."""
        contract = self.contract
        if release.untracked and contract.has_loader:
            raise RuntimeError(
                "this step would release gradients of data that the private loader did not draw (a forward on "
                "tensors not yielded by the loader make_private returned): the accounting covers only the sampled "
                "batches. Train on the private loader's batches."
            )
        if release.num_draws == 0 and not release.untracked and not self.clipper.has_accumulated:
            stray = [i for i, p in enumerate(self._all_params) if p.requires_grad and self._has_stray_gradient(p)]
            if stray:
                raise RuntimeError(
                    f"optimizer parameters {stray} have gradients from a backward pass that produced no per-sample "
                    f"gradients: the model was in eval() mode, not the wrapped model returned by make_private, or "
                    f"its hooks were removed. Nothing was released. Call model.train() on the wrapped model before "
                    f"the forward (or zero_grad() to drop these gradients)."
                )
        contract.check_parameters_unchanged(params, where="optimizer.step()")
        if release.num_draws > 1 and (self.num_bands > 1 or getattr(self.accountant, "max_batch_size", None)):
            raise RuntimeError(
                f"this step accumulated {release.num_draws} batches of the private loader: BandMF and truncated "
                f"sampling release one batch per step. Use VirtualSteps (BatchMemoryManager) to split one batch "
                f"into micro-batches instead."
            )
        loader_step = release.loader_step
        if loader_step is None and release.num_draws == 0 and contract.has_loader:
            unused = contract.take_unused_draw()  # a batch the loop skipped backward for (empty)
            loader_step = None if unused is None else unused.loader_step
        if self.num_bands <= 1 or loader_step is None:
            return 1, loader_step
        next_row = self.noise.step  # BandMF rows taken so far (restored with the noise state on resume)
        if loader_step < next_row:
            raise RuntimeError(
                f"the batch of loader step {loader_step} is released after noise row {next_row - 1} was used: "
                f"BandMF ties each batch to the noise row of its own step, which must increase. Use batches in the "
                f"order the loader yields them, each at most once."
            )
        return loader_step - next_row + 1, loader_step

    def _has_stray_gradient(self, param: nn.Parameter) -> bool:
        grad = param.grad
        if grad is None:
            return False
        if self._grad_marks.get(id(param)) == (id(grad), grad._version):
            return False  # the private gradient this optimizer wrote (not zeroed since)
        return bool(grad.detach().abs().sum() > 0)

    # torch.amp.GradScaler hands scale-aware optimizers its scale instead of unscaling and skipping steps
    # itself (step() below): a skip decided by whether the raw gradients overflowed depends on the data.
    _step_supports_amp_scaling = True

    def attach_grad_scaler(self, scaler: Any) -> None:
        """Train with fp16 loss scaling: ``scaler.scale(loss).backward(); scaler.step(optimizer);
        scaler.update()`` as in a non-private loop.

        Guarantee: each example's gradient is clipped at ``max_grad_norm`` after the loss scale is
        divided out (the clipper reads the scaler's current scale when it clips a pass), so the release
        is the one the accountant records whatever the scale. ``scaler.step(optimizer)`` always steps:
        an example whose scaled gradient overflowed contributes its finite entries only (``nan_safe``;
        its contribution is still clipped), and the step is never skipped, since whether a batch
        overflowed depends on its examples. For the same reason the scaler's next scale is driven by the
        released (noised) gradient only: ``scaler.update()`` sees an overflow if and only if the released
        gradient is not finite, and the scale otherwise stays where it is (no growth decided by private
        data). The scale is therefore static in practice: pick ``GradScaler(init_scale=...)`` so that
        per-example gradients neither underflow nor overflow (2**10 to 2**16 for mean-reduced losses).

        ==================================  ==============================================
        case                                result
        ==================================  ==============================================
        scaler disabled (enabled=False)     scale 1: the ordinary private step
        ``scaler.unscale_(optimizer)`` first the scale is still divided out once (of the
                                            per-sample gradients, which unscale_ never sees)
        ``optimizer.step()`` without scaler the scale is divided out just the same
        scaler not a GradScaler             TypeError, nothing changed
        GradScaler.step with none attached  RuntimeError before anything is released
        ==================================  ==============================================
        """
        needed = ("get_scale", "is_enabled", "update", "_per_optimizer_states")
        if not all(hasattr(scaler, name) for name in needed):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler; got {type(scaler).__name__}")
        self.clipper.grad_scaler = scaler

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
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

    def _step(self, closure: Callable[[], Any] | None, *, scaled_step: bool = False) -> Any:
        if scaled_step and self.clipper.grad_scaler is None:
            self.discard_logical_step()
            raise RuntimeError(
                "GradScaler.step(optimizer) was called, but the private optimizer does not know the scaler: the "
                "per-sample gradients would be clipped at their scaled size. Pass grad_scaler=scaler to "
                "make_private (or call optimizer.attach_grad_scaler(scaler)) before training. Nothing was released."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.pre_step():
            # The closure is not passed on: re-evaluating it would overwrite the private .grad.
            self.original_optimizer.step()
            released = [p.grad for p in self.clipper.params if p.grad is not None]
        else:
            released = []  # nothing released (a virtual step's micro-batch): nothing public to react to
        if scaled_step:
            self._report_overflow_to_scaler(released)
        return loss

    def _report_overflow_to_scaler(self, released: list[torch.Tensor]) -> None:
        """Make ``scaler.update()`` see an overflow exactly when the released gradient is not finite,
        and keep the scale from growing (see ``attach_grad_scaler``): the scaler's own overflow flags
        were computed from gradients before privacy."""
        scaler = self.clipper.grad_scaler
        overflow = 0.0 if all(bool(torch.isfinite(g).all()) for g in released) else 1.0
        flags = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
        for found_inf in flags.values():
            found_inf.fill_(overflow)
        if not flags:  # no .grad was there to check (fast clipping writes .grad only at the step)
            scale = scaler._scale
            flags[scale.device] = torch.full((), overflow, dtype=torch.float32, device=scale.device)
        tracker = getattr(scaler, "_growth_tracker", None)
        if tracker is not None:
            # update() grows the scale once the count of clean steps reaches growth_interval: a count this
            # far below any interval keeps the scale where it is (a growing scale, with overflows that
            # cannot be reported, would end by zeroing every example).
            tracker.fill_(-(2**30))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` and ``grad_sample`` of the parameters, and the accumulated clipped sum
        unless a logical step is open (the last ``step()`` was skipped): virtual steps call
        ``zero_grad()`` between micro-batches of one logical batch."""
        for param in self.clipper.params:
            if getattr(param, "grad_sample", None) is not None:
                param.grad_sample = None
        if not self._in_logical_step:
            # Everything gathered for the open step is dropped: nothing of it is released or counted.
            self.clipper.reset()
            self.contract.discard()
            for module in self.contract.modules:
                module._grad_sample_ticket = None
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def discard_logical_step(self) -> None:
        """Drop a partly accumulated logical step (nothing was released, nothing is recorded) and
        any pending skip: used when a loop stops between micro-batches of one logical batch."""
        for param in self.clipper.params:
            if getattr(param, "grad_sample", None) is not None:
                param.grad_sample = None
        for module in self.contract.modules:
            module._grad_sample_ticket = None
        self.clipper.reset()
        self.contract.discard()
        self._skip_next_step = False
        self._in_logical_step = False

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus the DP state under ``"privacy_engine.dp_state"``:
        noise mechanism (outside secure mode its generator states: the future noise), clipper
        accumulator, counters. Plain data only (loads with ``torch.load(weights_only=True)``).
        Keep it as secret as the training data."""
        state = self.original_optimizer.state_dict()
        state[STATE_DICT_KEY] = {
            "noise": self.noise.state_dict(),
            "clipper": self.clipper.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "steps_taken": self.steps_taken,
            "skip_next_step": self._skip_next_step,
            "in_logical_step": self._in_logical_step,
        }
        return state

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise ``ValueError`` naming the first mismatch unless ``load_state_dict(state_dict)``
        restores it onto this optimizer; changes nothing.

        ==============================================  ==================================
        mismatch                                        error names
        ==============================================  ==================================
        not a dict / no DP state                        the missing part
        number of param groups / parameters per group   the group
        a hyperparameter of this class missing          the keys (another optimizer class)
        per-parameter state for an unknown index, or    the parameter index and state key
        a tensor of another shape than the parameter
        noise state (mechanism, layout, generators)     see NoiseMechanism.check_state_dict
        clipper mode / bounds / accumulator shapes      the clipper field
        counters of the wrong type                      the counter
        ==============================================  ==================================
        """
        if not isinstance(state_dict, dict) or STATE_DICT_KEY not in state_dict:
            raise ValueError(
                f"the optimizer state has no DP state ({STATE_DICT_KEY!r}): it was not saved from a DPOptimizer"
            )
        groups, saved_groups = self.original_optimizer.param_groups, state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
            count = len(saved_groups) if isinstance(saved_groups, list) else saved_groups
            raise ValueError(f"the optimizer state has {count} param groups, this optimizer has {len(groups)}")
        params = [p for group in groups for p in group["params"]]
        for index, (saved, group) in enumerate(zip(saved_groups, groups)):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
                raise ValueError(f"the optimizer state's param group {index} is not a param group")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"the optimizer state's param group {index} has {len(saved['params'])} parameters, this "
                    f"optimizer's has {len(group['params'])}: make the same parameters private as in the saved run"
                )
            # Every hyperparameter of this optimizer's class must be there (extra keys, such as an LR
            # scheduler's initial_lr, are fine).
            lacking = sorted(set(self.original_optimizer.defaults) - set(saved))
            if lacking:
                raise ValueError(
                    f"the optimizer state's param group {index} lacks {lacking}, which this "
                    f"{type(self.original_optimizer).__name__} has: another optimizer class was saved"
                )
        saved_ids = [i for saved in saved_groups for i in saved["params"]]
        position = {saved_id: n for n, saved_id in enumerate(saved_ids)}
        per_parameter = state_dict.get("state")
        if not isinstance(per_parameter, dict):
            raise ValueError("the optimizer state's 'state' is not a dict")
        for key, values in per_parameter.items():
            if key not in position:
                raise ValueError(f"the optimizer state holds state for parameter {key!r}, which no param group lists")
            param = params[position[key]]
            for name, value in (values.items() if isinstance(values, dict) else ()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                    raise ValueError(
                        f"the optimizer state's {name!r} for parameter {position[key]} has shape {list(value.shape)}, "
                        f"the parameter has shape {list(param.shape)}: resume with the same model"
                    )
        dp_state = state_dict[STATE_DICT_KEY]
        required = ("noise", "clipper", "noise_multiplier", "steps_taken", "skip_next_step", "in_logical_step")
        missing = [key for key in required if not isinstance(dp_state, dict) or key not in dp_state]
        if missing:
            raise ValueError(f"the optimizer's DP state lacks {missing} (it was altered)")
        try:
            _check_noise_multiplier(dp_state["noise_multiplier"])
        except TypeError as error:
            raise ValueError(str(error)) from error
        steps = dp_state["steps_taken"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"the optimizer's DP state has steps_taken={steps!r}; expected an int >= 0")
        for flag in ("skip_next_step", "in_logical_step"):
            if not isinstance(dp_state[flag], bool):
                raise ValueError(f"the optimizer's DP state has {flag}={dp_state[flag]!r}; expected a bool")
        self.noise.check_state_dict(dp_state["noise"], tensors=self.clipper.params)
        self._check_clipper_state(dp_state["clipper"])

    def _check_clipper_state(self, saved: Any) -> None:
        current = self.clipper.state_dict()
        if not isinstance(saved, dict) or not {"accumulated", "totals", "bounds", "clipping"} <= set(saved):
            raise ValueError("the clipper state is not a dict from PerSampleGradientClipper.state_dict()")
        if saved["clipping"] != current["clipping"] or list(saved["bounds"]) != list(current["bounds"]):
            raise ValueError(
                f"the clipper state was saved with clipping={saved['clipping']!r}, max_grad_norm bounds "
                f"{list(saved['bounds'])}; this run has clipping={current['clipping']!r}, bounds "
                f"{list(current['bounds'])}: make_private with the clipping of the saved run"
            )
        accumulated = saved["accumulated"]
        if not isinstance(accumulated, dict):
            raise ValueError("the clipper state's accumulator is not a dict")
        params = self.clipper.params
        for index, total in accumulated.items():
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params):
                raise ValueError(f"the clipper state accumulates parameter {index!r}, which this run does not have")
            if not isinstance(total, torch.Tensor) or tuple(total.shape) != tuple(params[index].shape):
                raise ValueError(
                    f"the clipper state's sum for parameter {index} does not have the parameter's shape "
                    f"{list(params[index].shape)}"
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` so training continues exactly (same noise as the run that
        saved it; secure mode: fresh OS-seeded generators). A plain optimizer state dict (no DP
        state) loads the wrapped optimizer only, with a warning. Everything is checked first
        (``check_state_dict``); on an error nothing is changed."""
        state_dict = dict(state_dict)
        if STATE_DICT_KEY not in state_dict:
            warnings.warn(
                "state_dict has no DP state (saved from a plain optimizer?): only the wrapped optimizer's "
                "state is loaded; the noise continues from its current state"
            )
            self.original_optimizer.load_state_dict(state_dict)
            return
        self.check_state_dict(state_dict)
        dp_state = state_dict.pop(STATE_DICT_KEY)
        inner_backup = copy.deepcopy(self.original_optimizer.state_dict())
        clipper_backup = self.clipper.state_dict()
        noise_backup = self.noise.state_dict()
        try:
            self.original_optimizer.load_state_dict(state_dict)
            self.clipper.load_state_dict(dp_state["clipper"])
            self.noise.load_state_dict(dp_state["noise"])
        except BaseException:
            self.original_optimizer.load_state_dict(inner_backup)
            self.clipper.load_state_dict(clipper_backup)
            self.noise.load_state_dict(noise_backup)
            raise
        self.noise_multiplier = float(dp_state["noise_multiplier"])
        self.steps_taken = int(dp_state["steps_taken"])
        self._skip_next_step = bool(dp_state["skip_next_step"])
        self._in_logical_step = bool(dp_state["in_logical_step"])

    # ------------------------------------------------------------------ step hooks (Opacus's extension point)
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


def trainable_parameters(optimizer: Optimizer) -> list[nn.Parameter]:
    """The parameters of ``optimizer`` that ``DPOptimizer`` clips and noises, in order."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
