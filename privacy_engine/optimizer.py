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
    frozen parameter (requires_grad off)  left alone: no clipping, no noise
    closure given                         evaluated once (with grad), then as above
    zero_grad() between micro-batches     keeps the accumulated sum of the logical step
    ====================================  ==============================================

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
        if padding_mask is None:
            padding_mask = self.current_padding_mask()
        self.clipper.clip_and_accumulate(padding_mask=padding_mask, group_ids=group_ids)

    def current_padding_mask(self) -> torch.Tensor | None:
        """The padding mask of the batch being trained on (from ``padding_mask_source``, which
        ``VirtualSteps`` redirects to the micro-batch's slice), or None. Fast clipping reads it at
        the end of each backward pass."""
        return None if self.padding_mask_source is None else self.padding_mask_source()

    def _has_grad_samples(self) -> bool:
        return any(getattr(p, "grad_sample", None) is not None for p in self.clipper.params)

    def pre_step(self) -> bool:
        """Clip what is waiting; if this step is not skipped, write the private gradient (clipped
        sum + noise, divided by the expected batch size) into ``.grad`` and record the step.
        Returns whether the wrapped optimizer should step now."""
        if self._has_grad_samples():
            self.clip_and_accumulate()
        if self._skip_next_step:
            self._skip_next_step = False
            self._in_logical_step = True
            return False
        self._in_logical_step = False
        self.last_clipping_stats = self.clipper.pre_step()
        grads = [p.grad for p in self.clipper.params]
        try:
            self.noise.add_noise_(grads, self.noise_multiplier, self.clipper.sensitivity)
        except BaseException:
            # The .grad tensors hold the un-noised clipped sum: never leave it where a later
            # optimizer step could use it.
            for param in self.clipper.params:
                param.grad = None
            raise
        self.steps_taken += 1
        if self.accountant is not None:
            # Every released step is recorded, an empty batch's too: its noise was drawn for a
            # batch that could have held any example.
            self.accountant.step(
                noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate, num_bands=self.num_bands
            )
        if self.loss_reduction == "mean":
            # Divide by the expected batch size, not the realised one: the realised size depends
            # on which examples were sampled, and dividing by it would release that number
            # without noise (and change the sensitivity).
            torch._foreach_div_(grads, self.expected_batch_size)
        return True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.pre_step():
            # The closure is not passed on: re-evaluating it would overwrite the private .grad.
            self.original_optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` and ``grad_sample`` of the parameters, and the accumulated clipped sum
        unless a logical step is open (the last ``step()`` was skipped): virtual steps call
        ``zero_grad()`` between micro-batches of one logical batch."""
        for param in self.clipper.params:
            if getattr(param, "grad_sample", None) is not None:
                param.grad_sample = None
        if not self._in_logical_step:
            self.clipper.reset()
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def discard_logical_step(self) -> None:
        """Drop a partly accumulated logical step (nothing was released, nothing is recorded) and
        any pending skip: used when a loop stops between micro-batches of one logical batch."""
        for param in self.clipper.params:
            if getattr(param, "grad_sample", None) is not None:
                param.grad_sample = None
        self.clipper.reset()
        self._skip_next_step = False
        self._in_logical_step = False

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus the DP state under ``"privacy_engine.dp_state"``:
        noise mechanism (generator states: the future noise), clipper accumulator, counters.
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` so training continues exactly (same noise as the run that
        saved it). A plain optimizer state dict (no DP state) loads the wrapped optimizer only,
        with a warning. On error nothing is changed."""
        state_dict = dict(state_dict)
        dp_state = state_dict.pop(STATE_DICT_KEY, None)
        if dp_state is None:
            warnings.warn(
                "state_dict has no DP state (saved from a plain optimizer?): only the wrapped optimizer's "
                "state is loaded; the noise continues from its current state"
            )
            self.original_optimizer.load_state_dict(state_dict)
            return
        noise_multiplier = _check_noise_multiplier(dp_state["noise_multiplier"])
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
        self.noise_multiplier = noise_multiplier
        self.steps_taken = int(dp_state["steps_taken"])
        self._skip_next_step = bool(dp_state["skip_next_step"])
        self._in_logical_step = bool(dp_state["in_logical_step"])


def trainable_parameters(optimizer: Optimizer) -> list[nn.Parameter]:
    """The parameters of ``optimizer`` that ``DPOptimizer`` clips and noises, in order."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
