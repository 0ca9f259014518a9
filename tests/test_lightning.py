"""PyTorch Lightning: ``privacy_engine.integrations.lightning.DPStrategy`` against the plain engine loop.

Each behaviour is checked against an independent reference: the engine's own loop (``make_private`` and a
``for`` loop) on the same seeds, so on the same Poisson batches and the same noise, and dp-accounting's
accountant on the event the run should have recorded. The ``LightningModule`` is an ordinary one: the only
change for DP is ``Trainer(strategy=DPStrategy(...))``.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from dp_accounting import dp_event, rdp

from privacy_engine.engine import PrivacyEngine
from privacy_engine.integrations.lightning import CHECKPOINT_KEY, DPStrategy

EXAMPLES, FEATURES, CLASSES = 48, 6, 3
LR, CLIP, DELTA = 0.5, 0.7, 1e-5


def _dataset(dtype: torch.dtype) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(EXAMPLES, FEATURES, generator=generator, dtype=torch.float64).to(dtype)
    return TensorDataset(features, torch.randint(0, CLASSES, (EXAMPLES,), generator=generator))


def _net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES)).to(dtype)


class Classifier(pl.LightningModule):
    """An ordinary LightningModule: nothing in it knows about DP."""

    def __init__(self, *, batch_size: int = 8, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.net = _net(dtype)
        self.data = _dataset(dtype)
        self.batch_size = batch_size

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)

    def training_step(self, batch, batch_idx):
        features, labels = batch
        loss = nn.functional.cross_entropy(self(features), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def _trainer(strategy: DPStrategy, **settings) -> pl.Trainer:
    options = {"max_epochs": 2, "strategy": strategy, "enable_progress_bar": False, "logger": False,
               "enable_model_summary": False, "enable_checkpointing": False, "num_sanity_val_steps": 0}  # fmt: skip
    options.update(settings)
    return pl.Trainer(**options)


def _strategy(**settings) -> DPStrategy:
    options = {
        "noise_multiplier": 1.0,
        "max_grad_norm": CLIP,
        "noise_seed": 7,
        "privacy_engine": PrivacyEngine(accountant="rdp"),
    }
    options.update(settings)
    return DPStrategy(**options)


def _engine_loop(epochs: int, *, noise_multiplier: float, batch_size: int = 8, dtype=torch.float64,
                 autocast: bool = False, grad_sample_mode: str = "hooks", max_steps: int | None = None):  # fmt: skip
    """The reference: the engine's own loop on the same seeds (same batches, same noise)."""
    net = _net(dtype)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR),
        data_loader=DataLoader(_dataset(dtype), batch_size=batch_size), noise_multiplier=noise_multiplier,
        max_grad_norm=CLIP, grad_sample_mode=grad_sample_mode, noise_generator=torch.Generator().manual_seed(7),
    )  # fmt: skip
    empty_batches = 0
    for _ in range(epochs):
        for features, labels in loader:
            if max_steps is not None and optimizer.steps_taken == max_steps:
                break
            optimizer.zero_grad()
            if len(features) == 0:
                empty_batches += 1  # the strategy skips training_step; the step releases noise alone
            else:
                context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
                with context:
                    loss = nn.functional.cross_entropy(model(features), labels)
                loss.backward()
            optimizer.step()
    return net, engine, loader, empty_batches


def _dp_sgd_epsilon(sample_rate: float, noise_multiplier: float, steps: int) -> float:
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(noise_multiplier)), steps)
    return accountant.get_epsilon(DELTA)


def _assert_same_parameters(module: Classifier, reference: nn.Module) -> None:
    for (name, mine), theirs in zip(module.net.named_parameters(), reference.parameters()):
        assert torch.equal(mine, theirs), name


