"""PrivacyEngine: make a model, its optimizer and its data loader private in one call.

    engine = PrivacyEngine(accountant="pld")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
    )
    ...  # the usual training loop
    engine.get_epsilon(delta=1e-5)

Opacus's keyword names are accepted (``module=``, ``data_loader=``, ``grad_sample_mode=``,
``noise_generator=``, ...), so an Opacus script switches by changing its import.

BandMF: ``noise_mechanism="bandmf"`` (with ``num_bands=b``, or none to let the engine choose;
``max_batch_size=`` for fixed-shape, truncated batches); ``engine.noise_plan`` says what was set up.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from accountants import (
    Accountant,
    CalibrationError,
    PLDAccountant,
    calibrate_noise_multiplier,
    make_accountant,
)
from accountants.calibration import DEFAULT_TOLERANCE
from privacy_engine import checkpoint, distributed
from privacy_engine.budget import PrivacyBudget, budget_from, step_kwargs_of
from privacy_engine.clip_factors import validate_max_grad_norm
from privacy_engine.clipper import (
    CLIPPING_MODES,
    PerSampleGradientClipper,
    parameter_groups,
)
from privacy_engine.grad_sample_module import LOSS_REDUCTIONS, GradSampleModule
from privacy_engine.noise import BandMFNoise, GaussianNoise, NoiseMechanism
from privacy_engine.optimizer import DPOptimizer, trainable_parameters
from privacy_engine.rewrap import plain_loader_for
from privacy_engine.secure_random import SecureGenerator
from privacy_engine.sampling import DPDataLoader, loader_index_set
from privacy_engine.strategy import (
    expected_error,
    optimize_banded_toeplitz,
    strategy_loss,
    validated_coefficients,
)
from privacy_engine.validation import UnsupportedModuleError, find_problems

__all__ = ["BandCandidate", "NoisePlan", "PrivacyEngine"]

logger = logging.getLogger(__name__)

# Opacus's default accountant is "prv" (a numerical privacy-loss accountant like PLD): it maps to
# dp-accounting's PLD accountant here.
ACCOUNTANT_ALIASES = {"pld": "pld", "prv": "pld", "rdp": "rdp"}
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ghost", "ew", "no_op")
# Opacus's "ew" (torch's expanded weights) computes the same exact per-sample gradients as the hooks here,
# so it is an alias of "hooks"; "no_op" leaves per-sample gradients to the training loop.
NOISE_MECHANISMS = ("gaussian", "bandmf")
#: Band counts tried when ``noise_mechanism="bandmf"`` is given without ``num_bands`` (those the
#: loader and the number of steps allow).
CANDIDATE_NUM_BANDS = (1, 2, 4, 8, 16, 32, 64)
# Comparing band counts needs each one's sigma only roughly (the criterion is compared, not
# promised): a coarser PLD grid and search tolerance make it ~3-5x cheaper. The chosen b is then
# calibrated again on the engine's own accountant, which is what the guarantee rests on.
_COMPARISON_PLD_INTERVAL = 1e-3
_COMPARISON_TOLERANCE = 1e-2


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {value!r}")
    return float(value)


def _pick(name: str, value: Any, opacus_name: str, opacus_value: Any) -> Any:
    """One of the two spellings of an argument (ours or Opacus's); both given is an error."""
    if value is not None and opacus_value is not None and value is not opacus_value:
        raise TypeError(f"{name} and {opacus_name} name the same argument; give one of them")
    return opacus_value if value is None else value


@dataclass(frozen=True, kw_only=True)
class BandCandidate:
    """One number of bands considered by the automatic choice, with its criterion.

    ``expected_error = strategy_loss * noise_multiplier**2``: the mean expected squared error per
    coordinate of the noisy prefix sums over ``total_steps`` steps, in units of ``max_grad_norm**2``
    (``privacy_engine.strategy.expected_error``). ``noise_multiplier`` is the given one
    (``make_private``) or the one calibrated for this b (``make_private_with_epsilon``, on a
    coarse grid; ``inf`` if the target is out of reach with this b).
    """

    num_bands: int
    noise_multiplier: float
    strategy_loss: float
    expected_error: float


@dataclass(frozen=True, kw_only=True)
class NoisePlan:
    """What ``make_private`` set up for the noise and the accounting (``engine.noise_plan``).

    ``mechanism``: ``"gaussian"``, ``"bandmf"`` or ``"custom"`` (a ``NoiseMechanism`` passed in).
    ``coefficients``: the BandMF strategy ``(c_0, ..., c_{b-1})``, None otherwise.
    ``total_steps``: the steps the strategy was optimised for / the noise calibrated over (None
    when neither applies). ``group_size`` and ``max_batch_size``: truncated sampling (largest group
    and the cap), both None otherwise. ``candidates``: the band counts compared when ``num_bands``
    was chosen automatically (empty otherwise), in increasing b.
    """

    mechanism: str
    num_bands: int
    noise_multiplier: float
    sample_rate: float
    expected_batch_size: float
    coefficients: tuple[float, ...] | None = None
    total_steps: int | None = None
    group_size: int | None = None
    max_batch_size: int | None = None
    candidates: tuple[BandCandidate, ...] = ()

    @property
    def num_bands_chosen_automatically(self) -> bool:
        return bool(self.candidates)


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """Everything make_private builds, validated before anything is wrapped."""

    model: nn.Module
    optimizer: Optimizer
    private_loader: DataLoader
    sample_rate: float
    expected_batch_size: float
    steps_per_epoch: int
    params: list
    groups: list | None
    clipping: str
    max_grad_norm: Any
    loss_reduction: str
    batch_first: bool
    make_noise: Callable[[], NoiseMechanism]
    num_bands: int
    grad_sample_mode: str
    criterion: Any
    nan_safe: bool
    rescale_to_unit_norm: bool
    noise_plan: NoisePlan
    #: This rank's part of a distributed (DDP) job; None for one process (privacy_engine.distributed).
    distributed: distributed.DistributedJob | None = None


@dataclass(frozen=True, kw_only=True)
class _NoiseChoice:
    """The noise mechanism decided before the loader is built (internal)."""

    mechanism: str
    num_bands: int
    coefficients: tuple[float, ...] | None
    make_noise: Callable[[], NoiseMechanism]
    total_steps: int | None
    noise_multiplier: float  # inf: to be calibrated
    candidates: tuple[BandCandidate, ...] = ()


class _TruncatedLedger:
    """The engine's accountant as ``DPOptimizer`` sees it under truncated sampling: every step is
    recorded with the group size and the cap, so that it is accounted as truncated Poisson
    sampling (the optimizer itself knows only noise multiplier, sample rate and bands)."""

    def __init__(self, accountant: Accountant, *, group_size: int, max_batch_size: int) -> None:
        self.accountant = accountant
        self.group_size = group_size
        self.max_batch_size = max_batch_size

    def step(self, **kwargs: Any) -> None:
        self.accountant.step(**kwargs, group_size=self.group_size, max_batch_size=self.max_batch_size)

    # The "what if" questions the privacy budget asks (privacy_engine.budget) take the same step.
    def _truncated(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**kwargs, "group_size": self.group_size, "max_batch_size": self.max_batch_size}

    def history_if(self, **kwargs: Any) -> tuple:
        return self.accountant.history_if(**self._truncated(kwargs))

    def epsilon_if(self, delta: float, **kwargs: Any) -> float:
        return self.accountant.epsilon_if(delta, **self._truncated(kwargs))

    def would_exceed(self, max_epsilon: float, delta: float, **kwargs: Any) -> bool:
        return self.accountant.would_exceed(max_epsilon, delta, **self._truncated(kwargs))

    def steps_left(self, max_epsilon: float, delta: float, **kwargs: Any) -> int:
        return self.accountant.steps_left(max_epsilon, delta, **self._truncated(kwargs))

    def __getattr__(self, name: str) -> Any:
        # Only ordinary attributes are forwarded: copy/pickle probe dunders before __init__ has run.
        if name.startswith("__") or name == "accountant":
            raise AttributeError(name)
        return getattr(self.accountant, name)


@functools.lru_cache(maxsize=256)
def _strategy_coefficients(total_steps: int, num_bands: int) -> tuple[float, ...]:
    # Deterministic and ~0.1 s for thousands of steps: cached because choosing b optimises one
    # strategy per candidate, and tutorials repeat the same runs over seeds and epsilons.
    return tuple(float(c) for c in optimize_banded_toeplitz(total_steps, num_bands))


def _frozen_settings(accountant: Accountant) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in accountant.settings().items()))


