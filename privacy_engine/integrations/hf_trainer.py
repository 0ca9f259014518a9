"""Hugging Face ``Trainer`` with differential privacy: ``DPTrainer``.

A plain ``Trainer`` builds its own data loader (shuffled, fixed-size batches), its own optimizer, and clips the
summed gradient; DP-SGD's accounting assumes Poisson-sampled batches and per-example clipping. ``DPTrainer``
replaces exactly those pieces through ``PrivacyEngine.make_private`` (or ``make_private_with_epsilon``) and
leaves the rest of ``Trainer`` (collators, schedulers, evaluation, saving, callbacks) as it is:

- the training batches come from the engine's ``DPDataLoader`` (Poisson sampling with rate
  ``per_device_train_batch_size / len(train_dataset)``; batch sizes vary; an empty batch is a step that
  releases noise only, without a forward pass: Hugging Face models cannot run on zero examples);
- the optimizer ``Trainer`` would build (or the one passed in ``optimizers``) is wrapped in a
  ``DPOptimizer``: per-example clipping to ``max_grad_norm``, Gaussian noise, one accountant step per
  optimizer step;
- the model is wrapped (``GradSampleModule``, hooks or ghost mode); ``trainer.model`` stays the user's model
  (saving, evaluation and ``generate`` see no wrapper), ``trainer.private_model`` is the wrapper;
- every log line gets ``epsilon`` (at ``target_delta``); ``trainer.get_epsilon()`` gives it at any time;
- the training loss is per-example: each example's loss is normalised by its own labelled-token count and the
  batch loss is the mean over examples (``privacy_engine.integrations.hf_losses``, installed by the wrapper).
  Trainer's ``num_items_in_batch`` (a token count over the whole batch, which makes every example's gradient
  depend on the others' lengths) is never passed to the model;
- the noise and the Poisson sampling are seeded from the OS (a full-entropy generator) unless ``noise_seed`` is
  given: Trainer seeds torch's global generator with a public default (``seed=42``), which must not decide
  the noise. With ``noise_seed`` the run is reproducible and the noise is known to whoever knows the seed.

Refused when the sampling would not be the accounted one (``ValueError``, checked before ``Trainer`` is
built; an ``IterableDataset`` train set: ``TypeError`` at ``train()``, Poisson sampling needs indices):
``gradient_accumulation_steps > 1`` (several independently sampled batches in one step; set
``per_device_train_batch_size`` to the batch size you want instead), more than one process or device,
``resume_from_checkpoint`` (a Trainer checkpoint holds no accountant history), ``label_smoothing_factor > 0``
(Trainer's label smoother averages over every token of the batch, coupling examples; apply smoothing inside
a per-example loss instead). ``TrainingArguments.max_grad_norm``
is set to 0: Trainer's clipping of the summed gradient is replaced by per-example clipping, and the gradient
norm Trainer would log is that of the un-noised gradient, so it is not logged.

A ``compute_loss_func`` is called with ``num_items_in_batch=None`` and must return a per-example loss (each
example normalised by its own size, e.g. ``privacy_engine.losses.per_example_token_cross_entropy``): the
engine cannot check a function it does not know.

Not covered by the guarantee: the training loss Trainer logs (computed on each batch without noise), anything
a callback reads from ``.grad`` before the optimizer step, and evaluation metrics on private data.

Usage::

    trainer = DPTrainer(
        model=model, args=TrainingArguments(output_dir, per_device_train_batch_size=64, num_train_epochs=3),
        train_dataset=train, data_collator=collator,
        target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0,   # or noise_multiplier=1.1
    )
    trainer.train()
    print(trainer.get_epsilon())
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import transformers
from torch.utils.data import DataLoader, IterableDataset

from privacy_engine.engine import PrivacyEngine
from privacy_engine.engine.mode_choice import AUTO
from privacy_engine.noise.secure_random import full_entropy_generator
from privacy_engine.settings_checks import check_noise_seed

__all__ = ["DPTrainer"]

logger = logging.getLogger(__name__)


def _check_arguments(args: transformers.TrainingArguments) -> None:
    if args.gradient_accumulation_steps != 1:
        raise ValueError(
            f"DPTrainer: gradient_accumulation_steps={args.gradient_accumulation_steps} would sum that many "
            f"independently sampled batches into one step, which the accounting (one Poisson-sampled batch per "
            f"step) does not cover. Set per_device_train_batch_size to the expected batch size you want and "
            f"gradient_accumulation_steps=1."
        )
    if args.world_size > 1 or args.n_gpu > 1:
        raise ValueError(
            f"DPTrainer runs on one process and one device (world_size={args.world_size}, n_gpu={args.n_gpu}): "
            f"its private loader samples the whole dataset on each step. Use privacy_engine.training.distributed for "
            f"several processes."
        )
    if args.label_smoothing_factor != 0:
        raise ValueError(
            f"DPTrainer: label_smoothing_factor={args.label_smoothing_factor}: Trainer's label smoother averages the "
            f"smoothed loss over every token of the batch, so each example's gradient depends on the other examples' "
            f"lengths (per-example clipping no longer bounds its influence). Set label_smoothing_factor=0, or "
            f"smooth inside a per-example loss given as compute_loss_func."
        )


def _num_examples(inputs: Any) -> int | None:
    values = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, (list, tuple)) else [inputs]
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


class DPTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose training batches, optimizer and accounting are those of DP-SGD.

    Guarantee: after ``train()``, the released parameters are ``(get_epsilon(), target_delta)``-DP with
    respect to adding or removing one example of ``train_dataset`` (as computed by the engine's accountant
    over the steps actually taken), given the rest of the ``Trainer`` configuration is honoured as
    documented in the module docstring; with ``target_epsilon``, the noise is calibrated so that
    ``get_epsilon() <= target_epsilon`` over the planned epochs (``ceil(num_train_epochs)``, or the epochs
    ``max_steps`` spans).

    ====================================  ==================================================
    case                                  behaviour
    ====================================  ==================================================
    empty Poisson batch                   no forward; the step releases noise only
    ``optimizers=(opt, sched)`` given     ``opt`` is wrapped (its parameter groups kept)
    neither / both of noise_multiplier,   ``ValueError``
    target_epsilon
    model called with ``labels=``         per-example loss (own token count, mean over examples)
    ``num_items_in_batch`` from Trainer   not passed on (batch-wide count)
    no ``noise_seed``                     noise and sampling seeded from the OS (logged)
    ``noise_seed`` (or a seed or          reproducible noise (logged); ``noise_seed`` with a
    generator in ``private_options``)     secure-mode engine, or given twice: ``ValueError``
    label_smoothing_factor > 0            ``ValueError`` (the smoother couples examples)
    gradient_accumulation_steps > 1       ``ValueError`` (see the module docstring)
    several processes or devices          ``ValueError``
    IterableDataset train set             ``TypeError`` at ``train()``
    ``resume_from_checkpoint``            ``ValueError``
    model that cannot be wrapped          the engine's error (e.g. BatchNorm: ``fix_module``)
    ====================================  ==================================================

    Args (besides ``Trainer``'s): privacy_engine (default ``PrivacyEngine()``: its accountant records the
    steps), noise_multiplier or target_epsilon, target_delta, max_grad_norm (per-example clipping bound),
    grad_sample_mode (default ``"auto"``, as ``make_private``: ghost for a CNN whose every layer has a sampler,
    hooks otherwise, the choice logged by ``privacy_engine.engine.mode_choice``; or ``"hooks"``/``"ghost"``),
    noise_seed (an int for reproducible noise and sampling; ``None``: OS entropy, never Trainer's ``seed``), and
    any other keyword of ``PrivacyEngine.make_private`` in ``private_options``.
    """

    def __init__(
        self,
        model=None,
        args: transformers.TrainingArguments | None = None,
        *trainer_args: Any,
        privacy_engine: PrivacyEngine | None = None,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float = 1e-5,
        max_grad_norm: float = 1.0,
        grad_sample_mode: str = AUTO,
        noise_seed: int | None = None,
        private_options: dict[str, Any] | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("DPTrainer needs exactly one of noise_multiplier and target_epsilon")
        if privacy_engine is not None and not isinstance(privacy_engine, PrivacyEngine):
            raise TypeError(f"privacy_engine must be a PrivacyEngine; got {type(privacy_engine).__name__}")
        check_noise_seed(noise_seed)  # None: OS entropy (see _seeding)
        if noise_seed is not None and {"noise_seed", "noise_generator"} & set(private_options or {}):
            raise ValueError("DPTrainer: give noise_seed either as an argument or in private_options, not both")
        if noise_seed is not None and privacy_engine is not None and privacy_engine.secure_mode:
            raise ValueError(
                "DPTrainer: noise_seed with a secure-mode PrivacyEngine: secure mode draws the noise from the OS only. "
                "Drop noise_seed, or use PrivacyEngine(secure_mode=False) for a reproducible run."
            )
        if args is not None:
            _check_arguments(args)
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        _check_arguments(self.args)
        # Per-example clipping replaces Trainer's clipping of the summed gradient (whose norm, logged, would
        # also be a statistic of the un-noised gradient).
        self.args.max_grad_norm = 0.0
        self.privacy_engine = privacy_engine if privacy_engine is not None else PrivacyEngine()
        self.noise_multiplier = noise_multiplier
        self.target_epsilon = target_epsilon
        self.target_delta = target_delta
        self.max_grad_norm = max_grad_norm
        self.grad_sample_mode = grad_sample_mode
        self.private_options = dict(private_options or {})
        self.noise_seed = noise_seed
        self.private_model = None
        self._private_loader = None

    # ------------------------------------------------------------------ the private pieces
    def _make_private(self) -> None:
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("DPTrainer: training requires a train_dataset")
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "DPTrainer: the train_dataset is an IterableDataset; Poisson sampling draws examples by index, so "
                "it needs a map-style dataset (with __len__ and __getitem__)"
            )
        collator = self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        plain = DataLoader(
            dataset,
            batch_size=self._train_batch_size,
            collate_fn=collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        if self.optimizer is None:
            super().create_optimizer()  # Trainer's own choice (optimizer, learning rate, weight-decay groups)
        options = dict(
            module=self.model,
            optimizer=self.optimizer,
            data_loader=plain,
            max_grad_norm=self.max_grad_norm,
            grad_sample_mode=self.grad_sample_mode,
            **self.private_options,
            **self._seeding(),
        )
        if self.target_epsilon is not None:
            result = self.privacy_engine.make_private_with_epsilon(
                target_epsilon=self.target_epsilon,
                target_delta=self.target_delta,
                epochs=self._planned_epochs(len(plain)),
                **options,
            )
        else:
            result = self.privacy_engine.make_private(noise_multiplier=self.noise_multiplier, **options)
        # Three values in every mode; a PrivacyEngine subclass may return more between the optimizer and the
        # loader (as Opacus's ghost mode returns its criterion there): the trainer keeps its own loss.
        self.private_model, self.optimizer, *_extra, self._private_loader = result

    def _seeding(self) -> dict[str, Any]:
        """The seeding make_private gets on top of ``private_options``; logs where the noise comes from."""
        if self.noise_seed is not None:
            logger.warning(
                "DPTrainer: noise and sampling seeded from noise_seed=%d: the run is reproducible, and whoever knows "
                "the seed knows the noise",
                self.noise_seed,
            )
            # One generator for both, as make_private's noise_generator: the noise seed is one draw from it.
            return {"noise_generator": torch.Generator().manual_seed(self.noise_seed)}
        given = sorted({"noise_seed", "noise_generator"} & set(self.private_options))
        if given:
            logger.warning(
                "DPTrainer: noise seeded from private_options[%r]: reproducible, and whoever knows the seed knows "
                "the noise",
                given[0],
            )
            return {}
        if self.privacy_engine.secure_mode:
            logger.info("DPTrainer: secure-mode engine: noise and sampling drawn from OS entropy")
            return {}
        # Not torch's global generator: Trainer seeds it with args.seed (42 by default), a public value.
        logger.info("DPTrainer: noise and sampling seeded from OS entropy (pass noise_seed= for a reproducible run)")
        return {"noise_generator": full_entropy_generator()}

    def _planned_epochs(self, batches_per_epoch: int) -> int:
        if self.args.max_steps is not None and self.args.max_steps > 0:
            # The private loader yields round(N / batch_size) batches an epoch: at least as many as the plain
            # loader's ceil(N / batch_size) minus one, so this covers max_steps steps.
            return max(1, math.ceil(self.args.max_steps / max(1, batches_per_epoch - 1)))
        return max(1, math.ceil(self.args.num_train_epochs))

    def get_train_dataloader(self) -> DataLoader:
        """The engine's Poisson-sampling loader (built, with the private optimizer, at the first call)."""
        if self._private_loader is None:
            self._make_private()
        return self._private_loader

    def create_optimizer(self, model=None):
        """The ``DPOptimizer`` once the private loader is built, else Trainer's own optimizer."""
        if self._private_loader is not None:
            return self.optimizer  # the DPOptimizer built with the private loader
        return super().create_optimizer(model)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """Trainer's ``train``; ``resume_from_checkpoint`` raises ``ValueError``: a Trainer checkpoint
        holds no accountant history, so a resume would forget the privacy already spent."""
        if resume_from_checkpoint:
            raise ValueError(
                "DPTrainer cannot resume from a Trainer checkpoint: it holds no accountant history, so the "
                "privacy spent before it would be forgotten. Save and load the engine's state "
                "(PrivacyEngine.save_checkpoint) with your own loop instead."
            )
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ------------------------------------------------------------------ one step
    def training_step(self, model, inputs, num_items_in_batch=None):
        """One forward and backward through the private wrapper. ``num_items_in_batch`` is ignored (each
        example's loss must not depend on the others' lengths); an empty Poisson batch runs nothing and
        returns a zero loss (the optimizer step still releases noise, as accounted)."""
        if _num_examples(inputs) == 0:
            # An empty Poisson batch: nothing to run (HF models cannot take zero examples); the optimizer
            # step that follows releases noise only, as the accounting assumes.
            return torch.zeros((), device=self.args.device)
        self.private_model.train()
        # num_items_in_batch is the batch's labelled-token count: dividing by it would make each example's
        # gradient depend on the other examples' lengths. The wrapper's loss is per-example instead.
        return super().training_step(model, inputs, None)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """Trainer's loss; training forwards run through the private wrapper, per example."""
        # Training forwards go through the wrapper (per-sample gradients, per-example losses, batch
        # bookkeeping); evaluation forwards (no gradient) through the model Trainer passes.
        if self.private_model is not None and torch.is_grad_enabled() and model.training:
            model = self.private_model
            num_items_in_batch = None
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # the norm of the un-noised gradient is not private: not computed, not logged

    # ------------------------------------------------------------------ accounting
    def get_epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default ``target_delta``), from the engine's accountant."""
        return self.privacy_engine.get_epsilon(self.target_delta if delta is None else delta)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's ``log``, with ``epsilon`` (at ``target_delta``) added once training is private."""
        if self._private_loader is not None:
            logs["epsilon"] = self.get_epsilon()
        super().log(logs, start_time)