# ---------------------------------------------------------------------------------------- the same run
@pytest.mark.parametrize("noise_multiplier", [0.0, 1.0], ids=["noise-off", "noise-on"])
def test_parameters_equal_the_plain_engine_loop_on_the_same_batches(noise_multiplier: float) -> None:
    # Batch size 2 of 48: 24 steps, about one batch in 8 empty (the strategy then skips training_step).
    module = Classifier(batch_size=2)
    strategy = _strategy(noise_multiplier=noise_multiplier)
    _trainer(strategy, max_epochs=1).fit(module)
    reference, engine, loader, empty_batches = _engine_loop(1, noise_multiplier=noise_multiplier, batch_size=2)
    assert empty_batches > 0  # the run exercises empty Poisson batches
    _assert_same_parameters(module, reference)
    assert strategy.private_optimizer.steps_taken == len(loader) == engine.accountant.steps
    assert strategy.privacy_engine.accountant.history == engine.accountant.history


class SkippingClassifier(Classifier):
    """Returns None (Lightning's skip) from ``training_step`` on every third batch."""

    def training_step(self, batch, batch_idx):
        features, _ = batch
        if batch_idx % 3 == 1:
            self(features)  # looked at (a NaN check, say), then skipped
            return None
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_batch_the_training_step_skips_is_not_released_nor_counted(mode: str) -> None:
    module = SkippingClassifier(batch_size=4)
    strategy = _strategy(grad_sample_mode=mode)
    _trainer(strategy, max_epochs=1).fit(module)
    # The reference: the engine's loop on the same batches, leaving out step() where the training step skips.
    net = _net(torch.float64)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR),
        data_loader=DataLoader(_dataset(torch.float64), batch_size=4), noise_multiplier=1.0, max_grad_norm=CLIP,
        grad_sample_mode=mode, noise_generator=torch.Generator().manual_seed(7),
    )  # fmt: skip
    skipped = 0
    for index, (features, labels) in enumerate(loader):
        optimizer.zero_grad()
        if index % 3 == 1 and len(features) > 0:
            skipped += 1
            continue
        if len(features) > 0:
            nn.functional.cross_entropy(model(features), labels).backward()
        optimizer.step()
    assert skipped > 0
    _assert_same_parameters(module, net)
    assert strategy.private_optimizer.steps_taken == len(loader) - skipped == engine.accountant.steps


def test_a_datamodules_train_dataloader_is_made_private_the_same_way() -> None:
    class Digits(pl.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(_dataset(torch.float64), batch_size=8)

    module = Classifier(batch_size=2)  # its own loader (batch 2) is not the one Lightning uses: the datamodule's is
    strategy = _strategy()
    _trainer(strategy, max_epochs=1).fit(module, datamodule=Digits())
    reference, engine, *_ = _engine_loop(1, noise_multiplier=1.0)
    _assert_same_parameters(module, reference)
    assert strategy.privacy_engine.accountant.history == engine.accountant.history


def test_ghost_mode_equals_the_plain_engine_loop() -> None:
    module = Classifier()
    _trainer(_strategy(grad_sample_mode="ghost"), max_epochs=1).fit(module)
    reference, *_ = _engine_loop(1, noise_multiplier=1.0, grad_sample_mode="ghost")
    _assert_same_parameters(module, reference)


def _small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, CLASSES)
    ).double()