@functools.lru_cache(maxsize=1024)
def _cached_calibration(
    accountant_type: type, settings: tuple, target_epsilon: float, target_delta: float, sample_rate: float,
    steps: int, num_bands: int, group_size: int | None, max_batch_size: int | None, tolerance: float,
) -> float:  # fmt: skip
    # Calibration is a deterministic function of these arguments (the accountant is rebuilt from
    # its settings), so caching cannot change a result, only skip recomputing it.
    accountant = accountant_type(**{k: list(v) if isinstance(v, tuple) else v for k, v in settings})
    return calibrate_noise_multiplier(
        target_epsilon, target_delta, sample_rate, steps, accountant=accountant, num_bands=num_bands,
        group_size=group_size, max_batch_size=max_batch_size, tolerance=tolerance,
    )  # fmt: skip


def _calibrate(accountant: Accountant, target: tuple[float, float], sample_rate: float, steps: int, *,
               num_bands: int, group_size: int | None, max_batch_size: int | None,
               tolerance: float | None = None) -> float:  # fmt: skip
    """Smallest sigma meeting ``target`` for this mechanism on ``accountant``'s kind and settings
    (``accountants.calibrate_noise_multiplier``, whose guarantee it keeps), cached."""
    return _cached_calibration(
        type(accountant), _frozen_settings(accountant), target[0], target[1], float(sample_rate), int(steps),
        int(num_bands), group_size, max_batch_size, DEFAULT_TOLERANCE if tolerance is None else float(tolerance),
    )  # fmt: skip


def _comparison_accountant(accountant: Accountant) -> Accountant:
    if isinstance(accountant, PLDAccountant):
        return PLDAccountant(value_discretization_interval=max(accountant.value_discretization_interval,
                                                               _COMPARISON_PLD_INTERVAL))  # fmt: skip
    return accountant.fresh()


def _validated_coefficients(coefficients: Any) -> tuple[float, ...]:
    return tuple(float(c) for c in validated_coefficients(coefficients, name="bandmf_coefficients"))


