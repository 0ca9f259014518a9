"""PyTorch Lightning with differential privacy: ``DPStrategy``.

The user's ``LightningModule`` stays as it is; one line changes, the Trainer's strategy::

    trainer = lightning.pytorch.Trainer(
        max_epochs=5,
        strategy=DPStrategy(target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0),  # the one line
    )
    trainer.fit(model, datamodule=data)
    trainer.strategy.get_epsilon()

A strategy, not a callback: Lightning asks its strategy for exactly the pieces DP-SGD replaces, each at a
public hook (``process_dataloader``: the training loader; ``training_step``: the forward; ``optimizer_step``:
the release; ``save_checkpoint`` / ``load_checkpoint``: the files), so nothing of Lightning is patched.
``DPStrategy`` is Lightning's ``SingleDeviceStrategy`` with these changes:

- the training loader: the module's (or datamodule's) ``train_dataloader()`` is replaced, when Lightning
  asks for it, by the engine's Poisson-sampling ``DPDataLoader`` (``PrivacyEngine.make_private`` or
  ``make_private_with_epsilon``, with the optimizer ``configure_optimizers`` returned, wrapped in a
  ``DPOptimizer``): sample rate ``batch_size / len(dataset)``, batch sizes vary;
- the forward: every training step runs through the engine's wrapper (``GradSampleModule`` or
  ``GhostClippingModule`` around the ``LightningModule``, whose forward is ``training_step`` for that call), so
  each example's gradient is captured and clipped, and the engine's first-step independence check sees the
  user's loss too (it runs ``training_step`` twice more under ``no_grad`` at the first step, on the batch and on
  two of its examples; ``self.log`` does nothing during those runs); validation, test and predict steps run the
  module directly;
- an empty Poisson batch: ``training_step`` is not called (a model may fail on zero examples); the optimizer
  step that follows releases noise alone, as the accounting assumes;
- a ``training_step`` that returns None on a batch with examples (Lightning's way to skip a batch): without
  gradient accumulation nothing is released or recorded for that batch, as a plain loop that skips ``step()``;
  with ``accumulate_grad_batches=k`` the other micro-batches of the logical batch are released as usual;
- ``accumulate_grad_batches=k``: one logical batch, Poisson-sampled at rate ``k * batch_size / len(dataset)``,
  is cut into ``k`` micro-batches (sizes differing by at most one; some may be empty); Lightning runs a
  forward and backward on each and steps once: the release is one DP-SGD step, recorded once, divided by
  the expected logical batch size ``k * batch_size``;
- the budget: with ``target_epsilon`` (or ``max_epsilon``) the optimizer refuses any release that would take
  epsilon past it (``PrivacyBudgetExceeded``, nothing released or recorded); the strategy then drops the
  refused batch's clipped gradients, sets ``trainer.should_stop`` and takes no further step;
- epsilon (at ``target_delta``) is logged through the LightningModule's ``log`` as ``"epsilon"`` at the end
  of every training epoch (and every step with ``log_epsilon="step"``), so every Lightning logger, the
  progress bar and ``ModelCheckpoint(monitor="epsilon")`` see it;
- checkpoints go through Lightning's own checkpointing (``ModelCheckpoint``, ``trainer.save_checkpoint``,
  ``trainer.fit(ckpt_path=...)``): ``save_checkpoint`` adds the engine's state (accountant history, noise
  and sampling generators, the DPOptimizer's state, the loader's position; see ``PrivacyEngine.save_checkpoint``)
  under ``checkpoint["privacy_engine"]``; ``load_checkpoint`` takes it back out and restores it, checked part
  by part and all or nothing, as soon as the private pieces exist (at the first training loader). A resumed
  run continues with the same noise, the same batches and the same epsilon as an uninterrupted one.
  Loading never runs code: every checkpoint is read with ``torch.load(weights_only=True)`` (asking for
  ``weights_only=False`` raises), and the engine's part holds plain data only (``check_plain``);
- precision: ``"32-true"``, ``"64-true"`` and ``"bf16-mixed"`` (autocast for the forward, so per-example
  gradients come in bfloat16 where autocast computed in it; the parameters, the per-example norms, the clipped
  sum, the noise and the released gradient are float32); others are refused;
- noise and sampling are seeded from the OS unless ``noise_seed`` is given (``seed_everything`` seeds torch's
  global generator with a known value, which must not decide the noise).

Refused, with a ``ValueError`` at ``trainer.fit`` before anything is wrapped: several devices or nodes,
``gradient_clip_val`` (per-example clipping replaces it: set ``max_grad_norm``), ``overfit_batches``,
``reload_dataloaders_every_n_epochs``, manual optimization, more than one optimizer, a train loader that
is not a ``torch.utils.data.DataLoader`` over a sized map-style dataset, ``max_batch_size`` with
accumulation. A ``DPStrategy`` serves one ``trainer.fit`` (a new one resumes from a checkpoint).

Not covered by the guarantee: what the training step logs (the loss of each batch, computed without noise),
anything a callback reads from ``.grad`` before the optimizer step (``on_before_optimizer_step``: the
un-noised gradient), validation metrics on private data.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, IterableDataset

from privacy_engine.batches.tickets import find_ticket, tag_batch
from privacy_engine.engine import PrivacyEngine
from privacy_engine.engine.budget import PrivacyBudgetExceeded
from privacy_engine.engine.checkpoint import build_checkpoint, check_plain, restore_checkpoint
from privacy_engine.engine.mode_choice import AUTO
from privacy_engine.noise.secure_random import full_entropy_generator
from privacy_engine.settings_checks import check_noise_seed
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.optimizer import DPOptimizer
from privacy_engine.training.virtual_steps import batch_size_of

__all__ = ["CHECKPOINT_KEY", "DPStrategy"]

logger = logging.getLogger(__name__)

#: The key of the engine's state in a Lightning checkpoint dict.
CHECKPOINT_KEY = "privacy_engine"

_PRECISIONS = ("32-true", "64-true", "bf16-mixed")


def _examples_in(batch: Any) -> int | None:
    """Rows of the batch (dim 0 of its first tensor), None if it holds no tensor with a dimension."""
    try:
        return batch_size_of(batch)
    except ValueError:
        return None


def _rows(value: Any, start: int, end: int) -> Any:
    """Rows ``start:end`` of every tensor in a collated batch (the batch dimension is dim 0)."""
    if isinstance(value, torch.Tensor):
        return value[start:end] if value.dim() > 0 else value
    if isinstance(value, Mapping):
        return type(value)({key: _rows(item, start, end) for key, item in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_rows(item, start, end) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_rows(item, start, end) for item in value)
    return value


class _MicroBatches:
    """The private loader's logical batches, each cut into ``parts`` micro-batches of rows (sizes differ by at
    most one, the larger first; empty ones when the batch has fewer rows), each tagged with its slice of the
    draw's ticket, so that the step contract counts the ``parts`` backward passes as one draw."""

    def __init__(self, loader: DPDataLoader, parts: int) -> None:
        self.loader = loader
        self.parts = parts

    def __len__(self) -> int:
        return len(self.loader) * self.parts

    def state_dict(self) -> dict[str, Any]:
        """The private loader's sampling state (Lightning saves it with its loops: the loader is resumable)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` into the private loader."""
        self.loader.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            ticket = find_ticket(batch)
            size = _examples_in(batch) or 0
            start = 0
            for part in range(self.parts):
                end = start + size // self.parts + (1 if part < size % self.parts else 0)
                micro_batch = _rows(batch, start, end)
                if ticket is not None:
                    tag_batch(micro_batch, ticket.slice(start, end))
                yield micro_batch
                start = end