class ImageClassifier(Classifier):
    """A LightningModule with a trainable convolution: ``make_private``'s ``"auto"`` picks ghost for it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _small_cnn()
        generator = torch.Generator().manual_seed(2)
        images = torch.randn(EXAMPLES, 1, 6, 6, generator=generator, dtype=torch.float64)
        self.data = TensorDataset(images, torch.randint(0, CLASSES, (EXAMPLES,), generator=generator))


@pytest.mark.parametrize("named", [None, "hooks"], ids=["default", "hooks-named"])
def test_default_mode_is_make_privates_auto_choice(named: str | None) -> None:
    from privacy_engine import GhostClippingModule

    module = ImageClassifier()
    strategy = _strategy(**({} if named is None else {"grad_sample_mode": named}))
    _trainer(strategy, max_epochs=1).fit(module)
    # The reference: make_private on the same network with grad_sample_mode not given (its default) or named.
    net = _small_cnn()
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR),
        data_loader=DataLoader(module.data, batch_size=8), noise_multiplier=1.0, max_grad_norm=CLIP,
        noise_generator=torch.Generator().manual_seed(7), **({} if named is None else {"grad_sample_mode": named}),
    )  # fmt: skip
    assert isinstance(strategy.private_model, GhostClippingModule) == (named is None)
    assert isinstance(model, GhostClippingModule) == (named is None)
    for features, labels in loader:
        optimizer.zero_grad()
        if len(features):
            nn.functional.cross_entropy(model(features), labels).backward()
        optimizer.step()
    _assert_same_parameters(module, net)


def test_default_mode_on_a_model_without_convolutions_is_hooks() -> None:
    from privacy_engine import GhostClippingModule, GradSampleModule

    strategy = _strategy()
    _trainer(strategy, max_epochs=1, max_steps=1).fit(Classifier())
    assert isinstance(strategy.private_model, GradSampleModule)
    assert not isinstance(strategy.private_model, GhostClippingModule)


# ---------------------------------------------------------------------------------------- accounting
def test_epsilon_is_logged_each_epoch_and_equals_dp_accounting(tmp_path) -> None:
    strategy = _strategy()
    trainer = _trainer(strategy, max_epochs=3, logger=pl.loggers.CSVLogger(tmp_path, name="run"))
    trainer.fit(Classifier())
    steps_per_epoch = len(strategy.private_loader)
    expected = [_dp_sgd_epsilon(8 / EXAMPLES, 1.0, steps_per_epoch * epoch) for epoch in (1, 2, 3)]
    assert _logged_epsilons(trainer) == pytest.approx(expected, rel=1e-6)  # logged as float32
    assert strategy.get_epsilon() == pytest.approx(expected[-1], rel=1e-9)
    assert strategy.get_epsilon() == strategy.privacy_engine.get_epsilon(DELTA)
    assert trainer.callback_metrics["epsilon"].item() == pytest.approx(expected[-1], rel=1e-6)


@pytest.mark.slow
def test_epsilon_is_logged_each_step_with_log_epsilon_step(tmp_path) -> None:
    strategy = _strategy(log_epsilon="step")
    trainer = _trainer(strategy, logger=pl.loggers.CSVLogger(tmp_path, name="run"), log_every_n_steps=1)
    trainer.fit(Classifier())
    steps = strategy.private_optimizer.steps_taken
    expected = [_dp_sgd_epsilon(8 / EXAMPLES, 1.0, step) for step in range(1, steps + 1)]
    assert _logged_epsilons(trainer) == pytest.approx(expected, rel=1e-6)


def _logged_epsilons(trainer: pl.Trainer) -> list[float]:
    with open(Path(trainer.logger.log_dir, "metrics.csv")) as file:
        return [float(row["epsilon"]) for row in csv.DictReader(file) if row.get("epsilon")]


def test_training_stops_before_the_step_that_would_pass_the_budget() -> None:
    sample_rate = 8 / EXAMPLES
    fitting = 9  # steps that fit: max_epsilon between the epsilon of 9 steps and that of 10
    max_epsilon = (_dp_sgd_epsilon(sample_rate, 1.0, fitting) + _dp_sgd_epsilon(sample_rate, 1.0, fitting + 1)) / 2
    module = Classifier()
    strategy = _strategy(max_epsilon=max_epsilon, target_delta=DELTA)
    trainer = _trainer(strategy, max_epochs=10)
    trainer.fit(module)
    assert strategy.budget_exhausted and trainer.should_stop
    assert strategy.private_optimizer.steps_taken == strategy.privacy_engine.accountant.steps == fitting
    assert strategy.get_epsilon() == pytest.approx(_dp_sgd_epsilon(sample_rate, 1.0, fitting), rel=1e-9)
    assert strategy.get_epsilon() <= max_epsilon
    # The parameters are those of the 9 released steps: the refused batch changed nothing.
    reference, *_ = _engine_loop(10, noise_multiplier=1.0, max_steps=fitting)
    _assert_same_parameters(module, reference)


@pytest.mark.slow
def test_target_epsilon_calibrates_for_the_trainers_epochs_and_holds() -> None:
    strategy = DPStrategy(target_epsilon=4.0, target_delta=DELTA, max_grad_norm=CLIP, noise_seed=3,
                          privacy_engine=PrivacyEngine(accountant="rdp"))  # fmt: skip
    _trainer(strategy, max_epochs=3).fit(Classifier())
    steps = strategy.private_optimizer.steps_taken
    assert steps == 3 * len(strategy.private_loader) and not strategy.budget_exhausted
    sigma = strategy.private_optimizer.noise_multiplier
    assert 3.5 < _dp_sgd_epsilon(8 / EXAMPLES, sigma, steps) == pytest.approx(strategy.get_epsilon(), rel=1e-9)
    assert strategy.get_epsilon() <= 4.0


# ---------------------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("mode", ["hooks", pytest.param("ghost", marks=pytest.mark.slow)])
def test_accumulated_batches_form_one_logical_batch_accounted_as_one_step(mode: str) -> None:
    module = Classifier(batch_size=4)
    strategy = _strategy(grad_sample_mode=mode)
    trainer = _trainer(strategy, accumulate_grad_batches=2)
    trainer.fit(module)
    # One Poisson batch at rate 2 * 4 / 48, cut into 2 micro-batches: the reference takes it whole.
    reference, engine, loader, _ = _engine_loop(2, noise_multiplier=1.0, batch_size=8, grad_sample_mode=mode)
    assert strategy.private_loader.sample_rate == pytest.approx(8 / EXAMPLES)
    assert trainer.num_training_batches == 2 * len(loader)
    assert strategy.private_optimizer.steps_taken == trainer.global_step == 2 * len(loader)
    assert strategy.privacy_engine.accountant.history == engine.accountant.history
    assert strategy.get_epsilon() == pytest.approx(_dp_sgd_epsilon(8 / EXAMPLES, 1.0, 2 * len(loader)), rel=1e-9)
    for (name, mine), theirs in zip(module.net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14, msg=name)  # summation order differs


# ---------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    "save_every",
    ["epoch", pytest.param("steps", marks=pytest.mark.slow), pytest.param("steps-accumulated", marks=pytest.mark.slow)],
)
def test_resume_from_a_lightning_checkpoint_is_bit_identical(tmp_path, save_every: str) -> None:
    # "steps": saved after step 4 of the 6 an epoch (mid-epoch); "-accumulated": 2 micro-batches a step.
    saving = {"every_n_epochs": 1} if save_every == "epoch" else {"every_n_train_steps": 4}
    callback = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, **saving)
    accumulation = {"accumulate_grad_batches": 2} if save_every == "steps-accumulated" else {}
    batch_size = 4 if accumulation else 8
    uninterrupted = Classifier(batch_size=batch_size)
    first = _strategy()
    _trainer(first, max_epochs=3, enable_checkpointing=True, callbacks=[callback], **accumulation).fit(uninterrupted)

    # The first checkpoint: ModelCheckpoint names them "epoch=E-step=S.ckpt".
    checkpoint = min(tmp_path.glob("*.ckpt"), key=lambda path: int(path.stem.rsplit("step=", 1)[1]))
    assert checkpoint.stem.endswith("step=6" if save_every == "epoch" else "step=4")
    saved = torch.load(checkpoint, weights_only=True)  # plain data: loads without running code
    assert CHECKPOINT_KEY in saved
    resumed = Classifier(batch_size=batch_size)
    second = _strategy(noise_seed=99)  # the saved generators, not this seed, decide the rest of the run
    _trainer(second, max_epochs=3, **accumulation).fit(resumed, ckpt_path=checkpoint)

    for (name, mine), theirs in zip(resumed.named_parameters(), uninterrupted.parameters()):
        assert torch.equal(mine, theirs), name
    assert second.privacy_engine.accountant.history == first.privacy_engine.accountant.history
    assert second.get_epsilon() == first.get_epsilon()


def test_a_checkpoint_without_the_engines_state_is_refused(tmp_path) -> None:
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)  # fmt: skip
    trainer.fit(Classifier())
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="no privacy_engine state"):
        _trainer(_strategy()).fit(Classifier(), ckpt_path=tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="weights_only=True only"):
        _strategy().load_checkpoint(tmp_path / "plain.ckpt", weights_only=False)


# ---------------------------------------------------------------------------------------- precision
def test_bf16_mixed_equals_the_engine_loop_under_autocast_and_releases_float32() -> None:
    released_dtypes = set()

    class RecordReleases(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.strategy.private_optimizer.attach_step_hook(
                lambda optimizer: released_dtypes.update(p.grad.dtype for p in optimizer.clipper.params)
            )

    module = Classifier(dtype=torch.float32)
    _trainer(_strategy(), max_epochs=1, precision="bf16-mixed", callbacks=[RecordReleases()]).fit(module)
    reference, *_ = _engine_loop(1, noise_multiplier=1.0, dtype=torch.float32, autocast=True)
    _assert_same_parameters(module, reference)
    assert released_dtypes == {torch.float32}
    assert all(p.dtype == torch.float32 for p in module.parameters())


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"gradient_clip_val": 1.0}, "gradient_clip_val"),
        ({"precision": "bf16-true"}, "precision='bf16-true'"),
        ({"overfit_batches": 2}, "overfit_batches"),
        ({"reload_dataloaders_every_n_epochs": 1}, "reload_dataloaders_every_n_epochs"),
    ],
    ids=["gradient_clip_val", "bf16-true", "overfit_batches", "reload_dataloaders"],
)
def test_settings_the_accounting_does_not_cover_are_refused_before_training(settings, match) -> None:
    module = Classifier()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=match):
        _trainer(_strategy(), **settings).fit(module)
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))


def test_strategy_arguments_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        DPStrategy(max_grad_norm=1.0)
    with pytest.raises(ValueError, match="private_options"):
        DPStrategy(noise_multiplier=1.0, private_options={"max_grad_norm": 2.0})
    with pytest.raises(ValueError, match="secure"):
        DPStrategy(noise_multiplier=1.0, noise_seed=1, privacy_engine=PrivacyEngine(secure_mode=True))


# ---------------------------------------------------------------------------------------- Opacus's pattern
class OpacusStyleClassifier(Classifier):
    """Opacus's examples/mnist_lightning.py: make_private inside configure_optimizers, on the Trainer's loader."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        self.trainer.fit_loop.setup_data()
        self.private = PrivacyEngine().make_private(
            module=self, optimizer=optimizer, data_loader=self.trainer.train_dataloader, noise_multiplier=1.0,
            max_grad_norm=CLIP,
        )  # fmt: skip
        return self.private[1]


def test_opacus_lightning_pattern_is_refused_with_a_pointer_to_the_strategy() -> None:
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"privacy_engine\.integrations\.lightning\.DPStrategy"):
        trainer.fit(OpacusStyleClassifier())


# ---------------------------------------------------------------------------------------- the tutorial
def _tutorial():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tutorials"))
    try:
        return importlib.import_module("lightning_digits")
    finally:
        sys.path.pop(0)


def test_the_lightning_tutorial_runs_in_its_quick_mode(capsys) -> None:
    result = _tutorial().main(["--quick"])
    assert math.isfinite(result["epsilon"]) and 0 < result["epsilon"] <= result["target_epsilon"]
    assert 0.0 <= result["accuracy"] <= 1.0
    out = capsys.readouterr().out
    assert "epsilon" in out and "test accuracy" in out


@pytest.mark.slow
def test_the_lightning_tutorial_full_run_learns_within_its_budget(capsys) -> None:
    result = _tutorial().main([])
    assert result["epsilon"] <= result["target_epsilon"]
    assert result["accuracy"] > 0.8
