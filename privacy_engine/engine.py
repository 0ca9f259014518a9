"""PrivacyEngine: make a model, its optimizer and its data loader private in one call.

    engine = PrivacyEngine(accountant="pld")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
    )
    ...  # the usual training loop
    engine.get_epsilon(delta=1e-5)

Opacus's keyword names are accepted (``module=``, ``data_loader=``, ``grad_sample_mode=``,
``noise_generator=``, ...), so an Opacus script switches by changing its import.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from accountants import Accountant, calibrate_noise_multiplier, make_accountant
from privacy_engine.clip_factors import validate_max_grad_norm
from privacy_engine.clipper import (
    CLIPPING_MODES,
    PerSampleGradientClipper,
    parameter_groups,
)
from privacy_engine.grad_sample_module import LOSS_REDUCTIONS, GradSampleModule
from privacy_engine.noise import BandMFNoise, GaussianNoise, NoiseMechanism
from privacy_engine.optimizer import DPOptimizer, trainable_parameters
from privacy_engine.sampling import DPDataLoader
from privacy_engine.strategy import optimize_banded_toeplitz
from privacy_engine.validation import UnsupportedModuleError, find_problems

__all__ = ["PrivacyEngine"]

# Opacus's default accountant is "prv" (a numerical privacy-loss accountant like PLD): it maps to
# dp-accounting's PLD accountant here.
ACCOUNTANT_ALIASES = {"pld": "pld", "prv": "pld", "rdp": "rdp"}
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ghost")
NOISE_MECHANISMS = ("gaussian", "bandmf")


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


class PrivacyEngine:
    """Builds private training from a model, an optimizer and a data loader, and keeps the
    privacy ledger (one accountant for everything this engine made private).

    Args:
        accountant: ``"pld"`` (dp-accounting's privacy-loss-distribution accountant, tight) or
            ``"rdp"`` (Renyi DP, an upper bound); Opacus's ``"prv"`` is read as ``"pld"``. Or an
            empty ``accountants.Accountant`` with your settings, e.g.
            ``make_accountant("pld", value_discretization_interval=1e-3)`` (10x faster epsilon,
            slightly more pessimistic).
        secure_mode: noise from OS entropy only (no seeds accepted), each value the sum of several
            independently seeded draws; Poisson sampling seeded from OS entropy as well.
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
        nan_safe: bool = True,
        rescale_to_unit_norm: bool = False,
    ) -> tuple:
        """Wrap ``model`` (``GradSampleModule``), ``optimizer`` (``DPOptimizer``) and ``loader``
        (``DPDataLoader``, Poisson sampling) for DP-SGD, and record every step with this engine's
        accountant.

        Guarantee: every argument below is checked before anything is wrapped; on any error the
        model, optimizer and loader are left exactly as they were. After the call, each
        ``optimizer.step()`` releases clipped-sum-plus-Gaussian-noise gradients and is recorded
        with ``sample_rate = loader.batch_size / len(dataset)``.

        ======================================  =============================================
        argument problem                        error (raised before wrapping)
        ======================================  =============================================
        optimizer param not in the model        ValueError naming the parameter's position
        trainable model param not in optimizer  ValueError naming it (freeze it or add it)
        noise_multiplier < 0, NaN, inf          ValueError naming noise_multiplier
        max_grad_norm <= 0 or NaN               ValueError naming max_grad_norm
        max_grad_norm inf with noise > 0        ValueError naming max_grad_norm
        per_layer list of the wrong length      ValueError: one per layer or per parameter
        dataset without __len__ / iterable      TypeError naming the data loader's dataset
        BatchNorm / unsupported layer           UnsupportedModuleError (the core's)
        noise_seed/noise_generator + secure     ValueError naming the argument
        unknown clipping / mode / reduction     ValueError naming the argument
        ======================================  =============================================

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
                approximation; a warning says so).
            clipping: ``"flat"`` or ``"per_layer"``.
            loss_reduction: ``"mean"`` or ``"sum"``: how the loss reduces over the batch.
            batch_first: the batch is dim 0 (True) or dim 1 of the model's inputs.
            noise_seed: seed for reproducible noise (``None``: OS entropy).
            noise_generator: Opacus's seeding: a ``torch.Generator`` that seeds the noise (one draw)
                and drives Poisson sampling.
            grad_sample_mode: ``"hooks"`` or ``"functorch"`` (both: exact per-sample gradients, with
                ``torch.func`` for layers without a registered sampler), or ``"ghost"``: fast
                clipping inside the backward pass (``GhostClippingModule``), which then returns
                ``(module, optimizer, criterion, data_loader)`` as Opacus does.
            criterion: returned (unchanged) in ghost mode; default ``nn.CrossEntropyLoss``.
            noise_mechanism: ``"gaussian"`` (DP-SGD), ``"bandmf"`` (banded matrix factorisation
                with ``num_bands`` bands and cyclic Poisson sampling; coefficients
                ``bandmf_coefficients`` or optimised for ``total_steps``), or a ready
                ``NoiseMechanism``.
            nan_safe, rescale_to_unit_norm: see ``PerSampleGradientClipper``.
        """
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
            nan_safe=nan_safe,
            rescale_to_unit_norm=rescale_to_unit_norm,
        )
        return self._build(plan, _real("noise_multiplier", noise_multiplier))

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
        **kwargs: Any,
    ) -> tuple:
        """``make_private`` with the smallest noise multiplier that keeps the whole run within
        ``(target_epsilon, target_delta)``: calibrated with ``accountants.calibrate_noise_multiplier``
        (this engine's accountant kind) over ``steps = epochs * len(loader)`` steps at the private
        loader's sample rate. ``optimizer.noise_multiplier`` holds the result.

        Guarantee: running at most ``epochs * len(loader)`` steps (``len`` of the loader passed in;
        the Poisson loader yields ``round(1/q)`` per epoch, never more) keeps this engine's
        ``get_epsilon(target_delta) <= target_epsilon``, if nothing else was recorded before.

        ==================================  ======================================
        case                                result
        ==================================  ======================================
        target_epsilon <= 0 / NaN / inf     ValueError naming target_epsilon
        target_delta not in (0, 1)          ValueError naming target_delta
        epochs < 1 / not an int             ValueError naming epochs
        target unreachable                  accountants.CalibrationError
        noise_multiplier also given         TypeError
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
        plan = self._plan(
            model=_pick("model", model, "module", module),
            optimizer=optimizer,
            data_loader=_pick("loader", loader, "data_loader", data_loader),
            noise_multiplier=None,
            max_grad_norm=max_grad_norm,
            **self._plan_kwargs(kwargs),
            epochs=int(epochs),
        )
        steps = int(epochs) * plan.steps_per_epoch
        noise_multiplier = calibrate_noise_multiplier(
            target_epsilon,
            target_delta,
            plan.sample_rate,
            steps,
            accountant=self.accountant.fresh(),
            num_bands=plan.num_bands,
        )
        return self._build(plan, noise_multiplier)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon of everything recorded so far at ``delta`` (the accountant's; ValueError naming
        delta unless 0 < delta < 1)."""
        return self.accountant.get_epsilon(delta)

    def state_dict(self) -> dict[str, Any]:
        """The privacy ledger (accountant history): save it with the optimizer's state dict."""
        return {"accountant": self.accountant.state_dict(), "secure_mode": self.secure_mode}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])

    def save_checkpoint(
        self, *, path: Any, module: nn.Module, optimizer: Optimizer | None = None, checkpoint_dict: dict | None = None
    ) -> None:
        """Save model, optimizer (with its DP state) and the privacy ledger to ``path`` (Opacus's
        method name)."""
        checkpoint = dict(checkpoint_dict or {})
        checkpoint["module_state_dict"] = module.state_dict()
        checkpoint["privacy_engine_state_dict"] = self.state_dict()
        if optimizer is not None:
            checkpoint["optimizer_state_dict"] = optimizer.state_dict()
        torch.save(checkpoint, path)

    def load_checkpoint(self, *, path: Any, module: nn.Module, optimizer: Optimizer | None = None) -> dict:
        """Restore what ``save_checkpoint`` wrote; returns the whole checkpoint dict."""
        # weights_only=False: the DP state holds generator states and the accountant's history.
        checkpoint = torch.load(path, weights_only=False)
        module.load_state_dict(checkpoint["module_state_dict"])
        self.load_state_dict(checkpoint["privacy_engine_state_dict"])
        if optimizer is not None and "optimizer_state_dict" in checkpoint:
            optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        return checkpoint

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _plan_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
        allowed = {
            "poisson_sampling", "clipping", "loss_reduction", "batch_first", "noise_seed", "noise_generator",
            "grad_sample_mode", "criterion", "noise_mechanism", "num_bands", "bandmf_coefficients",
            "total_steps", "nan_safe", "rescale_to_unit_norm",
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
        nan_safe: bool = True,
        rescale_to_unit_norm: bool = False,
        epochs: int | None = None,
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

        # --- noise mechanism
        make_noise, bands = self._plan_noise(noise_mechanism, num_bands, bandmf_coefficients, total_steps, epochs,
                                        data_loader, noise_seed, noise_generator)  # fmt: skip

        # --- the data: sized dataset, sampling
        dataset = data_loader.dataset
        if isinstance(dataset, IterableDataset) or not hasattr(type(dataset), "__len__"):
            raise TypeError(
                f"data_loader.dataset ({type(dataset).__name__}) must be a sized, map-style dataset (len(dataset) and "
                f"dataset[i]): the sample rate and Poisson sampling need the number of examples"
            )
        if len(data_loader) < 1:
            raise ValueError("data_loader is empty")
        sampling_generator = noise_generator
        if self.secure_mode:
            sampling_generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        if bands > 1:
            if not poisson_sampling:
                raise ValueError("noise_mechanism='bandmf' needs poisson_sampling=True (cyclic Poisson sampling)")
            private_loader = DPDataLoader.cyclic(data_loader, bands, generator=sampling_generator)
        elif poisson_sampling:
            private_loader = DPDataLoader.from_data_loader(data_loader, generator=sampling_generator)
        else:
            private_loader = data_loader
        if isinstance(private_loader, DPDataLoader):
            sample_rate, expected_batch_size = private_loader.sample_rate, private_loader.expected_batch_size
        else:
            if data_loader.batch_size is None:
                raise ValueError("data_loader.batch_size is None: build the loader with batch_size set")
            sample_rate, expected_batch_size = 1.0 / len(data_loader), float(data_loader.batch_size)
        # Validates what the accountant will be given, recording nothing.
        self.accountant.step(noise_multiplier=0.0 if sigma == math.inf else sigma, sample_rate=sample_rate,
                             num_steps=0, num_bands=bands)  # fmt: skip

        return _Plan(
            model=model,
            optimizer=optimizer,
            private_loader=private_loader,
            sample_rate=sample_rate,
            expected_batch_size=expected_batch_size,
            steps_per_epoch=len(data_loader),
            params=params,
            groups=groups,
            clipping=clipping,
            max_grad_norm=max_grad_norm,
            loss_reduction=loss_reduction,
            batch_first=batch_first,
            make_noise=make_noise,
            num_bands=bands,
            grad_sample_mode=grad_sample_mode,
            criterion=criterion,
            nan_safe=nan_safe,
            rescale_to_unit_norm=rescale_to_unit_norm,
        )

    def _plan_noise(
        self,
        noise_mechanism: Any,
        num_bands: Any,
        bandmf_coefficients: Any,
        total_steps: Any,
        epochs: int | None,
        data_loader: DataLoader,
        noise_seed: int | None,
        noise_generator: torch.Generator | None,
    ) -> tuple[Callable[[], NoiseMechanism], int]:
        """A builder of the noise mechanism (called only once nothing can fail) and its bands."""
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
            return (lambda: noise_mechanism), int(getattr(noise_mechanism, "num_bands", 1))
        if noise_mechanism not in NOISE_MECHANISMS:
            raise ValueError(f"noise_mechanism must be one of {NOISE_MECHANISMS} or a NoiseMechanism; got {noise_mechanism!r}")
        if noise_mechanism == "gaussian":
            if num_bands not in (None, 1) or bandmf_coefficients is not None:
                raise ValueError("num_bands / bandmf_coefficients need noise_mechanism='bandmf'")
            return (lambda: GaussianNoise(seed=seed(), secure_mode=secure_mode)), 1
        if isinstance(num_bands, bool) or not isinstance(num_bands, numbers.Integral) or num_bands < 1:
            raise ValueError(f"num_bands must be an int >= 1 with noise_mechanism='bandmf'; got {num_bands!r}")
        if bandmf_coefficients is None:
            steps = total_steps
            if steps is None and epochs is not None:
                steps = epochs * len(data_loader)
            if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < num_bands:
                raise ValueError(
                    f"total_steps must be an int >= num_bands to optimise the BandMF strategy (or give "
                    f"bandmf_coefficients); got {total_steps!r}"
                )
            bandmf_coefficients = optimize_banded_toeplitz(int(steps), int(num_bands))
        # Built once here to validate the coefficients; the real one is built (seeded) at the end.
        probe = BandMFNoise(bandmf_coefficients, seed=0)
        if probe.num_bands != num_bands:
            raise ValueError(f"bandmf_coefficients has {probe.num_bands} entries but num_bands={num_bands}")
        coefficients = probe.coefficients
        return (lambda: BandMFNoise(coefficients, seed=seed(), secure_mode=secure_mode)), probe.num_bands

    # ------------------------------------------------------------------ building
    def _build(self, plan: _Plan, noise_multiplier: float) -> tuple:
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
        dp_optimizer = DPOptimizer(
            plan.optimizer,
            noise_multiplier=noise_multiplier,
            expected_batch_size=plan.expected_batch_size,
            loss_reduction=plan.loss_reduction,
            clipper=clipper,
            noise=plan.make_noise(),
            accountant=self.accountant,
            sample_rate=plan.sample_rate,
            padding_mask_source=padding_mask_source,
        )
        # Wrapped last: its constructor hooks the model, and nothing after it can fail.
        if plan.grad_sample_mode != "ghost":
            wrapped = GradSampleModule(plan.model, batch_first=plan.batch_first, loss_reduction=plan.loss_reduction)
            return wrapped, dp_optimizer, private_loader
        # Imported here: only the ghost mode needs it.
        from privacy_engine.ghost_clipping import GhostClippingModule

        ghost = GhostClippingModule(plan.model, batch_first=plan.batch_first, loss_reduction=plan.loss_reduction)
        ghost.attach_clipper(clipper, padding_mask_source=dp_optimizer.current_padding_mask)
        # Opacus returns a wrapped criterion in ghost mode; here clipping happens inside the ordinary
        # backward pass, so the criterion is returned as given (default: cross-entropy).
        criterion = plan.criterion if plan.criterion is not None else nn.CrossEntropyLoss(reduction=plan.loss_reduction)
        return ghost, dp_optimizer, criterion, private_loader
