"""``PrivacyEngine``: options -> plan -> build -> ledger.

``make_private`` reads its settings into a ``PrivacyOptions`` (``engine.options``), plans the noise
mechanism, bands, sigma and sampling without changing anything (``engine.plan``, with
``engine.bands`` and ``engine.calibration``), builds the private optimizer and wraps the model
(``engine.build``), and from then on every step is recorded in the engine's accountant (its
privacy ledger; ``engine.ledger``, ``engine.budget``). Checkpoints: ``engine.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import Unpack

from accountants import Accountant
from privacy_engine.auditing.config import AuditConfig
from privacy_engine.auditing.report import AuditReport, audit_report
from privacy_engine.engine import checkpoint, sharded
from privacy_engine.engine.budget import PrivacyBudget, step_kwargs_of
from privacy_engine.engine.build import private_optimizer, wrap_model
from privacy_engine.engine.checkpoint.sharded import load_sharded_checkpoint, save_sharded_checkpoint
from privacy_engine.engine.noise_plan import NoisePlan
from privacy_engine.engine.options import model_and_loader, options_from, resolve_accountant, takes_settings
from privacy_engine.engine.plan import Plan, make_plan
from privacy_engine.engine.typed_settings import MakePrivateSettings, MakePrivateWithEpsilonSettings
from privacy_engine.training.fsdp_private import FSDPPrivateOptimizer
from privacy_engine.training.optimizer import DPOptimizer

__all__ = ["PrivacyEngine"]

#: What the engine's ``make_private`` and ``make_private_with_epsilon`` return, in every mode.
Private = tuple[nn.Module, DPOptimizer, DataLoader]


def _refuse_criterion(entry_point: str, settings: Mapping[str, Any]) -> None:
    """TypeError when ``entry_point`` is given ``criterion=``: the engine returns ``(module, optimizer,
    data_loader)`` in every mode and the loss function needs no wrapper, so there is no criterion to
    take or hand back. Kept as its own error, rather than the unknown-keyword one, because a script
    written for Opacus passes it (Opacus's ghost mode wraps the criterion and returns it fourth)."""
    if "criterion" in settings:
        raise TypeError(
            f"{entry_point}() takes no criterion: PrivacyEngine returns (module, optimizer, data_loader) in every "
            f"grad_sample_mode, ghost included, and your loss function works unchanged; use it as it is."
        )


def _refuse_extras(entry_point: str, **extras: Any) -> None:
    """TypeError naming the first of ``extras`` given: a sharded checkpoint holds none of them."""
    given = [name for name, value in extras.items() if value is not None]
    if given:
        raise TypeError(f"{entry_point}() of a fully_shard run takes no {given[0]}: a sharded checkpoint holds the "
                        "model, the optimizer, the ledger, the noise and the sampling state only")  # fmt: skip


class PrivacyEngine:
    """Builds private training from a model, an optimizer and a data loader, and keeps the
    privacy ledger (one accountant for everything this engine made private)::

        engine = PrivacyEngine(accountant="pld")
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
        )
        ...  # the usual training loop
        engine.get_epsilon(delta=1e-5)

    Args:
        accountant: ``"pld"`` (dp-accounting's privacy-loss-distribution accountant, tight) or
            ``"rdp"`` (Renyi DP, an upper bound); ``"prv"`` (Opacus's default name) is read as ``"pld"``. Or an
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
        self.accountant = resolve_accountant(accountant)
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
        #: The last audited make_private call: (its AuditConfig, its optimizer, its target_delta, its model, which
        #: input canaries are scored on); None for none.
        self._audit: tuple[AuditConfig, DPOptimizer, float | None, nn.Module] | None = None

    @property
    def num_bands(self) -> int | None:
        """Bands of the last ``make_private`` call's noise (1 for DP-SGD); None before any call."""
        return None if self.noise_plan is None else self.noise_plan.num_bands

    # ------------------------------------------------------------------ making things private
    @takes_settings("make_private")
    def make_private(self, model: nn.Module | None = None, optimizer: Optimizer | None = None,
                     loader: DataLoader | None = None, *, module: nn.Module | None = None,
                     data_loader: DataLoader | None = None,
                     **settings: Unpack[MakePrivateSettings]) -> Private:  # fmt: skip
        """Wrap ``model``, ``optimizer`` (``DPOptimizer``) and ``loader`` (``DPDataLoader``: Poisson
        sampling, or cyclic Poisson sampling for BandMF) for private training, and record every step
        with this engine's accountant. ``module`` and ``data_loader`` name ``model`` and ``loader`` too
        (the keywords Opacus uses); ``settings`` are the fields of ``PrivacyOptions``
        (``noise_multiplier`` and ``max_grad_norm`` required), documented there.

        Returns ``(module, optimizer, data_loader)``, three objects in every ``grad_sample_mode``, so a
        script switches modes by changing that one keyword:

        ===========================  ===========================  ==============================
        grad_sample_mode             module                       per-example clipping
        ===========================  ===========================  ==============================
        "hooks", "ew", "functorch"   ``GradSampleModule``         materialised per-sample
                                                                  gradients, clipped at step()
        "ghost"                      ``GhostClippingModule``      fast clipping inside the
                                                                  ordinary backward pass
        "no_op"                      ``ManualGradSampleModule``   the loop sets ``p.grad_sample``
        "auto" (default)             ghost or hooks               ``engine.mode_choice``: ghost for
                                                                  trainable convolutions, else hooks
        ===========================  ===========================  ==============================

        ``optimizer`` is the private optimizer (a ``DPOptimizer`` wrapping yours) and ``data_loader``
        the private loader (a ``DPDataLoader``; with ``poisson_sampling=False``, the loader given).
        Ghost mode needs no special criterion: compute the loss as usual (unlike Opacus, whose ghost
        mode returns ``(module, optimizer, criterion, data_loader)`` with a wrapped criterion).

        A model sharded with FSDP2 (``fully_shard``), called on every rank: ghost mode ("auto" becomes it), the
        model itself returned, hooked, with an ``FSDPPrivateOptimizer`` and the distributed Poisson loader; the
        same loop and the same event as one process (``engine.sharded``, which lists what it refuses).

        Guarantee: every argument is checked before anything is wrapped; on any error the model,
        optimizer and loader are left exactly as they were. After the call, each
        ``optimizer.step()`` releases the clipped sum plus this step's noise and is recorded with
        the mechanism actually run: DP-SGD with ``sample_rate = loader.batch_size / len(dataset)``,
        or, for BandMF with ``b`` bands, cyclic Poisson sampling from group ``t mod b`` with
        ``p = b * batch_size / len(dataset)``, which the accountant composes ``ceil(steps / b)``
        times (the amplified BandMF event); with ``max_batch_size``, as truncated Poisson sampling
        from the group size with the largest epsilon among every realised size ``|g|`` and ``|g| + 1``
        (an added example's group; dp-accounting's ``TruncatedSubsampledGaussianDpEvent``; see
        ``engine.truncation``). With ``poisson_sampling=False``, a step of ``k`` of the loader's
        batches is accounted at ``min(1, k / len(loader))`` and divided by ``k * batch_size``
        (``training.sampling.ShuffledBatches``).
        ``engine.noise_plan`` says what was set up (and ``engine.num_bands`` the bands).

        ==========================================  =============================================
        argument problem                            error (raised before wrapping)
        ==========================================  =============================================
        a keyword that is no setting                TypeError naming it
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
        grad_scaler not a torch.amp.GradScaler      TypeError naming grad_scaler
        criterion= (as Opacus's ghost mode takes)   TypeError: the loss works unchanged, drop it
        audit= not an ``auditing.AuditConfig``       TypeError naming audit
        audit with poisson_sampling=False or        ValueError naming the setting (a canary could
        max_batch_size                              not take part exactly as an example does)
        audit seed with secure_mode                 ValueError naming the seed
        input canaries with DDP                     ValueError naming kind="input"
        input canaries, dataset iterable/unsized    TypeError naming data_loader.dataset
        ==========================================  =============================================
        """
        _refuse_criterion("make_private", settings)
        model, loader = model_and_loader(model, module, loader, data_loader)
        return self._make_private("make_private", model, optimizer, loader, settings)

    @takes_settings("make_private_with_epsilon")
    def make_private_with_epsilon(self, model: nn.Module | None = None, optimizer: Optimizer | None = None,
                                  loader: DataLoader | None = None, *, module: nn.Module | None = None,
                                  data_loader: DataLoader | None = None,
                                  **settings: Unpack[MakePrivateWithEpsilonSettings]) -> Private:  # fmt: skip
        """``make_private`` with the smallest noise multiplier that keeps the whole run within
        ``(target_epsilon, target_delta)``: calibrated with ``accountants.calibrate_noise_multiplier``
        (this engine's accountant kind and settings) over ``steps = epochs * len(private_loader)`` steps of
        the mechanism run (DP-SGD; BandMF's amplified event with its bands and cyclic sample rate;
        truncated sampling with ``max_batch_size``). ``optimizer.noise_multiplier`` holds the result.
        ``settings``: the fields of ``PrivacyOptions`` (``target_epsilon``, ``target_delta``,
        ``epochs`` and ``max_grad_norm`` required; not ``noise_multiplier``, not ``criterion``).

        Returns ``(module, optimizer, data_loader)`` in every ``grad_sample_mode``, as ``make_private``.

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
        _refuse_criterion("make_private_with_epsilon", settings)
        model, loader = model_and_loader(model, module, loader, data_loader)
        return self._make_private("make_private_with_epsilon", model, optimizer, loader, settings)

    def _make_private(self, entry_point: str, model: nn.Module, optimizer: Optimizer, loader: DataLoader,
                      settings: Mapping[str, Any]) -> Private:  # fmt: skip
        """options -> plan -> build, for either entry point (``settings``: ``PrivacyOptions``' fields;
        a subclass calls it with the objects and settings its own signature took)."""
        options = options_from(entry_point, dict(settings))
        if sharded.is_fsdp2(model):
            # fully_shard: ghost clipping on the shards; what it cannot do is refused here (engine.sharded).
            options = sharded.fsdp_options(options, model)
        plan = make_plan(options, model=model, optimizer=optimizer, data_loader=loader, accountant=self.accountant,
                         secure_mode=self.secure_mode)  # fmt: skip
        return self._build(plan, options.budget())

    def _build(self, plan: Plan, budget: PrivacyBudget | None) -> Private:
        # Each optimizer of this engine is its own mechanism in the ledger (the first keeps "").
        source = "" if self._optimizers_made == 0 else str(self._optimizers_made)
        if plan.distributed is not None and sharded.is_fsdp2(plan.model):
            fsdp_optimizer = sharded.private_fsdp_optimizer(plan, plan.optimizer, accountant=self.accountant,
                                                            secure_mode=self.secure_mode, budget=budget,
                                                            source=source)  # fmt: skip
            self._optimizers_made += 1
            self.noise_plan, self.budget, self._last_optimizer = plan.noise_plan, budget, fsdp_optimizer
            return plan.model, fsdp_optimizer, plan.private_loader
        optimizer = private_optimizer(plan, accountant=self.accountant, secure_mode=self.secure_mode, budget=budget,
                                      source=source)  # fmt: skip
        self._optimizers_made += 1
        self.noise_plan, self.budget, self._last_optimizer = plan.noise_plan, budget, optimizer
        # Wrapped last (its constructor hooks the model), then connected to this optimizer and loader only
        # (engine.build.wrap_model calls connect_private; it unwraps the model again if that refuses).
        private = wrap_model(plan, optimizer)
        if plan.options.audit is not None:
            self._audit = (plan.options.audit, optimizer, plan.options.target_delta, private[0])
        return private

    # ------------------------------------------------------------------ the ledger
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
                raise ValueError(
                    f"steps_left needs {missing}: this engine has no budget (make_private(max_epsilon=...))"
                )
            max_epsilon = self.budget.max_epsilon if max_epsilon is None else max_epsilon
            delta = self.budget.delta if delta is None else delta
        return optimizer.accountant.steps_left(max_epsilon, delta, **step_kwargs_of(optimizer))

    # ------------------------------------------------------------------ the audit
    def audit_report(self, *, confidence: float | None = None, delta: float | None = None,
                     warn_factor: float | None = None) -> AuditReport:  # fmt: skip
        """The one-run audit of the last ``make_private(audit=AuditConfig(...))`` run so far: the epsilon lower
        bound from its canaries' scores (epsilon-DP and GDP variants, at ``confidence``) beside this engine's
        ``get_epsilon(delta)`` (``auditing.AuditReport``; ``str(report)`` is a table, ``report.plot(path)`` a
        chart). Defaults from the ``AuditConfig``; ``delta``: its delta, else the run's ``target_delta``, else 1e-5.
        Warns ``auditing.AuditBoundWarning`` when the lower bound is at least ``warn_factor`` times the claimed
        epsilon (a bug). ``RuntimeError`` if no ``make_private`` call of this engine had an audit. Input canaries
        (``kind="input"``) are scored now, on the model as it is (``-loss``, or ``AuditConfig.score_fn``).

        Guarantee: the canaries are counted in no accounting and change no privacy loss of the real examples
        (they are data-independent vectors added before data-independent noise); a canary takes part in each
        release exactly as an example does, so the lower bound exceeds the accountant's epsilon with probability
        at most ``1 - confidence`` unless the code or the accounting is wrong."""
        if self._audit is None:
            raise RuntimeError(
                "no make_private call of this engine had an audit: pass audit=AuditConfig(num_canaries=...)"
            )
        config, optimizer, target_delta, model = self._audit
        delta = next(d for d in (delta, config.delta, target_delta, 1e-5) if d is not None)
        if config.kind == "input":
            optimizer.canaries.compute_scores(model)  # -loss of the model as it is now (or score_fn)
        return audit_report(
            optimizer.canaries, claimed_epsilon=self.get_epsilon(delta), delta=delta,
            confidence=config.confidence if confidence is None else confidence,
            warn_factor=config.warn_factor if warn_factor is None else warn_factor,
        )  # fmt: skip

    # ------------------------------------------------------------------ checkpoints
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

    def load_state_dict(self, state: dict[str, Any], *, optimizer: DPOptimizer | None = None) -> None:
        """Restore ``state_dict()``: the accountant's history and the noise plan. Everything is
        checked first (``check_state_dict``); on an error nothing changes.

        Guarantee: no step of a private optimizer other than ``optimizer`` is removed from the ledger.
        With one optimizer on the engine the saved ledger replaces the current one (resume, rollback);
        with several, only ``optimizer``'s entries are replaced by the saved ones and every other
        optimizer keeps the longer of its current and saved histories (none given: every optimizer
        does, nothing is rolled back). See ``checkpoint.ledger_after_restore``."""
        plan = checkpoint.check_engine_state(self, state)
        restored_source = None if optimizer is None else str(optimizer.source)
        self.accountant.load_state_dict(
            checkpoint.ledger_after_restore(self, state["accountant"], restored_source=restored_source)
        )
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
        """Save everything a run needs to resume exactly to ``path`` (the name and keywords Opacus uses,
        plus ``data_loader``): the model, the optimizer with its DP state (noise mechanism:
        generators, BandMF history and ring position; clipper; counters), the engine's ledger,
        ``secure_mode`` and ``noise_plan``, the private loader's sampling state (generator,
        position, cyclic groups), scheduler states, and ``checkpoint_dict``'s entries.

        Guarantee: the file is written atomically (temporary file in the same folder, fsync,
        ``os.replace``): an exception or a kill while saving leaves the previous file at ``path``
        intact and loadable. It holds only plain data (loads with ``torch.load(weights_only=True)``,
        cannot run code) and a SHA-256 of its contents. In secure mode it holds no seed or
        generator state (see ``privacy_engine.engine.checkpoint`` for what it holds and how secret it is).

        =========================================  =========================================
        case                                       result (nothing written)
        =========================================  =========================================
        BandMF / cyclic sampling, no data_loader   ValueError: the loader state is needed
        optimizer / data_loader not from           TypeError
        make_private
        checkpoint_dict holds a non-plain value    TypeError naming it
        checkpoint_dict uses a reserved key        ValueError naming it
        =========================================  =========================================

        A run on a ``fully_shard`` model (its optimizer an ``FSDPPrivateOptimizer``) is saved as the folder
        ``path`` by every rank (``checkpoint.sharded.save_sharded_checkpoint``: DCP for the shards; schedulers and
        ``checkpoint_dict`` are refused there).
        """
        if isinstance(optimizer, FSDPPrivateOptimizer):
            _refuse_extras("save_checkpoint", noise_scheduler=noise_scheduler, grad_clip_scheduler=grad_clip_scheduler,
                           checkpoint_dict=checkpoint_dict, module_state_dict_kwargs=module_state_dict_kwargs,
                           torch_save_kwargs=torch_save_kwargs)  # fmt: skip
            save_sharded_checkpoint(self, path, module=module, optimizer=optimizer, data_loader=data_loader)
            return
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
        """Restore what ``save_checkpoint`` wrote into the objects given (the name and keywords Opacus
        uses, plus ``data_loader``); returns the checkpoint dict (``checkpoint_dict``'s entries
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
        if isinstance(optimizer, FSDPPrivateOptimizer):
            # A fully_shard run: the folder save_checkpoint wrote (checkpoint.sharded), every rank.
            _refuse_extras("load_checkpoint", noise_scheduler=noise_scheduler, grad_clip_scheduler=grad_clip_scheduler,
                           module_load_dict_kwargs=module_load_dict_kwargs, torch_load_kwargs=torch_load_kwargs)  # fmt: skip
            load_sharded_checkpoint(self, path, module=module, optimizer=optimizer, data_loader=data_loader)
            return {}
        load_kwargs = dict(torch_load_kwargs or {})
        if load_kwargs.pop("weights_only", True) is not True:
            raise ValueError("load_checkpoint always unpickles with weights_only=True; a checkpoint never needs more")
        map_location = load_kwargs.pop("map_location", "cpu")
        if load_kwargs:
            raise TypeError(f"torch_load_kwargs may set map_location only; got {sorted(load_kwargs)}")
        payload = checkpoint.read_checkpoint(path, map_location=map_location)
        checkpoint.restore_checkpoint(
            self, payload, name=checkpoint.display_name(path), module=module, optimizer=optimizer,
            data_loader=data_loader, noise_scheduler=noise_scheduler, grad_clip_scheduler=grad_clip_scheduler,
            module_load_dict_kwargs=module_load_dict_kwargs,
        )  # fmt: skip
        return payload