class _TrainingStepAsForward:
    """While active, calling the LightningModule (as the engine's wrapper does from its forward) runs its
    ``training_step``; a call from inside ``training_step`` (``self(x)``) runs the real ``forward``.

    Lightning's own forward redirection restores the real ``forward`` before ``training_step`` runs, so the
    wrapper's first-step independence check (which replays the wrapped module's forward on the batch and a
    sub-batch, ``capture.independence``) would call ``forward(batch, batch_idx)``. Here the replays run
    ``training_step`` too, so the check sees the user's loss as well as the layers. Calls after the first are
    those replays: ``log`` and ``log_dict`` do nothing during them (no metric is logged twice)."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self._inside = False
        self._calls = 0

    def __enter__(self) -> _TrainingStepAsForward:  # noqa: PYI034  (typing.Self needs Python 3.11)
        module = self.module
        self._own_forward = module.__dict__.get("forward")  # an instance attribute to put back, if any
        self._forward = module.forward
        module.forward = self._dispatch
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._own_forward is not None:
            self.module.forward = self._own_forward
        else:
            del self.module.forward

    def _dispatch(self, *args: Any, **kwargs: Any) -> Any:
        if self._inside:
            return self._forward(*args, **kwargs)
        self._inside = True
        replay = self._calls > 0
        self._calls += 1
        try:
            if not replay:
                return self.module.training_step(*args, **kwargs)
            self.module.log = self.module.log_dict = _log_nothing
            try:
                return self.module.training_step(*args, **kwargs)
            finally:
                del self.module.log, self.module.log_dict
        finally:
            self._inside = False


def _log_nothing(*args: Any, **kwargs: Any) -> None:
    return None


class _EpsilonLog(pl.Callback):
    """Logs ``"epsilon"`` (the strategy's ``get_epsilon()``) through the LightningModule's ``log``."""

    def __init__(self, strategy: DPStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.strategy.log_epsilon == "step" and self.strategy.private_optimizer is not None:
            pl_module.log("epsilon", self.strategy.get_epsilon(), on_step=True, on_epoch=False, prog_bar=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.strategy.log_epsilon == "epoch" and self.strategy.private_optimizer is not None:
            pl_module.log("epsilon", self.strategy.get_epsilon(), on_step=False, on_epoch=True, prog_bar=True)


class DPStrategy(SingleDeviceStrategy):
    """A single-device Lightning strategy that trains with DP-SGD: Poisson-sampled batches, per-example clipping,
    Gaussian noise, every step recorded with the engine's accountant (see the module docstring).

    Guarantee: after ``trainer.fit``, the parameters are ``(get_epsilon(), target_delta)``-DP with respect to
    adding or removing one example of the training loader's dataset, as computed by the engine's accountant over
    the releases actually made (one per optimizer step; with ``accumulate_grad_batches=k``, one per ``k``
    micro-batches, at sample rate ``k * batch_size / len(dataset)``), provided the training step computes each
    example's loss from that example alone and the settings refused below are not worked around. With
    ``target_epsilon``, the noise is calibrated so that the planned run (``epochs``, default the Trainer's
    ``max_epochs``, or the epochs ``max_steps`` spans) stays within it, and no release ever takes epsilon past
    ``max_epsilon`` (default ``target_epsilon``): training stops before such a step.

    ====================================  ==================================================
    case                                  behaviour
    ====================================  ==================================================
    empty Poisson batch (or micro-batch)  ``training_step`` not called; the step releases
                                          noise only
    ``training_step`` returns None on a   skipped: nothing released or recorded (with
    batch with examples                   accumulation: the logical batch's other
                                          micro-batches are released)
    a release would pass max_epsilon      not released, not recorded; ``should_stop`` set
    neither / both of noise_multiplier,   ``ValueError`` (at construction)
    target_epsilon
    ``noise_seed``                        reproducible noise and sampling (logged); none:
                                          OS entropy, never torch's global generator
    ``accumulate_grad_batches=k``         one logical batch of expected size ``k * B``,
                                          ``k`` micro-batches, one release
    precision not 32-true / 64-true /     ``ValueError`` naming it
    bf16-mixed
    gradient_clip_val, overfit_batches,   ``ValueError`` naming it (at ``fit``)
    reload_dataloaders_every_n_epochs,
    devices > 1, manual optimization,
    several optimizers
    IterableDataset / unsized dataset     ``TypeError`` naming the train loader's dataset
    a load with weights_only=False        ``ValueError``: checkpoints are read with
                                          ``weights_only=True`` only
    checkpoint from another run           ``CheckpointError`` naming the mismatch; nothing
    (accountant, noise plan, model)       restored
    a second ``fit`` with one strategy    ``RuntimeError``: build a new one and resume
    model that cannot be wrapped          the engine's error (e.g. BatchNorm: ``fix_module``)
    ====================================  ==================================================

    Args: noise_multiplier or target_epsilon; target_delta (the delta of the logged epsilon and of the budget);
    max_grad_norm (per-example clipping bound); epochs (the run ``target_epsilon`` is calibrated for; default
    from the Trainer); max_epsilon (a budget with ``noise_multiplier``; with ``target_epsilon`` it defaults to
    ``target_epsilon``); grad_sample_mode (default ``"auto"``, as ``make_private``: ghost for a CNN whose every
    layer has a sampler, hooks otherwise, the choice logged by ``privacy_engine.engine.mode_choice``; or
    ``"hooks"``/``"ghost"``); privacy_engine (default a new
    ``PrivacyEngine()``, whose accountant records the steps); noise_seed (an int for reproducible noise and
    sampling); log_epsilon (``"epoch"`` or ``"step"``); device (default: the Trainer accelerator's first
    device); private_options (any other keyword of ``make_private``).
    """

    strategy_name = "dp_single_device"

    def __init__(
        self,
        *,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float = 1e-5,
        max_grad_norm: float = 1.0,
        epochs: int | None = None,
        max_epsilon: float | None = None,
        grad_sample_mode: str = AUTO,
        privacy_engine: PrivacyEngine | None = None,
        noise_seed: int | None = None,
        log_epsilon: str = "epoch",
        device: str | torch.device | None = None,
        private_options: dict[str, Any] | None = None,
        **strategy_kwargs: Any,
    ) -> None:
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("DPStrategy needs exactly one of noise_multiplier and target_epsilon")
        if privacy_engine is not None and not isinstance(privacy_engine, PrivacyEngine):
            raise TypeError(f"privacy_engine must be a PrivacyEngine; got {type(privacy_engine).__name__}")
        if log_epsilon not in ("epoch", "step"):
            raise ValueError(f"log_epsilon must be 'epoch' or 'step'; got {log_epsilon!r}")
        if epochs is not None and target_epsilon is None:
            raise ValueError("DPStrategy: epochs is the run target_epsilon is calibrated for; give target_epsilon")
        check_noise_seed(noise_seed)
        options = dict(private_options or {})
        given_twice = {"noise_seed", "noise_generator"} & set(options)
        if noise_seed is not None and given_twice:
            raise ValueError("DPStrategy: give noise_seed either as an argument or in private_options, not both")
        engine = privacy_engine if privacy_engine is not None else PrivacyEngine()
        if noise_seed is not None and engine.secure_mode:
            raise ValueError(
                "DPStrategy: noise_seed with a secure-mode PrivacyEngine: secure mode draws the noise from the OS only. "
                "Drop noise_seed, or use PrivacyEngine(secure_mode=False) for a reproducible run."
            )
        reserved = {"module", "optimizer", "data_loader", "noise_multiplier", "target_epsilon", "target_delta",
                    "max_grad_norm", "epochs", "max_epsilon", "grad_sample_mode"} & set(options)  # fmt: skip
        if reserved:
            raise ValueError(f"DPStrategy: give {sorted(reserved)} as DPStrategy arguments, not in private_options")
        super().__init__(device="cpu" if device is None else device, **strategy_kwargs)
        self._device_given = device is not None
        self.privacy_engine = engine
        self.noise_multiplier = noise_multiplier
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self.max_grad_norm = max_grad_norm
        self.epochs = epochs
        self.max_epsilon = max_epsilon
        self.grad_sample_mode = grad_sample_mode
        self.noise_seed = noise_seed
        self.log_epsilon = log_epsilon
        self.private_options = options
        #: The engine's wrapper around the LightningModule, the DPOptimizer and the DPDataLoader (None before
        #: the training loader is made private).
        self.private_model: torch.nn.Module | None = None
        self.private_optimizer: DPOptimizer | None = None
        self.private_loader: DPDataLoader | None = None
        #: Whether training stopped because the next release would have passed the budget.
        self.budget_exhausted = False
        self._accumulate = 1
        self._skipped_by_training_step = False  # the current batch's training_step returned None (not an empty batch)
        self._pending_state: dict[str, Any] | None = None  # the engine's part of a loaded checkpoint
        self._checkpoint_name = "<lightning checkpoint>"
        self._fitted = False

    # ------------------------------------------------------------------ set-up and checks
    def setup_environment(self) -> None:
        """Lightning's; without ``device=``, the strategy's device is the accelerator's first one."""
        if not self._device_given and self.accelerator is not None:
            self._root_device = self.accelerator.get_parallel_devices(1)[0]
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        """Check the Trainer's settings (``ValueError`` naming the first one DP-SGD cannot honour), then
        Lightning's set-up; the private pieces are made when Lightning asks for the training loader."""
        if trainer.state.fn == "fit":
            if self._fitted:
                raise RuntimeError(
                    "DPStrategy: this strategy already trained once (its engine holds that run's ledger). Build a new "
                    "Trainer with a new DPStrategy, and pass ckpt_path= to continue from a checkpoint."
                )
            self._check_trainer(trainer)
            if not any(
                isinstance(callback, _EpsilonLog) and callback.strategy is self for callback in trainer.callbacks
            ):
                trainer.callbacks.append(_EpsilonLog(self))
        super().setup(trainer)

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        precision = getattr(self.precision_plugin, "precision", type(self.precision_plugin).__name__)
        refusals = [
            (trainer.num_devices != 1 or trainer.num_nodes != 1,
             (f"runs on one device in one process (devices={trainer.num_devices}, num_nodes={trainer.num_nodes}); "
              f"use privacy_engine.training.distributed for several processes")),
            (trainer.gradient_clip_val is not None,
             (f"gradient_clip_val={trainer.gradient_clip_val}: Lightning would clip the summed, un-noised gradient; "
              f"per-example clipping replaces it: set DPStrategy(max_grad_norm=...) and leave gradient_clip_val "
              f"unset")),
            (bool(trainer.overfit_batches),
             f"overfit_batches={trainer.overfit_batches} replaces the sampling the accountant records; set it to 0"),
            (trainer.reload_dataloaders_every_n_epochs > 0,
             (f"reload_dataloaders_every_n_epochs={trainer.reload_dataloaders_every_n_epochs}: the private loader "
              f"and optimizer are made once per fit; set it to 0")),
            (not trainer.lightning_module.automatic_optimization,
             ("manual optimization (automatic_optimization=False) is not supported: let Lightning call backward "
              "and step")),
            (type(self.precision_plugin) not in (Precision, DoublePrecision, MixedPrecision) or precision not in _PRECISIONS,
             (f"precision={precision!r} is not supported; use one of {', '.join(_PRECISIONS)} (bf16-mixed: autocast "
              f"forward, float32 clipping and noise)")),
            (trainer.accumulate_grad_batches > 1 and self.private_options.get("max_batch_size") is not None,
             "max_batch_size (truncated sampling) with accumulate_grad_batches > 1 is not supported; use one of them"),
        ]  # fmt: skip
        for refused, reason in refusals:
            if refused:
                raise ValueError(f"DPStrategy: {reason}.")
        self._accumulate = int(trainer.accumulate_grad_batches)

    # ------------------------------------------------------------------ the private pieces
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader made private (with the optimizer, at the first request of a ``fit``); other
        loaders unchanged."""
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return super().process_dataloader(dataloader)
        if self.private_loader is None:
            self._make_private(trainer, dataloader)
        if self._accumulate > 1:
            return _MicroBatches(self.private_loader, self._accumulate)
        return self.private_loader

    def _make_private(self, trainer: pl.Trainer, dataloader: object) -> None:
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                f"DPStrategy: the train dataloader is a {type(dataloader).__name__}; Poisson sampling needs a "
                f"torch.utils.data.DataLoader over a map-style dataset (return one from train_dataloader())"
            )
        if isinstance(dataloader.dataset, IterableDataset) or not hasattr(dataloader.dataset, "__len__"):
            raise TypeError(
                "DPStrategy: the train dataloader's dataset is iterable or has no __len__; Poisson sampling draws "
                "examples by index, so it needs a map-style dataset (with __len__ and __getitem__)"
            )
        if dataloader.batch_size is None:
            raise ValueError("DPStrategy: the train dataloader has no batch_size (a batch_sampler?); give batch_size=")
        if len(self.optimizers) != 1:
            raise ValueError(
                f"DPStrategy: configure_optimizers returned {len(self.optimizers)} optimizers; DP-SGD releases one "
                f"noised gradient per step from one optimizer: return one (with several parameter groups if needed)"
            )
        loader = dataloader
        if self._accumulate > 1:
            # One logical batch of k times the expected size, cut into k micro-batches (_MicroBatches).
            loader = DataLoader(
                dataloader.dataset, batch_size=dataloader.batch_size * self._accumulate,
                collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
                pin_memory=dataloader.pin_memory, generator=dataloader.generator,
            )  # fmt: skip
        options: dict[str, Any] = dict(
            module=self.lightning_module,
            optimizer=self.optimizers[0],
            data_loader=loader,
            max_grad_norm=self.max_grad_norm,
            grad_sample_mode=self.grad_sample_mode,
            **self.private_options,
            **self._seeding(),
        )
        if self.target_epsilon is not None:
            if self.max_epsilon is not None:
                options["max_epsilon"] = self.max_epsilon
            private = self.privacy_engine.make_private_with_epsilon(
                target_epsilon=self.target_epsilon, target_delta=self.target_delta,
                epochs=self._planned_epochs(trainer, loader), **options,
            )  # fmt: skip
        else:
            if self.max_epsilon is not None:
                options.update(max_epsilon=self.max_epsilon, target_delta=self.target_delta)
            private = self.privacy_engine.make_private(noise_multiplier=self.noise_multiplier, **options)
        self.private_model, optimizer, *_extra, self.private_loader = private
        self.private_optimizer = optimizer
        self._fitted = True
        # strategy.model stays the LightningModule (Lightning's train()/eval() and device moves act on it); only
        # training_step runs through the wrapper.
        self.optimizers = [optimizer]
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            restore_checkpoint(
                self.privacy_engine, state, name=self._checkpoint_name, module=self.lightning_module,
                optimizer=optimizer, data_loader=self.private_loader,
            )  # fmt: skip

    def _planned_epochs(self, trainer: pl.Trainer, loader: DataLoader) -> int:
        if self.epochs is not None:
            return self.epochs
        if trainer.max_steps is not None and trainer.max_steps > 0:
            # The private loader yields round(N / batch_size) logical batches an epoch: at least as many as the
            # plain loader's ceil(N / batch_size) minus one.
            return max(1, math.ceil(trainer.max_steps / max(1, len(loader) - 1)))
        if trainer.max_epochs is None or trainer.max_epochs < 1:
            raise ValueError(
                "DPStrategy: target_epsilon needs the length of the run: set Trainer(max_epochs=...) or "
                "DPStrategy(epochs=...)"
            )
        return int(trainer.max_epochs)

    def _seeding(self) -> dict[str, Any]:
        """The seeding ``make_private`` gets; logs where the noise comes from."""
        if self.noise_seed is not None:
            logger.warning(
                "DPStrategy: noise and sampling seeded from noise_seed=%d: the run is reproducible, and whoever knows "
                "the seed knows the noise",
                self.noise_seed,
            )
            # One generator for both, as make_private's noise_generator: the noise seed is one draw from it.
            return {"noise_generator": torch.Generator().manual_seed(self.noise_seed)}
        if {"noise_seed", "noise_generator"} & set(self.private_options) or self.privacy_engine.secure_mode:
            return {}
        # Not torch's global generator: seed_everything sets it to a known value.
        logger.info("DPStrategy: noise and sampling seeded from OS entropy (pass noise_seed= for a reproducible run)")
        return {"noise_generator": full_entropy_generator()}

    # ------------------------------------------------------------------ steps
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's training step, through the engine's wrapper; an empty batch runs nothing and returns None
        (the optimizer step that follows releases noise only, as accounted)."""
        batch = args[0] if args else kwargs.get("batch")
        if self.private_model is not None and _examples_in(batch) == 0:
            return None
        if self.budget_exhausted or self.private_model is None:
            return None if self.budget_exhausted else super().training_step(*args, **kwargs)
        # The wrapper's own training flag follows the module's (Lightning switches the module around validation).
        self.private_model.training = self.lightning_module.training
        with self.precision_plugin.train_step_context(), _TrainingStepAsForward(self.lightning_module):
            output = self.private_model(*args, **kwargs)
        self._skipped_by_training_step = output is None
        if self._accumulate == 1:
            return output
        # Lightning divides the loss by accumulate_grad_batches; each micro-batch's loss is already its mean over
        # its own examples (the wrapper undoes that mean per example), so the division would scale every example's
        # gradient by 1 / k before clipping: undone here, so that each example is clipped as in one logical batch.
        if isinstance(output, torch.Tensor):
            return output * self._accumulate
        if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            return {**output, "loss": output["loss"] * self._accumulate}
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``validation_step`` (not through the wrapper: nothing of it is released)."""
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``test_step`` (not through the wrapper)."""
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``predict_step`` (not through the wrapper)."""
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step (the DPOptimizer releases the step). A release the budget refuses is not
        made: the batch's clipped gradients are dropped and ``trainer.should_stop`` is set."""
        if self.budget_exhausted:
            closure()  # Lightning expects its closure to run; training_step returns None: nothing is computed
            return None
        # The closure (training_step and backward) runs first, so that a batch the training_step skipped (None)
        # is not stepped: the optimizer would refuse a step after a forward whose backward never ran. The
        # precision plugin still calls its hooks around the closure's result, in the same order.
        self._skipped_by_training_step = False  # set by this batch's training_step (not by an empty batch's)
        result = closure()
        if self._skipped_by_training_step and self._accumulate == 1:
            self.private_optimizer.discard_logical_step()
            return None
        try:
            return super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        except PrivacyBudgetExceeded as refusal:
            self.budget_exhausted = True
            self.private_optimizer.discard_logical_step()
            self.private_optimizer.zero_grad()
            self.lightning_module.trainer.should_stop = True
            logger.warning("DPStrategy: training stopped: %s", refusal)
            return None

    # ------------------------------------------------------------------ accounting
    def get_epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default ``target_delta``), from the engine's accountant."""
        return self.privacy_engine.get_epsilon(self.target_delta if delta is None else delta)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's save, with the engine's state (``PrivacyEngine.save_checkpoint``'s contents, plain data)
        under ``checkpoint["privacy_engine"]``; nothing written if that state holds anything else."""
        if self.private_optimizer is not None:
            state = build_checkpoint(
                self.privacy_engine, module=self.lightning_module, optimizer=self.private_optimizer,
                data_loader=self.private_loader,
            )  # fmt: skip
            check_plain(state, CHECKPOINT_KEY)
            # Its tensors share storage with Lightning's own "state_dict" and "optimizer_states": torch.save
            # writes each storage once, so the file does not grow by a second copy of the model.
            checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint with ``weights_only=True`` (``ValueError`` for ``False``: a checkpoint never needs
        to run code) and keep the engine's part, restored all or nothing once the private pieces exist."""
        if weights_only is False:
            raise ValueError(
                "DPStrategy reads checkpoints with weights_only=True only: unpickling with weights_only=False can run "
                "code from the file. Drop weights_only=False (a DPStrategy checkpoint holds plain data)."
            )
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=True)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != "fit":
            return checkpoint  # validate / test / predict: the model's weights only, as Lightning loads them
        if CHECKPOINT_KEY not in checkpoint:
            raise ValueError(
                f"checkpoint {checkpoint_path}: it holds no privacy_engine state (it was not saved by a DPStrategy "
                f"run), so training on from it would forget the privacy already spent. Resume from a checkpoint a "
                f"DPStrategy run saved."
            )
        # Restored (all or nothing) as soon as make_private has built the pieces it goes into.
        self._pending_state = checkpoint[CHECKPOINT_KEY]
        self._checkpoint_name = str(checkpoint_path)
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: the DPOptimizer's state travels in the engine's part of the checkpoint."""