class PrivacyEngine:
    """Builds private training from a model, an optimizer and a data loader, and keeps the
    privacy ledger (one accountant for everything this engine made private).

    Args:
        accountant: ``"pld"`` (dp-accounting's privacy-loss-distribution accountant, tight) or
            ``"rdp"`` (Renyi DP, an upper bound); Opacus's ``"prv"`` is read as ``"pld"``. Or an
            empty ``accountants.Accountant`` with your settings, e.g.
            ``make_accountant("pld", value_discretization_interval=1e-3)`` (10x faster epsilon,
            slightly more pessimistic).
        secure_mode: no seeds accepted; every sampling choice (Poisson inclusion, cyclic groups,
            truncation) drawn from the OS's cryptographic generator (``secure_random``); noise from
            generators whose whole state comes from the OS, each value the sum of four draws; no seed
            or generator state in checkpoints. What it does not cover (floating-point attacks on
            Gaussian sampling) and what to do about it: ``NoiseMechanism``'s docstring.
    """

    def __init__(self, accountant: str | Accountant = "pld", secure_mode: bool = False) -> None:
        if not isinstance(secure_mode, bool):
            raise TypeError(f"secure_mode must be a bool; got {secure_mode!r}")
        if isinstance(accountant, Accountant):
            if accountant.history:
                raise ValueError("accountant already holds steps; pass an empty one (accountant.fresh())")
            self.accountant = accountant
        elif isinstance(accountant, str) and accountant.strip().lower() in ACCOUNTANT_ALIASES:
            self.accountant = make_accountant(ACCOUNTANT_ALIASES[accountant.strip().lower()])
        else:
            raise ValueError(
                f"accountant must be one of {sorted(ACCOUNTANT_ALIASES)} ('prv' means 'pld') or an "
                f"accountants.Accountant; got {accountant!r}"
            )
        self.accountant_name = self.accountant.name
        self.secure_mode = secure_mode
        #: The noise set-up of the last ``make_private`` call (bands, coefficients, sigma, the band
        #: counts compared if ``num_bands`` was chosen automatically); None before any call.
        self.noise_plan: NoisePlan | None = None
        self._optimizers_made = 0
        #: The privacy budget of the last ``make_private`` call (``max_epsilon``, ``target_delta``),
        #: consulted by its optimizer before every release; None for none.
        self.budget: PrivacyBudget | None = None
        self._last_optimizer: DPOptimizer | None = None

    @property
    def num_bands(self) -> int | None:
        """Bands of the last ``make_private`` call's noise (1 for DP-SGD); None before any call."""
        return None if self.noise_plan is None else self.noise_plan.num_bands

    # ------------------------------------------------------------------ public API
    def make_private(
        self,
        model: nn.Module | None = None,
        optimizer: Optimizer | None = None,
        loader: DataLoader | None = None,
        *,
        module: nn.Module | None = None,
        data_loader: DataLoader | None = None,
        noise_multiplier: float,
        max_grad_norm: float | Sequence[float],
        poisson_sampling: bool = True,
        clipping: str = "flat",
        loss_reduction: str = "mean",
        batch_first: bool = True,
        noise_seed: int | None = None,
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        criterion: Any = None,
        noise_mechanism: str | NoiseMechanism = "gaussian",
        num_bands: int | None = None,
        bandmf_coefficients: Sequence[float] | None = None,
        total_steps: int | None = None,
        max_batch_size: int | None = None,
        nan_safe: bool = True,
        rescale_to_unit_norm: bool = False,
        target_delta: float | None = None,
        max_epsilon: float | None = None,
    ) -> tuple:
        """Wrap ``model`` (``GradSampleModule``), ``optimizer`` (``DPOptimizer``) and ``loader``
        (``DPDataLoader``: Poisson sampling, or cyclic Poisson sampling for BandMF) for private
        training, and record every step with this engine's accountant.

        Guarantee: every argument below is checked before anything is wrapped; on any error the
        model, optimizer and loader are left exactly as they were. After the call, each
        ``optimizer.step()`` releases the clipped sum plus this step's noise and is recorded with
        the mechanism actually run: DP-SGD with ``sample_rate = loader.batch_size / len(dataset)``,
        or, for BandMF with ``b`` bands, cyclic Poisson sampling from group ``t mod b`` with
        ``p = b * batch_size / len(dataset)``, which the accountant composes ``ceil(steps / b)``
        times (the amplified BandMF event); with ``max_batch_size``, as truncated Poisson sampling
        from the largest group (dp-accounting's ``TruncatedSubsampledGaussianDpEvent``).
        ``engine.noise_plan`` says what was set up (and ``engine.num_bands`` the bands).

        ==========================================  =============================================
        argument problem                            error (raised before wrapping)
        ==========================================  =============================================
        optimizer param not in the model            ValueError naming the parameter's position
        trainable model param not in optimizer      ValueError naming it (freeze it or add it)
        noise_multiplier < 0, NaN, inf              ValueError naming noise_multiplier
        max_grad_norm <= 0 or NaN                   ValueError naming max_grad_norm
        max_grad_norm inf with noise > 0            ValueError naming max_grad_norm
        per_layer list of the wrong length          ValueError: one per layer or per parameter
        dataset without __len__ / iterable          TypeError naming the data loader's dataset
        BatchNorm / unsupported layer               UnsupportedModuleError (the core's)
        noise_seed/noise_generator + secure         ValueError naming the argument
        unknown clipping / mode / reduction         ValueError naming the argument
        bandmf with poisson_sampling=False          ValueError naming poisson_sampling
        num_bands > steps per epoch                 ValueError naming num_bands
        num_bands * batch_size > len(dataset)       ValueError naming num_bands
        bandmf_coefficients c_0 <= 0 / not finite   ValueError naming bandmf_coefficients
        bandmf without total_steps / coefficients   ValueError naming total_steps
        max_batch_size < 1 / without Poisson        ValueError naming max_batch_size
        max_batch_size with the RDP accountant      NotImplementedError naming PLDAccountant
        max_epsilon without target_delta            ValueError naming target_delta
        target_delta without max_epsilon            ValueError naming max_epsilon
        max_epsilon < 0 / NaN; target_delta not in  ValueError naming it
        (0, 1)
        ==========================================  =============================================

        Args (ours, then Opacus's name where it differs):
            model (``module``), optimizer, loader (``data_loader``).
            noise_multiplier: sigma >= 0 (noise std / sensitivity).
            max_grad_norm: ``clipping="flat"``: one bound > 0. ``"per_layer"``: a list with one
                bound per *layer* (each submodule directly owning trainable parameters, in
                ``model.named_modules()`` order) or one per trainable *parameter* (in optimizer
                order); the length decides which. A single number is split evenly over the layers
                (``C / sqrt(layers)`` each, total bound ``C``).
            poisson_sampling: Poisson-sample batches (True, what the accounting assumes) or keep
                the loader (False: its shuffled batches are accounted as if Poisson, an
                approximation; a warning says so). BandMF needs True.
            clipping: ``"flat"`` or ``"per_layer"``.
            loss_reduction: ``"mean"`` or ``"sum"``: how the loss reduces over the batch.
            batch_first: the batch is dim 0 (True) or dim 1 of the model's inputs.
            noise_seed: seed for reproducible noise (``None``: one draw from torch's global generator,
                so ``torch.manual_seed`` makes a run reproducible, as with Opacus; never in secure mode).
            noise_generator: Opacus's seeding: a ``torch.Generator`` that seeds the noise (one draw)
                and drives Poisson sampling.
            grad_sample_mode: ``"hooks"`` or ``"functorch"`` (both: exact per-sample gradients, with
                ``torch.func`` for layers without a registered sampler), or ``"ghost"``: fast
                clipping inside the backward pass (``GhostClippingModule``), which then returns
                ``(module, optimizer, criterion, data_loader)`` as Opacus does. Opacus's ``"ew"``
                (expanded weights) is an alias of ``"hooks"`` (the same exact gradients). ``"no_op"``:
                the loop computes the per-sample gradients itself and sets ``p.grad_sample``
                (``ManualGradSampleModule``: no hooks; see its guarantee).
            data_loader: a ``DataLoader`` with ``batch_size`` set, or a ``DPDataLoader`` an earlier call
                returned (re-planned from the plain loader it stands for, ``rewrap.plain_loader_for``).
            criterion: returned (unchanged) in ghost mode; default ``nn.CrossEntropyLoss``.
            noise_mechanism: ``"gaussian"`` (DP-SGD), ``"bandmf"`` (banded matrix factorisation,
                Choquette-Choo et al. 2023, with cyclic Poisson sampling over ``num_bands``
                groups), or a ready ``NoiseMechanism``.
            num_bands: BandMF bands b (1 is DP-SGD), at most the steps per epoch
                (``round(len(dataset) / batch_size)``, what the private loader yields, as for
                DP-SGD) and at most ``len(dataset) // batch_size``: each of the b groups needs a
                step every epoch and enough examples for its sample rate
                ``b * batch_size / len(dataset)``. ``None``: chosen among
                ``CANDIDATE_NUM_BANDS`` that the loader allows, by the expected squared error of
                the noisy prefix sums, ``strategy_loss(c_b, total_steps) * sigma_b^2``.
                Here sigma is the given one for every b, so the largest strategy gain wins; note
                that at a fixed sigma more bands mean less amplification and a larger epsilon
                (``make_private_with_epsilon`` compares b at a fixed budget). The choice is logged
                (``logging``, INFO) and kept in ``engine.noise_plan``.
            bandmf_coefficients: the strategy ``(c_0, ..., c_{b-1})``, ``c_0 > 0``; default: the
                optimal b-banded Toeplitz strategy for ``total_steps`` steps.
            total_steps: the number of steps the run will take (the strategy is optimised for it;
                more steps stay private, the strategy is just less tuned).
            max_batch_size: truncated sampling: each batch holds at most this many real examples
                (a random subset if more are drawn) and is padded to exactly this size; the padding
                entries (``loader.padding_mask``) contribute zero after clipping, and the steps are
                accounted as truncated Poisson sampling (PLD accountant only). DP-SGD or BandMF.
            nan_safe, rescale_to_unit_norm: see ``PerSampleGradientClipper``.
            target_delta, max_epsilon: a privacy budget (``privacy_engine.budget``): the optimizer
                raises ``PrivacyBudgetExceeded`` before any release that would take
                ``get_epsilon(target_delta)`` past ``max_epsilon``, releasing and recording
                nothing; ``engine.steps_left()`` says how many steps remain. Both or neither
                (``max_epsilon=math.inf``: no budget).
        """
        if target_delta is not None and max_epsilon is None:
            raise ValueError("target_delta is the delta of a privacy budget: give max_epsilon too, or leave both out")
        budget = budget_from(max_epsilon, target_delta)
        plan = self._plan(
            model=_pick("model", model, "module", module),
            optimizer=optimizer,
            data_loader=_pick("loader", loader, "data_loader", data_loader),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            poisson_sampling=poisson_sampling,
            clipping=clipping,
            loss_reduction=loss_reduction,
            batch_first=batch_first,
            noise_seed=noise_seed,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            criterion=criterion,
            noise_mechanism=noise_mechanism,
            num_bands=num_bands,
            bandmf_coefficients=bandmf_coefficients,
            total_steps=total_steps,
            max_batch_size=max_batch_size,
            nan_safe=nan_safe,
            rescale_to_unit_norm=rescale_to_unit_norm,
        )
        return self._build(plan, budget=budget)

    def make_private_with_epsilon(
        self,
        model: nn.Module | None = None,
        optimizer: Optimizer | None = None,
        loader: DataLoader | None = None,
        *,
        module: nn.Module | None = None,
        data_loader: DataLoader | None = None,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float | Sequence[float],
        max_epsilon: float | None = None,
        **kwargs: Any,
    ) -> tuple:
        """``make_private`` with the smallest noise multiplier that keeps the whole run within
        ``(target_epsilon, target_delta)``: calibrated with ``accountants.calibrate_noise_multiplier``
        (this engine's accountant kind and settings) over ``steps = epochs * len(private_loader)`` steps of
        the mechanism run (DP-SGD; BandMF's amplified event with its bands and cyclic sample rate;
        truncated sampling with ``max_batch_size``). ``optimizer.noise_multiplier`` holds the result.

        BandMF without ``num_bands``: every candidate b (``CANDIDATE_NUM_BANDS`` the loader allows)
        is calibrated to the target (on a coarser PLD grid, cached), the one with the smallest
        ``strategy_loss(c_b, steps) * sigma_b^2`` is chosen, logged and kept in
        ``engine.noise_plan``, and its sigma calibrated again on this engine's accountant.
        ``total_steps`` (the steps the strategy is optimised for) defaults to the steps the private
        loader yields in ``epochs`` epochs.

        Guarantee: running at most ``epochs * len(private_loader)`` steps (the private loader returned,
        which yields ``round(examples / batch_size)`` batches an epoch, possibly more than the loader passed in;
        the private loader yields at most that many per epoch) keeps this engine's
        ``get_epsilon(target_delta) <= target_epsilon``, if nothing else was recorded before.

        ==================================  ======================================
        case                                result
        ==================================  ======================================
        target_epsilon <= 0 / NaN / inf     ValueError naming target_epsilon
        target_delta not in (0, 1)          ValueError naming target_delta
        epochs < 1 / not an int             ValueError naming epochs
        target unreachable                  accountants.CalibrationError
        (every candidate b, when choosing)
        noise_multiplier also given         TypeError
        a run longer than ``epochs``        the step that would pass max_epsilon
                                            (default target_epsilon) raises
                                            PrivacyBudgetExceeded, releasing nothing
        max_epsilon=math.inf                no budget
        other arguments                     as ``make_private``
        ==================================  ======================================
        """
        if "noise_multiplier" in kwargs:
            raise TypeError("make_private_with_epsilon calibrates noise_multiplier itself; do not pass it")
        target_epsilon = _real("target_epsilon", target_epsilon)
        if not (math.isfinite(target_epsilon) and target_epsilon > 0):
            raise ValueError(f"target_epsilon must be finite and > 0; got {target_epsilon!r}")
        target_delta = _real("target_delta", target_delta)
        if not 0 < target_delta < 1:
            raise ValueError(f"target_delta must be in (0, 1), e.g. 1e-5 (below 1/dataset size); got {target_delta!r}")
        if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < 1:
            raise ValueError(f"epochs must be an int >= 1; got {epochs!r}")
        budget = budget_from(target_epsilon if max_epsilon is None else max_epsilon, target_delta)
        plan = self._plan(
            model=_pick("model", model, "module", module),
            optimizer=optimizer,
            data_loader=_pick("loader", loader, "data_loader", data_loader),
            noise_multiplier=None,
            max_grad_norm=max_grad_norm,
            **self._plan_kwargs(kwargs),
            epochs=int(epochs),
            target=(target_epsilon, target_delta),
        )
        return self._build(plan, budget=budget)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon of everything recorded so far at ``delta`` (the accountant's; ValueError naming
        delta unless 0 < delta < 1)."""
        return self.accountant.get_epsilon(delta)

    def steps_left(
        self, max_epsilon: float | None = None, delta: float | None = None, *, optimizer: DPOptimizer | None = None
    ) -> int:
        """How many more ordinary steps of ``optimizer`` (default: the last one made) keep
        ``get_epsilon(delta) <= max_epsilon`` (defaults: this engine's budget).

        Guarantee: as ``Accountant.steps_left``: that many steps fit and one more would not, as
        the budget guard decides (truncated sampling included). Ordinary: one batch and one noise
        row a step (``VirtualSteps`` accumulating several Poisson batches per release spends more).

        ====================================  ==========================================
        case                                  result
        ====================================  ==========================================
        no budget and max_epsilon/delta None  ValueError naming the missing one
        nothing made private yet              ValueError: call make_private first
        already over max_epsilon              0
        ====================================  ==========================================
        """
        if optimizer is None:
            optimizer = self._last_optimizer
        if optimizer is None:
            raise ValueError("steps_left needs a private optimizer: call make_private first (or pass optimizer=)")
        if max_epsilon is None or delta is None:
            if self.budget is None:
                missing = "max_epsilon" if max_epsilon is None else "delta"
                raise ValueError(f"steps_left needs {missing}: this engine has no budget (make_private(max_epsilon=...))")
            max_epsilon = self.budget.max_epsilon if max_epsilon is None else max_epsilon
            delta = self.budget.delta if delta is None else delta
        return optimizer.accountant.steps_left(max_epsilon, delta, **step_kwargs_of(optimizer))

    def state_dict(self) -> dict[str, Any]:
        """The engine's part of a checkpoint, as plain data: the privacy ledger (accountant kind,
        settings and history), ``secure_mode`` and ``noise_plan`` (a dict). Save it with the
        optimizer's state dict, or use ``save_checkpoint``."""
        return {
            "accountant": self.accountant.state_dict(),
            "secure_mode": self.secure_mode,
            "noise_plan": checkpoint.plan_to_dict(self.noise_plan),
        }

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the first mismatch (secure_mode, accountant kind, a damaged
        history, a noise plan other than this engine's) unless ``load_state_dict(state)`` would
        restore it; changes nothing. See ``checkpoint.check_engine_state``."""
        checkpoint.check_engine_state(self, state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``: the accountant's history and the noise plan. Everything is
        checked first (``check_state_dict``); on an error nothing changes."""
        plan = checkpoint.check_engine_state(self, state)
        self.accountant.load_state_dict(state["accountant"])
        if plan is not None:
            self.noise_plan = plan

    def save_checkpoint(
        self,
        *,
        path: Any,
        module: nn.Module,
        optimizer: Optimizer | None = None,
        data_loader: DataLoader | None = None,
        noise_scheduler: Any = None,
        grad_clip_scheduler: Any = None,
        checkpoint_dict: dict | None = None,
        module_state_dict_kwargs: dict[str, Any] | None = None,
        torch_save_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Save everything a run needs to resume exactly to ``path`` (Opacus's name and keywords,
        plus ``data_loader``): the model, the optimizer with its DP state (noise mechanism:
        generators, BandMF history and ring position; clipper; counters), the engine's ledger,
        ``secure_mode`` and ``noise_plan``, the private loader's sampling state (generator,
        position, cyclic groups), scheduler states, and ``checkpoint_dict``'s entries.

        Guarantee: the file is written atomically (temporary file in the same folder, fsync,
        ``os.replace``): an exception or a kill while saving leaves the previous file at ``path``
        intact and loadable. It holds only plain data (loads with ``torch.load(weights_only=True)``,
        cannot run code) and a SHA-256 of its contents. In secure mode it holds no seed or
        generator state (see ``privacy_engine.checkpoint`` for what it holds and how secret it is).

        =========================================  =========================================
        case                                       result (nothing written)
        =========================================  =========================================
        BandMF / cyclic sampling, no data_loader   ValueError: the loader state is needed
        optimizer / data_loader not from           TypeError
        make_private
        checkpoint_dict holds a non-plain value    TypeError naming it
        checkpoint_dict uses a reserved key        ValueError naming it
        =========================================  =========================================
        """
        payload = checkpoint.build_checkpoint(
            self, module=module, optimizer=optimizer, data_loader=data_loader, noise_scheduler=noise_scheduler,
            grad_clip_scheduler=grad_clip_scheduler, checkpoint_dict=checkpoint_dict,
            module_state_dict_kwargs=module_state_dict_kwargs,
        )  # fmt: skip
        checkpoint.write_checkpoint(path, payload, **dict(torch_save_kwargs or {}))

    def load_checkpoint(
        self,
        *,
        path: Any,
        module: nn.Module,
        optimizer: Optimizer | None = None,
        data_loader: DataLoader | None = None,
        noise_scheduler: Any = None,
        grad_clip_scheduler: Any = None,
        module_load_dict_kwargs: dict[str, Any] | None = None,
        torch_load_kwargs: dict[str, Any] | None = None,
    ) -> dict:
        """Restore what ``save_checkpoint`` wrote into the objects given (Opacus's name and
        keywords, plus ``data_loader``); returns the checkpoint dict (``checkpoint_dict``'s entries
        included).

        Guarantee: the file is verified (header, SHA-256) before anything is unpickled, and
        unpickled with ``weights_only=True``: a crafted file runs nothing. Then every part is
        checked against the objects it goes into, and only then restored: on any mismatch a
        ``checkpoint.CheckpointError`` (a ``ValueError``) names the file and the first mismatch
        and says what to do, and model, optimizer, accountant, noise and loader are exactly as
        they were (full table: ``checkpoint.restore_checkpoint``). ``optimizer=`` or
        ``data_loader=`` given but absent from the file raises; a BandMF checkpoint needs
        ``data_loader=`` and a file saved with it. After a restore the run continues after the
        last released step: same noise, same batches, same epsilon as without the interruption
        (secure mode: fresh OS randomness instead of the saved generators, which were never saved).

        ``torch_load_kwargs`` may set ``map_location`` only (default CPU; the restore puts every
        tensor on its parameter's device); ``weights_only`` is always True.
        """
        load_kwargs = dict(torch_load_kwargs or {})
        if load_kwargs.pop("weights_only", True) is not True:
            raise ValueError("load_checkpoint always unpickles with weights_only=True; a checkpoint never needs more")
        map_location = load_kwargs.pop("map_location", "cpu")
        if load_kwargs:
            raise TypeError(f"torch_load_kwargs may set map_location only; got {sorted(load_kwargs)}")
        payload = checkpoint.read_checkpoint(path, map_location=map_location)
        checkpoint.restore_checkpoint(
            self, payload, name=checkpoint._name(path), module=module, optimizer=optimizer, data_loader=data_loader,
            noise_scheduler=noise_scheduler, grad_clip_scheduler=grad_clip_scheduler,
            module_load_dict_kwargs=module_load_dict_kwargs,
        )  # fmt: skip
        return payload

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _plan_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
        allowed = {
            "poisson_sampling", "clipping", "loss_reduction", "batch_first", "noise_seed", "noise_generator",
            "grad_sample_mode", "criterion", "noise_mechanism", "num_bands", "bandmf_coefficients",
            "total_steps", "max_batch_size", "nan_safe", "rescale_to_unit_norm",
        }  # fmt: skip
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; accepted: {sorted(allowed)}")
        return dict(kwargs)

    def _plan(
        self,
        *,
        model: Any,
        optimizer: Any,
        data_loader: Any,
        noise_multiplier: Any,
        max_grad_norm: Any,
        poisson_sampling: bool = True,
        clipping: str = "flat",
        loss_reduction: str = "mean",
        batch_first: bool = True,
        noise_seed: int | None = None,
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        criterion: Any = None,
        noise_mechanism: str | NoiseMechanism = "gaussian",
        num_bands: int | None = None,
        bandmf_coefficients: Sequence[float] | None = None,
        total_steps: int | None = None,
        max_batch_size: int | None = None,
        nan_safe: bool = True,
        rescale_to_unit_norm: bool = False,
        epochs: int | None = None,
        target: tuple[float, float] | None = None,
    ) -> _Plan:
        # --- the three objects
        if model is None or optimizer is None or data_loader is None:
            missing = [n for n, v in (("module", model), ("optimizer", optimizer), ("data_loader", data_loader)) if v is None]
            raise TypeError(f"make_private needs {', '.join(missing)}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"module must be an nn.Module; got {type(model).__name__}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        if isinstance(optimizer, DPOptimizer):
            raise TypeError("optimizer is already a DPOptimizer: pass the original optimizer")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("optimizer: LBFGS re-evaluates the loss within a step and cannot be made private; use SGD/Adam")
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader must be a torch.utils.data.DataLoader; got {type(data_loader).__name__}")
        if isinstance(data_loader, DPDataLoader):
            # A loader an earlier make_private returned (Opacus scripts pass it again on a second run):
            # planned from the plain loader it stands for (same examples, expected batch size).
            data_loader = plain_loader_for(data_loader)

        # --- scalar options
        if noise_multiplier is not None:
            sigma = _real("noise_multiplier", noise_multiplier)
            if not (math.isfinite(sigma) and sigma >= 0):
                raise ValueError(f"noise_multiplier must be finite and >= 0; got {noise_multiplier!r}")
        else:
            sigma = math.inf  # calibrated later, always > 0
        if clipping not in CLIPPING_MODES:
            hint = " (adaptive clipping is not supported)" if clipping == "adaptive" else ""
            raise ValueError(f"clipping must be one of {CLIPPING_MODES}; got {clipping!r}{hint}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}; got {loss_reduction!r}")
        for name, flag in (("batch_first", batch_first), ("poisson_sampling", poisson_sampling),
                           ("nan_safe", nan_safe), ("rescale_to_unit_norm", rescale_to_unit_norm)):  # fmt: skip
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool; got {flag!r}")
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}; got {grad_sample_mode!r}")
        if noise_seed is not None and (isinstance(noise_seed, bool) or not isinstance(noise_seed, numbers.Integral) or noise_seed < 0):
            raise ValueError(f"noise_seed must be an int >= 0 or None; got {noise_seed!r}")
        if noise_generator is not None and not isinstance(noise_generator, torch.Generator):
            raise TypeError(f"noise_generator must be a torch.Generator; got {type(noise_generator).__name__}")
        if self.secure_mode and noise_seed is not None:
            raise ValueError("noise_seed must be None with secure_mode=True (secure noise is seeded from the OS only)")
        if self.secure_mode and noise_generator is not None:
            raise ValueError("noise_generator must be None with secure_mode=True (secure noise is seeded from the OS only)")
        if noise_seed is not None and noise_generator is not None:
            raise ValueError("give noise_seed or noise_generator, not both")

        # --- distributed training: a DDP-wrapped model is unwrapped (its inner module is hooked)
        model, distributed_job = distributed.unwrap(model, noise_seed=noise_seed, noise_generator=noise_generator,
                                                    secure_mode=self.secure_mode)  # fmt: skip

        # --- parameters: the optimizer's must be the model's trainable ones
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

        # --- layers the core cannot handle (checked again by GradSampleModule, before it hooks anything)
        if isinstance(model, GradSampleModule):
            raise TypeError("module is already a GradSampleModule: pass the original module")
        problems = find_problems(model)
        if problems:
            raise UnsupportedModuleError("cannot compute per-sample gradients:\n- " + "\n- ".join(problems))

        # --- clipping bounds
        groups = None
        if clipping == "flat":
            if isinstance(max_grad_norm, (list, tuple)):
                raise TypeError("max_grad_norm must be one number for clipping='flat' (a list needs clipping='per_layer')")
            bound = validate_max_grad_norm(_real("max_grad_norm", max_grad_norm))
            if bound == 0:
                raise ValueError("max_grad_norm must be > 0 (0 would clip every gradient to zero)")
            if math.isinf(bound) and sigma > 0:
                raise ValueError("max_grad_norm is inf with noise_multiplier > 0: no finite noise hides unclipped gradients")
        else:
            layers = parameter_groups(model, params, per="layer")
            if isinstance(max_grad_norm, numbers.Real) and not isinstance(max_grad_norm, bool):
                bounds = [max_grad_norm]
                groups = layers
            else:
                if isinstance(max_grad_norm, (str, bytes)) or not isinstance(max_grad_norm, Sequence):
                    raise TypeError(f"max_grad_norm must be a number or a list of numbers; got {max_grad_norm!r}")
                bounds = list(max_grad_norm)
                if len(bounds) == len(layers):
                    groups = layers
                elif len(bounds) == len(params):
                    groups = [[p] for p in params]
                else:
                    raise ValueError(
                        f"max_grad_norm has {len(bounds)} bounds; clipping='per_layer' needs one per layer "
                        f"({len(layers)} layers own trainable parameters) or one per trainable parameter ({len(params)})"
                    )
            for index, bound in enumerate(bounds):
                value = validate_max_grad_norm(_real(f"max_grad_norm[{index}]", bound), name=f"max_grad_norm[{index}]")
                if value == 0 or (math.isinf(value) and sigma > 0):
                    raise ValueError(f"max_grad_norm[{index}] must be finite and > 0; got {bound!r}")

        # --- the data: a sized, map-style dataset (Poisson and cyclic sampling index into it)
        wants_bandmf = (isinstance(noise_mechanism, str) and noise_mechanism == "bandmf") or (
            isinstance(noise_mechanism, NoiseMechanism) and int(getattr(noise_mechanism, "num_bands", 1)) > 1
        )
        dataset = data_loader.dataset
        if isinstance(dataset, IterableDataset) or not hasattr(type(dataset), "__len__"):
            why = (
                "cyclic Poisson sampling (noise_mechanism='bandmf') splits the examples into fixed groups and "
                "samples each one independently"
                if wants_bandmf
                else "the sample rate and Poisson sampling need the number of examples"
            )
            raise TypeError(
                f"data_loader.dataset ({type(dataset).__name__}) must be a sized, map-style dataset (len(dataset) and "
                f"dataset[i]): {why}"
            )
        if len(data_loader) < 1:
            raise ValueError("data_loader is empty")
        if data_loader.batch_size is None:
            raise ValueError("data_loader.batch_size is None: build the loader with batch_size set (the expected batch size)")
        num_examples, batch_size, steps_per_epoch = len(dataset), int(data_loader.batch_size), len(data_loader)
        if poisson_sampling:
            # Poisson sampling stays within the loader's own examples (a SubsetRandomSampler's split);
            # samplers without a Poisson equivalent (weighted sampling) raise here, before any wrapping.
            index_set = loader_index_set(data_loader)
            num_examples = num_examples if index_set is None else int(index_set.numel())
        # What the private loaders yield per epoch (the Poisson loader's round(1 / q), and the cyclic
        # one the same, so both mechanisms run equally many steps). It can exceed len(data_loader)
        # (drop_last with a fractional N / B, a subset sampler): calibration and the steps of a BandMF
        # strategy count the steps that will actually run.
        private_steps_per_epoch = max(1, round(num_examples / batch_size))
        accounted_steps_per_epoch = private_steps_per_epoch if poisson_sampling else steps_per_epoch
        if max_batch_size is not None:
            if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, numbers.Integral) or max_batch_size < 1:
                raise ValueError(f"max_batch_size must be an int >= 1 (the cap on real examples per batch) or None; got {max_batch_size!r}")
            if not poisson_sampling:
                raise ValueError("max_batch_size (truncated Poisson sampling) needs poisson_sampling=True")
            max_batch_size = int(max_batch_size)
            # Raises NotImplementedError naming PLDAccountant if this accountant cannot account for it.
            self.accountant.fresh().step(noise_multiplier=1.0, sample_rate=0.5, num_steps=0, group_size=1,
                                         max_batch_size=max_batch_size)  # fmt: skip

        # --- noise mechanism (and, when asked to choose, the number of bands)
        choice = self._plan_noise(
            noise_mechanism=noise_mechanism, num_bands=num_bands, bandmf_coefficients=bandmf_coefficients,
            total_steps=total_steps, epochs=epochs, noise_seed=noise_seed, noise_generator=noise_generator,
            noise_multiplier=sigma, target=target, poisson_sampling=poisson_sampling, num_examples=num_examples,
            batch_size=batch_size, steps_per_epoch=accounted_steps_per_epoch,
            private_steps_per_epoch=private_steps_per_epoch, max_batch_size=max_batch_size,
        )  # fmt: skip
        bands = choice.num_bands

        # --- sampling
        sampling_generator = noise_generator
        if self.secure_mode:
            # Every sampling choice straight from the OS (manual_seed would keep 32 bits of a seed).
            sampling_generator = SecureGenerator()
        elif sampling_generator is None:
            # The loader's own generator, seeded by one draw from torch's global one (torch.manual_seed still
            # makes the run reproducible): its state can be checkpointed, and other draws from the global
            # generator (every DataLoader iterator takes one) do not shift the batches, so a resume is exact.
            sampling_generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        if distributed_job is not None:
            # Each rank samples its part of one global (cyclic) Poisson sample; collective (agrees on a seed).
            private_loader = distributed_job.private_loader(data_loader, num_groups=bands, max_batch_size=max_batch_size,
                                                            poisson_sampling=poisson_sampling,
                                                            steps=private_steps_per_epoch)  # fmt: skip
        elif bands > 1 or max_batch_size is not None:
            # The group counter runs on across epochs, so an epoch need not be a multiple of b.
            private_loader = DPDataLoader.cyclic(data_loader, bands, max_batch_size=max_batch_size,
                                                 generator=sampling_generator, steps=private_steps_per_epoch)  # fmt: skip
        elif poisson_sampling:
            private_loader = DPDataLoader.from_data_loader(data_loader, generator=sampling_generator)
        else:
            private_loader = data_loader
        if isinstance(private_loader, DPDataLoader):
            sample_rate, expected_batch_size = private_loader.sample_rate, private_loader.expected_batch_size
        else:
            sample_rate, expected_batch_size = 1.0 / steps_per_epoch, float(batch_size)
        group_size = None
        if max_batch_size is not None:
            # Accounted over the largest group: truncation's privacy analysis depends on the number
            # of examples sampled from, and every group must be covered.
            group_size = max(int(group.numel()) for group in private_loader.batch_sampler.groups)

        # --- the noise multiplier: given, or calibrated for the mechanism now fixed
        noise_multiplier = choice.noise_multiplier
        if target is not None:
            noise_multiplier = _calibrate(self.accountant, target, sample_rate, epochs * accounted_steps_per_epoch, num_bands=bands,
                                          group_size=group_size, max_batch_size=max_batch_size)  # fmt: skip
        # Validates what the accountant will be given, recording nothing.
        self.accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=0, num_bands=bands,
                             group_size=group_size, max_batch_size=max_batch_size)  # fmt: skip
        noise_plan = NoisePlan(
            mechanism=choice.mechanism,
            num_bands=bands,
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            expected_batch_size=expected_batch_size,
            coefficients=choice.coefficients,
            total_steps=choice.total_steps if target is None else (choice.total_steps or epochs * accounted_steps_per_epoch),
            group_size=group_size,
            max_batch_size=max_batch_size,
            candidates=choice.candidates,
        )

        return _Plan(
            model=model,
            optimizer=optimizer,
            private_loader=private_loader,
            sample_rate=sample_rate,
            expected_batch_size=expected_batch_size,
            steps_per_epoch=steps_per_epoch,
            params=params,
            groups=groups,
            clipping=clipping,
            max_grad_norm=max_grad_norm,
            loss_reduction=loss_reduction,
            batch_first=batch_first,
            make_noise=choice.make_noise,
            num_bands=bands,
            grad_sample_mode=grad_sample_mode,
            criterion=criterion,
            nan_safe=nan_safe,
            rescale_to_unit_norm=rescale_to_unit_norm,
            noise_plan=noise_plan,
            distributed=distributed_job,
        )

    @staticmethod
    def _check_num_bands(num_bands: int, *, num_examples: int, batch_size: int, steps_per_epoch: int) -> None:
        if num_bands > steps_per_epoch:
            raise ValueError(
                f"num_bands={num_bands} exceeds the {steps_per_epoch} steps per epoch (round(len(dataset) / batch_size)): "
                f"cyclic sampling gives each of the b groups its own steps, and every group needs at least one step "
                f"per epoch. Use num_bands <= {steps_per_epoch}, or a smaller batch_size (more steps per epoch)."
            )
        if num_bands * batch_size > num_examples:
            raise ValueError(
                f"num_bands={num_bands} with batch_size={batch_size} needs {num_bands * batch_size} examples per cycle "
                f"but the dataset has {num_examples}: each group of ~{num_examples // num_bands} examples would be "
                f"sampled with probability > 1. Use num_bands <= {num_examples // batch_size} or a smaller batch_size."
            )

    def _plan_noise(
        self,
        *,
        noise_mechanism: Any,
        num_bands: Any,
        bandmf_coefficients: Any,
        total_steps: Any,
        epochs: int | None,
        noise_seed: int | None,
        noise_generator: torch.Generator | None,
        noise_multiplier: float,
        target: tuple[float, float] | None,
        poisson_sampling: bool,
        num_examples: int,
        batch_size: int,
        steps_per_epoch: int,
        private_steps_per_epoch: int,
        max_batch_size: int | None,
    ) -> _NoiseChoice:
        """The noise mechanism: a builder (called only once nothing can fail), its bands and, for
        BandMF without ``num_bands``, the band counts compared and the one chosen."""
        secure_mode = self.secure_mode

        def seed() -> int | None:
            if noise_generator is not None:
                # Opacus seeds its noise from this generator; one draw from it seeds ours.
                return int(torch.randint(0, 2**62, (1,), generator=noise_generator).item())
            return noise_seed

        if isinstance(noise_mechanism, NoiseMechanism):
            if noise_seed is not None or noise_generator is not None:
                raise ValueError("noise_seed/noise_generator cannot seed a noise mechanism you built; seed it yourself")
            if noise_mechanism.secure_mode != self.secure_mode:
                raise ValueError(f"noise_mechanism.secure_mode must match the engine's secure_mode={self.secure_mode}")
            if noise_mechanism.step != 0:
                raise ValueError("noise_mechanism has already been used; pass a fresh one")
            bands = int(getattr(noise_mechanism, "num_bands", 1))
            if bands > 1:
                if not poisson_sampling:
                    raise ValueError("poisson_sampling must be True for a BandMF noise mechanism (cyclic Poisson sampling)")
                self._check_num_bands(bands, num_examples=num_examples, batch_size=batch_size,
                                      steps_per_epoch=private_steps_per_epoch)
            coefficients = getattr(noise_mechanism, "coefficients", None)
            return _NoiseChoice(
                mechanism="custom", num_bands=bands, make_noise=lambda: noise_mechanism, total_steps=None,
                coefficients=None if coefficients is None else tuple(float(c) for c in coefficients),
                noise_multiplier=noise_multiplier,
            )  # fmt: skip
        if not isinstance(noise_mechanism, str) or noise_mechanism not in NOISE_MECHANISMS:
            raise ValueError(f"noise_mechanism must be one of {NOISE_MECHANISMS} or a NoiseMechanism; got {noise_mechanism!r}")
        if noise_mechanism == "gaussian":
            if num_bands not in (None, 1) or bandmf_coefficients is not None:
                raise ValueError("num_bands / bandmf_coefficients need noise_mechanism='bandmf'")
            return _NoiseChoice(
                mechanism="gaussian", num_bands=1, coefficients=None, total_steps=None, noise_multiplier=noise_multiplier,
                make_noise=lambda: GaussianNoise(seed=seed(), secure_mode=secure_mode),
            )  # fmt: skip

        # --- BandMF
        if not poisson_sampling:
            raise ValueError(
                "noise_mechanism='bandmf' needs poisson_sampling=True: its privacy rests on cyclic Poisson sampling "
                "(every example in one of b groups, each sampled only every b steps)"
            )
        if num_bands is not None and (isinstance(num_bands, bool) or not isinstance(num_bands, numbers.Integral) or num_bands < 1):
            raise ValueError(f"num_bands must be an int >= 1 (or None to choose it) with noise_mechanism='bandmf'; got {num_bands!r}")
        coefficients = None
        if bandmf_coefficients is not None:
            coefficients = _validated_coefficients(bandmf_coefficients)
            if num_bands is not None and len(coefficients) != num_bands:
                raise ValueError(f"bandmf_coefficients has {len(coefficients)} entries but num_bands={num_bands}")
            num_bands = len(coefficients)
        if num_bands is not None:
            num_bands = int(num_bands)
            self._check_num_bands(num_bands, num_examples=num_examples, batch_size=batch_size,
                                      steps_per_epoch=private_steps_per_epoch)
        steps = total_steps
        if steps is None and epochs is not None:
            steps = epochs * private_steps_per_epoch
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1):
            raise ValueError(f"total_steps must be an int >= 1 (the number of steps of the run); got {total_steps!r}")
        if coefficients is None:
            if steps is None:
                raise ValueError(
                    "total_steps is needed with noise_mechanism='bandmf' (the strategy is optimised for the number of "
                    "steps of the run), unless you give bandmf_coefficients"
                )
            if num_bands is not None and steps < num_bands:
                raise ValueError(f"total_steps={steps} is smaller than num_bands={num_bands}: use num_bands <= total_steps")
        steps = None if steps is None else int(steps)

        candidates: tuple[BandCandidate, ...] = ()
        if num_bands is None:
            allowed = [b for b in CANDIDATE_NUM_BANDS
                       if b <= private_steps_per_epoch and b * batch_size <= num_examples and b <= steps]  # fmt: skip
            candidates = self._compare_num_bands(
                allowed, total_steps=steps, noise_multiplier=noise_multiplier, target=target,
                accounted_steps=None if epochs is None else epochs * steps_per_epoch, num_examples=num_examples,
                batch_size=batch_size, max_batch_size=max_batch_size,
            )  # fmt: skip
            best = min(candidates, key=lambda c: (c.expected_error, c.strategy_loss, c.num_bands))
            num_bands = best.num_bands
            how = ("at the given noise_multiplier" if target is None
                   else f"each b with its own noise_multiplier calibrated to (epsilon, delta) = {target}")  # fmt: skip
            logger.info(
                "noise_mechanism='bandmf': num_bands=%d chosen among %s by the expected squared error of the noisy "
                "prefix sums over %d steps (strategy_loss * noise_multiplier^2, %s): %s",
                num_bands, [c.num_bands for c in candidates], steps, how,
                ", ".join(f"b={c.num_bands}: {c.expected_error:.4g} (sigma {c.noise_multiplier:.4g})" for c in candidates),
            )  # fmt: skip
        if coefficients is None:
            coefficients = _strategy_coefficients(steps, num_bands)
        # Built once here to validate; the real one is built (seeded) when nothing can fail any more.
        BandMFNoise(coefficients, seed=0)
        return _NoiseChoice(
            mechanism="bandmf", num_bands=num_bands, coefficients=coefficients, total_steps=steps,
            noise_multiplier=noise_multiplier, candidates=candidates,
            make_noise=lambda: BandMFNoise(coefficients, seed=seed(), secure_mode=secure_mode),
        )  # fmt: skip

    def _compare_num_bands(
        self,
        allowed: list[int],
        *,
        total_steps: int,
        noise_multiplier: float,
        target: tuple[float, float] | None,
        accounted_steps: int | None,
        num_examples: int,
        batch_size: int,
        max_batch_size: int | None,
    ) -> tuple[BandCandidate, ...]:
        """The criterion ``strategy_loss(c_b, total_steps) * sigma_b^2`` for every allowed b.

        sigma_b is ``noise_multiplier`` (given) or calibrated to ``target`` for b's own mechanism:
        sample rate ``b * batch_size / num_examples``, ``ceil(steps / b)`` participations, and
        truncation from a group of ``ceil(num_examples / b)`` (the largest of the equal split).
        """
        comparison = _comparison_accountant(self.accountant)
        candidates = []
        unreachable: CalibrationError | None = None
        for bands in allowed:
            coefficients = _strategy_coefficients(total_steps, bands)
            loss = strategy_loss(coefficients, total_steps)
            sigma = noise_multiplier
            if target is not None:
                group_size = -(-num_examples // bands) if max_batch_size is not None else None
                try:
                    sigma = _calibrate(comparison, target, bands * batch_size / num_examples, accounted_steps,
                                       num_bands=bands, group_size=group_size, max_batch_size=max_batch_size,
                                       tolerance=_COMPARISON_TOLERANCE)  # fmt: skip
                except CalibrationError as error:
                    if not error.unreachable:
                        raise
                    unreachable, sigma = error, math.inf
            error = math.inf if math.isinf(sigma) else expected_error(coefficients, total_steps, sigma)
            candidates.append(BandCandidate(num_bands=bands, noise_multiplier=sigma, strategy_loss=loss, expected_error=error))
        if unreachable is not None and all(math.isinf(c.noise_multiplier) for c in candidates):
            raise unreachable
        return tuple(candidates)

    # ------------------------------------------------------------------ building
    def _build(self, plan: _Plan, budget: PrivacyBudget | None = None) -> tuple:
        if plan.distributed is not None:
            # Every rank must plan the same mechanism: compared across ranks (collective), raising on all.
            distributed.agree(plan, accountant=self.accountant, secure_mode=self.secure_mode)
        noise_multiplier = plan.noise_plan.noise_multiplier
        clipper = PerSampleGradientClipper(
            plan.params,
            plan.max_grad_norm,
            clipping=plan.clipping,
            groups=plan.groups,
            nan_safe=plan.nan_safe,
            rescale_to_unit_norm=plan.rescale_to_unit_norm,
        )
        private_loader = plan.private_loader
        padding_mask_source = (lambda: private_loader.padding_mask) if isinstance(private_loader, DPDataLoader) else None
        if not isinstance(private_loader, DPDataLoader):
            warnings.warn(
                "poisson_sampling=False: batches are the loader's own (shuffled, fixed size), but the accountant "
                "treats them as Poisson samples with rate 1/len(loader); the reported epsilon is an approximation"
            )
        ledger: Any = self.accountant
        if plan.noise_plan.max_batch_size is not None:
            ledger = _TruncatedLedger(self.accountant, group_size=plan.noise_plan.group_size,
                                      max_batch_size=plan.noise_plan.max_batch_size)  # fmt: skip
        dp_optimizer = DPOptimizer(
            plan.optimizer,
            noise_multiplier=noise_multiplier,
            expected_batch_size=plan.expected_batch_size,
            loss_reduction=plan.loss_reduction,
            clipper=clipper,
            noise=plan.make_noise(),
            accountant=ledger,
            sample_rate=plan.sample_rate,
            padding_mask_source=padding_mask_source,
            # Each optimizer of this engine is its own mechanism in the ledger (the first keeps "").
            source="" if self._optimizers_made == 0 else str(self._optimizers_made),
            per_user_clipping=False,
            budget=budget,
        )
        self._optimizers_made += 1
        if plan.distributed is not None:
            # Noise drawn on rank 0, then one all-reduce of clipped sums + noise per global step.
            distributed.configure(dp_optimizer, plan.distributed)
        if isinstance(private_loader, DPDataLoader):
            dp_optimizer.attach_loader(private_loader)
        self.noise_plan = plan.noise_plan
        self.budget, self._last_optimizer = budget, dp_optimizer
        # Wrapped last: its constructor hooks the model, and nothing after it can fail.
        if plan.grad_sample_mode == "no_op":
            from privacy_engine.manual_grad_sample import ManualGradSampleModule

            return ManualGradSampleModule(plan.model, batch_first=plan.batch_first,
                                          loss_reduction=plan.loss_reduction), dp_optimizer, private_loader  # fmt: skip
        if plan.grad_sample_mode != "ghost":
            wrapped = GradSampleModule(plan.model, batch_first=plan.batch_first, loss_reduction=plan.loss_reduction)
            dp_optimizer._bind_if_ours(wrapped)
            return wrapped, dp_optimizer, private_loader
        # Imported here: only the ghost mode needs it.
        from privacy_engine.ghost_clipping import GhostClippingModule

        ghost = GhostClippingModule(plan.model, batch_first=plan.batch_first, loss_reduction=plan.loss_reduction)
        # The optimizer's current_padding_mask follows the loader's mask (and VirtualSteps' slices
        # of it), so padding examples contribute zero in ghost mode as well.
        ghost.attach_clipper(clipper, padding_mask_source=dp_optimizer.current_padding_mask)
        dp_optimizer._bind_if_ours(ghost)
        # Opacus returns a wrapped criterion in ghost mode; here clipping happens inside the ordinary
        # backward pass, so the criterion is returned as given (default: cross-entropy).
        criterion = plan.criterion if plan.criterion is not None else nn.CrossEntropyLoss(reduction=plan.loss_reduction)
        return ghost, dp_optimizer, criterion, private_loader
