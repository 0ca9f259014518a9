"""The settings of ``make_private`` and ``make_private_with_epsilon``: one frozen, keyword-only
dataclass (``PrivacyOptions``), validated in one place with errors that name the field.

The two entry points take the settings as keywords and build it (``options_from``); what each one
requires or refuses is a row of ``ENTRY_POINTS``, and ``takes_settings`` shows the fields in the
methods' signatures (``help``, ``inspect.signature``), so the list of settings is written once.
Each setting is checked by its one function in ``privacy_engine.settings_checks`` (the one a
hand-built ``DPOptimizer``, ``ClippingConfig`` and the noise mechanisms call too). The fields that
cannot change what is released or how it is accounted are also grouped as ``PerformanceFlags``
(``PrivacyOptions.performance``). The objects' two spellings (``model``/``module``,
``loader``/``data_loader``) are read by ``model_and_loader``; accountant names by ``resolve_accountant``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from accountants import Accountant, make_accountant
from privacy_engine.auditing.config import AuditConfig
from privacy_engine.clipping import AdaptiveClippingOptions
from privacy_engine.engine.budget import PrivacyBudget, budget_from
from privacy_engine.engine.limits import check_bandmf_size, check_target_epsilon
from privacy_engine.noise import NoiseMechanism
from privacy_engine.noise.blt import MAX_NUM_BUFFERS
from privacy_engine.noise.strategy import validated_coefficients
from privacy_engine.settings_checks import (
    check_clipping,
    check_count,
    check_flag,
    check_grad_sample_mode,
    check_loss_reduction,
    check_max_grad_norms,
    check_no_seed_for_given_noise,
    check_noise_generator,
    check_noise_multiplier,
    check_noise_seed,
    check_noise_std,
    check_noise_stream,
    check_privacy_unit,
    check_rescale_to_unit_norm,
    check_target_delta,
    total_bound,
)
from privacy_engine.settings_checks import check_target_epsilon as check_target_epsilon_value

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_MAX_NOISE_STD = _FLOAT32_MAX / 2**20  # headroom for tail draws and norms of the noise (~3.2e32)

__all__ = [
    "ACCOUNTANT_ALIASES",
    "ENTRY_POINTS",
    "PerformanceFlags",
    "PrivacyOptions",
    "model_and_loader",
    "options_from",
    "resolve_accountant",
    "takes_settings",
]

#: The one table of accountant names: each accepted name -> the ``accountants`` name it builds.
#: "prv" (a privacy-random-variable accountant, numerical like PLD, computing the same epsilon of the
#: composed sampled Gaussian) is read as dp-accounting's PLD accountant.
ACCOUNTANT_ALIASES = {"pld": "pld", "prv": "pld", "rdp": "rdp"}
NOISE_MECHANISMS = ("gaussian", "bandmf", "blt", "auto")
#: Adaptive clipping's options (``AdaptiveClippingOptions``' fields), Opacus's names.
_ADAPTIVE_OPTIONS = (
    "target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound", "min_clipbound", "unclipped_num_std",
)


@dataclass(frozen=True, kw_only=True)
class PerformanceFlags:
    """The settings that cannot affect privacy: they choose how the clipped sum is computed, never
    the bound each example is clipped to, the noise, the sampling or what is accounted. A reviewer
    checking the guarantee may skip them; ``PrivacyOptions.performance`` gives a run's.

    Keyword Args:
        grad_sample_mode: ``"auto"`` (the default: hooks or ghost, chosen for the model by
            ``engine.mode_choice``), ``"hooks"``, ``"functorch"``, ``"ew"`` (an alias of ``"hooks"``),
            ``"ghost"`` (fast clipping in the backward pass) or ``"no_op"`` (the loop sets
            ``p.grad_sample``): every mode clips each example's gradient to ``max_grad_norm``.
        grad_scaler: a ``torch.amp.GradScaler`` for fp16 loss scaling; clipping happens at the
            unscaled size, so the bound is the same with or without it.
    """

    grad_sample_mode: str = "auto"
    grad_scaler: torch.amp.GradScaler | None = None

    def __post_init__(self) -> None:
        check_grad_sample_mode(self.grad_sample_mode)
        if self.grad_scaler is not None and not isinstance(self.grad_scaler, torch.amp.GradScaler):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler or None; got {type(self.grad_scaler).__name__}"
            )


@dataclass(frozen=True, kw_only=True)
class PrivacyOptions:
    """Every setting of ``make_private`` / ``make_private_with_epsilon`` (the model, optimizer and
    loader aside). Both methods take these fields as keywords; each is checked here, before
    anything is wrapped, by its one function in ``privacy_engine.settings_checks`` (the error names
    it). ``grad_sample_mode`` and ``grad_scaler`` cannot affect privacy (``PerformanceFlags``,
    ``performance``); every other field decides what is released or how it is accounted.

    The names are those Opacus uses for the same settings, so a script written for Opacus needs no
    renaming.

    Keyword Args:
        noise_multiplier: sigma >= 0 (noise std / sensitivity). ``make_private`` needs it;
            ``make_private_with_epsilon`` calibrates it (and refuses it).
        target_epsilon, epochs: ``make_private_with_epsilon``'s target: the whole run of ``epochs``
            epochs stays within ``(target_epsilon, target_delta)``.
        max_grad_norm: ``clipping="flat"``: one bound > 0. ``"per_layer"``: a list with one bound per
            *layer* (each submodule directly owning trainable parameters, in ``model.named_modules()``
            order) or one per trainable *parameter* (in optimizer order); the length decides which. A
            single number is split evenly over the layers (``C / sqrt(layers)`` each, total bound ``C``).
        target_delta, max_epsilon: a privacy budget (``privacy_engine.engine.budget``): the optimizer
            raises ``PrivacyBudgetExceeded`` before any release that would take ``get_epsilon(target_delta)``
            past ``max_epsilon``, releasing and recording nothing; ``engine.steps_left()`` says how many
            steps remain. Both or neither (``max_epsilon=math.inf``: no budget). With a target,
            ``max_epsilon`` defaults to ``target_epsilon``.
        poisson_sampling: Poisson-sample batches (True, what the accounting assumes) or keep the loader
            (False: its shuffled batches are accounted as if Poisson, an approximation; a warning says
            so). BandMF needs True.
        clipping: ``"flat"`` or ``"per_layer"``; ``"adaptive"`` / ``"per_layer_adaptive"``: the same, with
            adaptive clipping (Andrew et al. 2021, ``privacy_engine.clipping.adaptive``): ``max_grad_norm`` is
            the initial clip norm (per layer: norms), each then tracking ``target_unclipped_quantile`` of the
            per-example norms; needs the five options below. Recommended with ``rescale_to_unit_norm=True``
            (the release divided by the clip norm in force, so the model's step does not scale with it).
        target_unclipped_quantile, clipbound_learning_rate, max_clipbound, min_clipbound, unclipped_num_std:
            adaptive clipping's options (``AdaptiveClippingOptions``, as Opacus's ``AdaClipDPOptimizer``),
            all required with an adaptive ``clipping`` and refused without. The gradient is noised at
            sigma_delta = (sigma^-2 - G (2 unclipped_num_std)^-2)^(-1/2), so that the step (gradient and count)
            is accounted as DP-SGD at ``noise_multiplier``; needs ``2 unclipped_num_std > sqrt(G) sigma``.
        loss_reduction: ``"mean"`` or ``"sum"``: how the loss reduces over the batch.
        batch_first: the batch is dim 0 (True) or dim 1 of the model's inputs.
        noise_seed: seed for reproducible noise (``None``: one draw from torch's global generator, so
            ``torch.manual_seed`` makes a run reproducible, as with Opacus; never in secure mode).
        noise_generator: a ``torch.Generator`` that seeds the noise (one draw) and drives Poisson
            sampling (as Opacus's ``noise_generator`` does).
        noise_stream: the random stream the noise's standard Gaussian draws come from, for every noise
            mechanism the engine builds (``NoiseMechanism``'s ``noise_stream``): ``"mt19937"`` (the default:
            torch's serial generator, one core per draw) or ``"counter-v1"`` (``noise.counter_stream``: drawn
            on ``torch.get_num_threads()`` threads, the same numbers at any thread count). Both are iid
            Gaussian, so the privacy guarantee and the accounting are the same; only the seeded numbers
            differ. A checkpoint resumes on the stream it was saved with, whatever this setting says.
            Refused with a ready ``NoiseMechanism`` (give it its own ``noise_stream``) and under FSDP.
        grad_sample_mode: ``"hooks"`` or ``"functorch"`` (both: exact per-sample gradients, with
            ``torch.func`` for layers without a registered sampler), or ``"ghost"``: fast clipping
            inside the backward pass (``GhostClippingModule``). The engine returns ``(module,
            optimizer, data_loader)`` in every mode (unlike Opacus, whose ghost mode also returns a
            wrapped criterion). ``"ew"`` is an alias of ``"hooks"`` (the same exact gradients; Opacus
            computes them differently). ``"no_op"``: the loop computes the per-sample gradients itself
            and sets ``p.grad_sample`` (``ManualGradSampleModule``). ``"auto"`` (the default): ghost for a
            model with trainable convolutions whose every layer has a registered sampler (plain settings),
            hooks otherwise; the rule, and the INFO log of the choice, are ``engine.mode_choice``'s.
        noise_mechanism: ``"gaussian"`` (DP-SGD), ``"bandmf"`` (banded matrix factorisation,
            Choquette-Choo et al. 2023, with cyclic Poisson sampling over ``num_bands`` groups), ``"blt"``
            (buffered-linear-Toeplitz noise, ``noise.blt``: ``num_buffers`` buffers per parameter, cyclic
            sampling over ``num_bands`` groups, accounted without amplification), ``"auto"``
            (``make_private_with_epsilon`` only: DP-SGD, BandMF and BLT each calibrated to the target, the
            lowest expected error of the noisy prefix sums wins, ``engine.mechanism_choice``), or a ready
            ``NoiseMechanism``.
        num_bands: BandMF bands b (1 is DP-SGD), at most the steps per epoch (``round(len(dataset) /
            batch_size)``) and at most ``len(dataset) // batch_size``. ``None``: with
            ``make_private_with_epsilon``, chosen among ``CANDIDATE_NUM_BANDS`` that the loader allows, each
            b calibrated to the target, by the expected squared error of the noisy prefix sums,
            ``strategy_loss(c_b, total_steps) * sigma_b^2`` (``engine.bands``); logged (INFO) and kept in
            ``engine.noise_plan``. ``make_private`` (a given sigma) needs it: at one sigma more bands always
            look better while each costs more epsilon, so there is no fair choice. With ``"blt"``: the
            cyclic groups (the min separation of an example's steps; default the most the loader allows).
        num_buffers: BLT's buffers per parameter (default ``mechanism_choice.DEFAULT_NUM_BUFFERS``).
        max_noise_memory: with ``"auto"``: the most bytes of noise state the chosen mechanism may hold
            (rows of the trainable parameters' size: DP-SGD 1, BandMF b, BLT d + 1).
        bandmf_coefficients: the strategy ``(c_0, ..., c_{b-1})``, ``c_0 > 0``; default: the optimal
            b-banded Toeplitz strategy for ``total_steps`` steps.
        total_steps: the number of steps the run will take (the strategy is optimised for it; more
            steps stay private, the strategy is just less tuned). Default with a target: the steps of
            ``epochs`` epochs.
        max_batch_size: truncated sampling: each batch holds at most this many real examples (a random
            subset if more are drawn) and is padded to exactly this size; padding entries
            (``loader.padding_mask``) contribute zero after clipping, and the steps are accounted as
            truncated Poisson sampling (PLD accountant only). DP-SGD or BandMF.
        nan_safe, rescale_to_unit_norm: see ``PerSampleGradientClipper``.
        grad_scaler: a ``torch.amp.GradScaler`` for fp16 loss scaling, attached to the private
            optimizer (``DPOptimizer.attach_grad_scaler``: clipping at the unscaled size).
        audit: an ``auditing.AuditConfig``: one-run auditing (``engine.audit_report()``) with gradient
            canaries added to the clipped sums before the noise (counted in no accounting), or input
            canaries (``kind="input"``) appended to the loader's dataset (examples: the dataset's size,
            sample rate and accounting are those of the enlarged dataset; no DDP); ``None``: none. Needs
            Poisson sampling (``poisson_sampling=True``) and no ``max_batch_size``: only there does a
            canary take part exactly as an example does.
        privacy_unit: ``"example"`` (default: neighbouring datasets differ by one example) or ``"user"``
            (user-level DP: they differ by one user, all of its examples; ``training.user_sampling``). With
            ``"user"``, each step Poisson-samples users at ``q = loader.batch_size / users`` (the loader's
            batch size is the expected number of *users* per batch, and an epoch is ``round(users /
            batch_size)`` steps), each sampled user contributes ``examples_per_user`` rows, the sum of one
            user's per-example gradients (each the gradient of that example's own loss, as for examples
            with either ``loss_reduction``) is clipped to ``max_grad_norm`` once, the noisy sum is divided
            by the expected users per batch (``"mean"``), and each step is accounted as DP-SGD at rate
            ``q`` over users (BandMF, BLT and "auto": cyclic Poisson sampling over ``num_bands`` groups of
            users, the mechanism's event with the user as the unit). Hooks, functorch, no_op and ghost modes
            (ghost: each user's norm from its rows stacked, or its per-example gradients summed;
            ``clipping.ghost.backward``); DDP (user ``u`` on rank ``u mod world_size``,
            ``training.user_sampling.distributed_user_level_loader``); refused (with why) with
            ``max_batch_size``, ``poisson_sampling=False``, adaptive clipping and input canaries.
            ``VirtualSteps`` cuts a logical batch between users only (micro-batches of a multiple of
            ``examples_per_user`` rows), so each user is still clipped once.
        user_ids: with ``privacy_unit="user"`` (required there, refused otherwise): the user of every
            example, a sequence aligned with the dataset (``user_ids[i]`` is example ``i``'s user) or a
            function of the dataset index; ids are ints or strs.
        examples_per_user: with ``privacy_unit="user"``: the rows k each sampled user contributes per step
            (default 1): its next k examples, cycling through them (JAX Privacy's
            ``UserSelectionStrategy``; a user owning fewer than k repeats some).
        shuffle_user_examples: with ``privacy_unit="user"``: cycle through each user's examples in one
            random order drawn at the start (default False: increasing dataset index).
    """

    max_grad_norm: float | Sequence[float]
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    target_delta: float | None = None
    epochs: int | None = None
    max_epsilon: float | None = None
    poisson_sampling: bool = True
    clipping: str = "flat"
    loss_reduction: str = "mean"
    batch_first: bool = True
    noise_seed: int | None = None
    noise_generator: torch.Generator | None = None
    noise_stream: str = "mt19937"
    grad_sample_mode: str = "auto"
    noise_mechanism: str | NoiseMechanism = "gaussian"
    num_bands: int | None = None
    bandmf_coefficients: Sequence[float] | None = None
    num_buffers: int | None = None
    max_noise_memory: int | None = None
    total_steps: int | None = None
    max_batch_size: int | None = None
    nan_safe: bool = True
    rescale_to_unit_norm: bool = False
    grad_scaler: torch.amp.GradScaler | None = None
    audit: AuditConfig | None = None
    target_unclipped_quantile: float | None = None
    clipbound_learning_rate: float | None = None
    max_clipbound: float | None = None
    min_clipbound: float | None = None
    unclipped_num_std: float | None = None
    privacy_unit: str = "example"
    user_ids: Sequence[Any] | Callable[[int], Any] | None = dataclasses.field(default=None, repr=False)  # one per example
    examples_per_user: int | None = None
    shuffle_user_examples: bool = False

    def __post_init__(self) -> None:
        self._check_target_and_budget()
        self._check_noise_multiplier()
        self._check_choices()
        self._check_seeding()
        self._check_max_grad_norm()
        self._check_noise_std()
        self._check_noise_mechanism()
        self._check_max_batch_size()
        self._check_audit()
        self._check_privacy_unit()
        self.performance  # noqa: B018  (PerformanceFlags checks grad_sample_mode and grad_scaler)

    # ------------------------------------------------------------------ derived settings
    @property
    def target(self) -> tuple[float, float] | None:
        """``(target_epsilon, target_delta)`` when sigma is to be calibrated, else None."""
        return None if self.target_epsilon is None else (self.target_epsilon, self.target_delta)

    @property
    def sigma(self) -> float:
        """The given noise multiplier, or ``inf`` while it is to be calibrated (always > 0 then)."""
        return math.inf if self.noise_multiplier is None else self.noise_multiplier

    @property
    def wants_bandmf(self) -> bool:
        """BandMF by name, or a ready mechanism with more than one band (cyclic Poisson sampling)."""
        if isinstance(self.noise_mechanism, NoiseMechanism):
            return self.noise_mechanism.privacy_event().num_bands > 1
        return self.noise_mechanism in ("bandmf", "blt", "auto")  # cyclic sampling (BLT, "auto": may be)

    @property
    def performance(self) -> PerformanceFlags:
        """The settings that cannot affect privacy (``PerformanceFlags``)."""
        return PerformanceFlags(grad_sample_mode=self.grad_sample_mode, grad_scaler=self.grad_scaler)

    def budget(self) -> PrivacyBudget | None:
        """A new budget for one ``make_private`` call (None for none); it keeps state, so not a field."""
        return budget_from(self.target_epsilon if self.max_epsilon is None else self.max_epsilon, self.target_delta)

    # ------------------------------------------------------------------ validation
    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # a normalised value (float, int, tuple), set once here

    def _check_target_and_budget(self) -> None:
        if self.target_epsilon is None:
            if self.noise_multiplier is None:
                raise TypeError("noise_multiplier is needed (or target_epsilon, with make_private_with_epsilon)")
            if self.epochs is not None:
                raise TypeError("epochs goes with target_epsilon (make_private_with_epsilon)")
            if self.target_delta is not None and self.max_epsilon is None:
                raise ValueError(
                    "target_delta is the delta of a privacy budget: give max_epsilon too, or leave both out"
                )
        else:
            if self.noise_multiplier is not None:
                raise TypeError("make_private_with_epsilon calibrates noise_multiplier itself; do not pass it")
            target_epsilon = check_target_epsilon_value(self.target_epsilon)
            check_target_epsilon(target_epsilon)  # the calibration's cost grows with it (engine.limits)
            self._set("target_epsilon", target_epsilon)
            self._set("target_delta", check_target_delta(self.target_delta))
            self._set("epochs", check_count("epochs", self.epochs))
        self.budget()  # checks max_epsilon and target_delta, naming them

    def _check_noise_multiplier(self) -> None:
        if self.noise_multiplier is not None:
            self._set("noise_multiplier", check_noise_multiplier(self.noise_multiplier))

    @property
    def clipper_mode(self) -> str:
        """The clipper's mode: ``"flat"`` or ``"per_layer"`` (an adaptive ``clipping`` without its prefix)."""
        return {"adaptive": "flat", "per_layer_adaptive": "per_layer"}.get(self.clipping, self.clipping)

    @property
    def adaptive_clipping(self) -> AdaptiveClippingOptions | None:
        """Adaptive clipping's options (checked at construction), or None for fixed bounds."""
        if self.clipping == self.clipper_mode:
            return None
        return AdaptiveClippingOptions(**{name: getattr(self, name) for name in _ADAPTIVE_OPTIONS})

    def _check_choices(self) -> None:
        check_clipping(self.clipping, adaptive=True)
        given = [name for name in _ADAPTIVE_OPTIONS if getattr(self, name) is not None]
        if self.clipping == self.clipper_mode and given:
            raise ValueError(f"{given[0]} is an adaptive clipping option: it needs clipping='adaptive' (or "
                             f"'per_layer_adaptive'); got clipping={self.clipping!r}")  # fmt: skip
        if self.clipping != self.clipper_mode:
            missing = [name for name in _ADAPTIVE_OPTIONS if getattr(self, name) is None]
            if missing:
                raise ValueError(f"clipping={self.clipping!r} needs {missing} (adaptive clipping's options)")
            self.adaptive_clipping  # noqa: B018  (AdaptiveClippingOptions checks each, naming it)
        check_loss_reduction(self.loss_reduction)
        for name in ("batch_first", "poisson_sampling", "nan_safe"):
            check_flag(name, getattr(self, name))

    def _check_seeding(self) -> None:
        check_noise_seed(self.noise_seed)
        check_noise_generator(self.noise_generator)
        check_noise_stream(self.noise_stream)
        if self.noise_seed is not None and self.noise_generator is not None:
            raise ValueError("give noise_seed or noise_generator, not both")

    def _check_max_grad_norm(self) -> None:
        """The bounds themselves (each > 0 here: a bound of 0 trains nothing); their number against
        the model's layers is the plan's check. A list is kept as a tuple of floats."""
        bounds = check_max_grad_norms(self.max_grad_norm, clipping=self.clipper_mode, positive=True)
        if isinstance(bounds, tuple):
            self._set("max_grad_norm", bounds)
        check_rescale_to_unit_norm(self.rescale_to_unit_norm, total_bound(bounds))

    def _check_noise_std(self) -> None:
        """The noise std, noise_multiplier * max_grad_norm (per-layer: times the norm of the bounds), must
        be finite in float32, where the noise is drawn and added: beyond, the released gradient and the
        parameters become inf/NaN. The limit leaves room for the Gaussian's tail (draws of ~10 std) and
        for the sum of many coordinates' noise in a norm. An infinite bound with noise is refused."""
        bound = total_bound(self.max_grad_norm)
        if self.noise_multiplier is None:
            # Calibrated later, always > 0: what can be refused now is noise on unclipped gradients.
            check_noise_std(1.0, bound)
        else:
            check_noise_std(self.noise_multiplier, bound, limit=_MAX_NOISE_STD)

    def _check_noise_mechanism(self) -> None:
        mechanism = self.noise_mechanism
        if isinstance(mechanism, NoiseMechanism):
            check_no_seed_for_given_noise(self.noise_seed, self.noise_generator)
            if self.noise_stream != "mt19937":
                raise ValueError("noise_stream chooses the stream of the noise the engine builds: pass noise_stream= "
                                 "to the noise mechanism you build yourself instead")  # fmt: skip
            if self.wants_bandmf and not self.poisson_sampling:
                raise ValueError("poisson_sampling must be True for a BandMF noise mechanism (cyclic Poisson sampling)")
            return
        if not isinstance(mechanism, str) or mechanism not in NOISE_MECHANISMS:
            raise ValueError(
                f"noise_mechanism must be one of {NOISE_MECHANISMS} or a NoiseMechanism; got {mechanism!r}"
            )
        if self.num_buffers is not None and mechanism != "blt":
            raise ValueError("num_buffers (BLT's buffers) needs noise_mechanism='blt'")
        if self.max_noise_memory is not None and mechanism != "auto":
            raise ValueError("max_noise_memory (a budget for the automatic choice) needs noise_mechanism='auto'")
        if mechanism == "gaussian":
            if self.num_bands not in (None, 1) or self.bandmf_coefficients is not None:
                raise ValueError("num_bands / bandmf_coefficients need noise_mechanism='bandmf'")
            return
        if mechanism in ("blt", "auto"):
            self._check_blt_or_auto()
            return
        self._check_bandmf()

    def _check_blt_or_auto(self) -> None:
        mechanism = self.noise_mechanism
        if not self.poisson_sampling:
            raise ValueError(f"noise_mechanism={mechanism!r} needs poisson_sampling=True: its participation bound "
                             "rests on cyclic Poisson sampling (each example in one of b groups)")  # fmt: skip
        if self.bandmf_coefficients is not None:
            raise ValueError(f"bandmf_coefficients needs noise_mechanism='bandmf', not {mechanism!r}")
        if mechanism == "blt" and self.clipping != self.clipper_mode:
            raise ValueError(f"noise_mechanism='blt' with clipping={self.clipping!r}: BLT's correlated noise needs one "
                             "clip norm for the whole run (no row rescaling as BandMF has); use clipping='flat' or "
                             "'per_layer', or noise_mechanism='bandmf' / 'gaussian'")  # fmt: skip
        if mechanism == "auto":
            if self.target is None:
                raise ValueError("noise_mechanism='auto' compares the mechanisms at equal epsilon: use "
                                 "make_private_with_epsilon (at a given noise_multiplier they are not comparable)")  # fmt: skip
            if self.num_bands is not None:
                raise ValueError("num_bands with noise_mechanism='auto': the band counts are compared; name "
                                 "noise_mechanism='bandmf' or 'blt' to fix them")  # fmt: skip
            if self.max_noise_memory is not None:
                self._set("max_noise_memory", check_count("max_noise_memory", self.max_noise_memory,
                                                          what="bytes of noise state, or None"))  # fmt: skip
        if self.num_bands is not None:
            self._set("num_bands", check_count("num_bands", self.num_bands, what="the cyclic groups, or None"))
        if self.num_buffers is not None:
            self._set("num_buffers", check_count("num_buffers", self.num_buffers, what="BLT's buffers, or None"))
            if self.num_buffers > MAX_NUM_BUFFERS:
                raise ValueError(f"num_buffers={self.num_buffers} exceeds {MAX_NUM_BUFFERS} (noise.blt.MAX_NUM_BUFFERS)")
        if self.total_steps is not None:
            check_count("total_steps", self.total_steps, what="the number of steps of the run")
        check_bandmf_size(total_steps=None if self.total_steps is None else int(self.total_steps), num_bands=None,
                          optimised=True)  # fmt: skip
        if self.total_steps is None and self.epochs is None:
            raise ValueError(f"total_steps is needed with noise_mechanism={mechanism!r} (the strategy is optimised "
                             "for the number of steps of the run)")  # fmt: skip

    def _check_bandmf(self) -> None:
        if not self.poisson_sampling:
            raise ValueError(
                "noise_mechanism='bandmf' needs poisson_sampling=True: its privacy rests on cyclic Poisson sampling "
                "(every example in one of b groups, each sampled only every b steps)"
            )
        num_bands = self.num_bands
        if num_bands is not None:
            num_bands = check_count("num_bands", num_bands, what="or None to choose it, with noise_mechanism='bandmf'")
        if self.bandmf_coefficients is not None:
            coefficients = validated_coefficients(self.bandmf_coefficients, name="bandmf_coefficients")
            coefficients = tuple(float(c) for c in coefficients)
            if num_bands is not None and len(coefficients) != num_bands:
                raise ValueError(f"bandmf_coefficients has {len(coefficients)} entries but num_bands={num_bands}")
            self._set("bandmf_coefficients", coefficients)
            num_bands = len(coefficients)
        if num_bands is not None:
            self._set("num_bands", int(num_bands))
        if self.total_steps is not None:
            check_count("total_steps", self.total_steps, what="the number of steps of the run")
        # Before anything is allocated: the strategy's memory and time grow with both.
        check_bandmf_size(total_steps=None if self.total_steps is None else int(self.total_steps),
                          num_bands=None if num_bands is None else int(num_bands),
                          optimised=self.bandmf_coefficients is None)  # fmt: skip
        if self.bandmf_coefficients is None and self.total_steps is None and self.epochs is None:
            raise ValueError(
                "total_steps is needed with noise_mechanism='bandmf' (the strategy is optimised for the number of "
                "steps of the run), unless you give bandmf_coefficients"
            )

    def _check_max_batch_size(self) -> None:
        if self.max_batch_size is None:
            return
        max_batch_size = check_count("max_batch_size", self.max_batch_size,
                                     what="the cap on real examples per batch, or None")  # fmt: skip
        if not self.poisson_sampling:
            raise ValueError("max_batch_size (truncated Poisson sampling) needs poisson_sampling=True")
        self._set("max_batch_size", max_batch_size)

    def _check_audit(self) -> None:
        """Auditing only where a canary takes part exactly as an example does (so that the accountant's epsilon
        covers it): Poisson (or cyclic Poisson) sampling, without truncation."""
        if self.audit is None:
            return
        if not isinstance(self.audit, AuditConfig):
            raise TypeError(f"audit must be a privacy_engine.auditing.AuditConfig or None; got {self.audit!r}")
        if not self.poisson_sampling:
            raise ValueError(
                "audit needs poisson_sampling=True: with the loader's fixed-size shuffled batches a canary cannot take "
                "part as an example does (each example is in exactly one batch an epoch), so the audit would not be exact"
            )
        if self.max_batch_size is not None:
            raise ValueError(
                "audit with max_batch_size (truncated sampling) is refused: a canary would not be subject to the "
                "truncation as an example is, so the audit would not be exact"
            )

    def _check_privacy_unit(self) -> None:
        """User-level DP only where every part of the step treats the user as the unit; elsewhere a clear refusal."""
        check_privacy_unit(self.privacy_unit)
        check_flag("shuffle_user_examples", self.shuffle_user_examples)
        if self.privacy_unit == "example":
            given = [name for name in ("user_ids", "examples_per_user") if getattr(self, name) is not None]
            given += ["shuffle_user_examples"] if self.shuffle_user_examples else []
            if given:
                raise ValueError(f"{given[0]} is a user-level setting: it needs privacy_unit='user'")
            return
        if self.user_ids is None:
            raise ValueError("privacy_unit='user' needs user_ids: the user of every example (a sequence aligned "
                             "with the dataset, or a function of the dataset index)")  # fmt: skip
        if isinstance(self.user_ids, (str, bytes)) or not (callable(self.user_ids) or hasattr(self.user_ids, "__len__")):
            raise TypeError(f"user_ids must be a sequence aligned with the dataset or a function of the index; "
                            f"got {type(self.user_ids).__name__}")  # fmt: skip
        self._set("examples_per_user", check_count(
            "examples_per_user", 1 if self.examples_per_user is None else self.examples_per_user,
            what="the rows each sampled user contributes per step"))  # fmt: skip
        refusals = (
            (self.max_batch_size is not None, "max_batch_size (truncated sampling of users is not implemented)"),
            (not self.poisson_sampling, "poisson_sampling=False (the accounting needs users Poisson-sampled)"),
            (self.adaptive_clipping is not None, (
                "adaptive clipping (its count of unclipped users is not implemented at the user level); use "
                "clipping='flat' or 'per_layer'")),
            (self.audit is not None and self.audit.kind == "input", (
                'audit=AuditConfig(kind="input") (input canaries would need user ids); use kind="gradient"')),
        )  # fmt: skip
        for refused, what in refusals:
            if refused:
                raise ValueError(f"privacy_unit='user' with {what}")


# ---------------------------------------------------------------------------------------------- entry points
#: For each entry point: the settings it requires, and those it refuses (with why; None: not its keyword).
ENTRY_POINTS: dict[str, tuple[tuple[str, ...], dict[str, str | None]]] = {
    "make_private": (("noise_multiplier", "max_grad_norm"), {"target_epsilon": None, "epochs": None}),
    "make_private_with_epsilon": (
        ("target_epsilon", "target_delta", "epochs", "max_grad_norm"),
        {"noise_multiplier": "make_private_with_epsilon calibrates noise_multiplier itself; do not pass it"},
    ),
}
_FIELDS = tuple(dataclasses.fields(PrivacyOptions))


def options_from(entry_point: str, settings: dict[str, Any]) -> PrivacyOptions:
    """The ``PrivacyOptions`` of a call to ``entry_point`` with keywords ``settings``.

    ==================================  =========================================
    case                                result
    ==================================  =========================================
    a keyword that is no setting        TypeError naming it (and the accepted ones)
    a setting the entry point refuses   TypeError naming it
    a required setting missing          TypeError naming it
    a bad value                         PrivacyOptions' error naming the field
    ==================================  =========================================
    """
    required, refused = ENTRY_POINTS[entry_point]
    for name, why in refused.items():
        if name in settings and why is not None:
            raise TypeError(why)
    accepted = sorted(f.name for f in _FIELDS if f.name not in refused)
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise TypeError(
            f"{entry_point}() got unexpected keyword argument(s) {unknown}; the settings it accepts are "
            f"{accepted} (see PrivacyOptions)"
        )
    missing = [name for name in required if name not in settings]
    if missing:
        raise TypeError(f"{entry_point}() is missing the keyword argument(s) {missing} (see PrivacyOptions)")
    return PrivacyOptions(**settings)


Method = TypeVar("Method", bound=Callable[..., Any])


def takes_settings(entry_point: str) -> Callable[[Method], Method]:
    """Show the settings a method takes as ``**settings`` in its signature (``help``,
    ``inspect.signature``): its own parameters, then ``PrivacyOptions``' fields that
    ``entry_point`` accepts, as keyword-only parameters (required ones without a default)."""
    required, refused = ENTRY_POINTS[entry_point]

    def decorate(method: Method) -> Method:
        signature = inspect.signature(method)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in own}
        shown = [field for field in _FIELDS if field.name not in refused and field.name not in taken]
        shown.sort(key=lambda field: required.index(field.name) if field.name in required else len(required))
        settings = [
            inspect.Parameter(
                field.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=field.type,
                default=inspect.Parameter.empty if field.name in required else field.default,
            )
            for field in shown
        ]
        method.__signature__ = signature.replace(parameters=own + settings)  # type: ignore[attr-defined]
        return method

    return decorate


# ---------------------------------------------------------------------------------------------- the objects' names
def _pick(name: str, value: Any, other_name: str, other_value: Any) -> Any:
    """One of the two spellings of an argument; both given (different objects) is an error."""
    if value is not None and other_value is not None and value is not other_value:
        raise TypeError(f"{name} and {other_name} name the same argument; give one of them")
    return other_value if value is None else value


def model_and_loader(model: Any, module: Any, loader: Any, data_loader: Any) -> tuple[Any, Any]:
    """``(model, loader)`` from either spelling of each (``model`` or ``module``, ``loader`` or
    ``data_loader``); TypeError when both spellings of one are given (different objects)."""
    return _pick("model", model, "module", module), _pick("loader", loader, "data_loader", data_loader)


def resolve_accountant(accountant: str | Accountant) -> Accountant:
    """The engine's accountant: a name of ``ACCOUNTANT_ALIASES`` (``"pld"``, ``"rdp"``; ``"prv"`` is
    read as ``"pld"``), any case; or an empty ``Accountant`` instance, used as is. ValueError naming
    the problem otherwise."""
    if isinstance(accountant, Accountant):
        if accountant.history:
            raise ValueError("accountant already holds steps; pass an empty one (accountant.fresh())")
        return accountant
    if isinstance(accountant, str) and accountant.strip().lower() in ACCOUNTANT_ALIASES:
        return make_accountant(ACCOUNTANT_ALIASES[accountant.strip().lower()])
    raise ValueError(
        f"accountant must be one of {sorted(ACCOUNTANT_ALIASES)} ('prv' means 'pld') or an "
        f"accountants.Accountant; got {accountant!r}"
    )
