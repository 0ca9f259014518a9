"""DP-SGD with PyTorch Lightning on scikit-learn's handwritten digits: an ordinary LightningModule, made
private by one line (the Trainer's strategy).

    python tutorials/lightning_digits.py             # epsilon = 3, delta = 1e-5, 15 epochs (about a minute)
    python tutorials/lightning_digits.py --quick     # 2 epochs (what the test runs)

The model, data and hyper-parameters are those of ``dpsgd_digits.py`` (a 64-64-10 MLP on standardised
pixels, 80 % of the 1,797 digits for training): nothing is downloaded. ``DPStrategy`` replaces the
module's ``train_dataloader()`` by Poisson sampling, wraps ``configure_optimizers()``'s SGD in a DP
optimizer whose noise is calibrated so that the planned epochs stay within (epsilon, delta), logs epsilon
every epoch (printed below, one line an epoch) and stops before any step that would pass the budget. The
validation metric is computed on the held-out split without noise: it is not part of the private release.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import lightning.pytorch as pl
import torch
from dpsgd_digits import load_data, make_model  # the same model and data (run from tutorials/)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accountants import make_accountant
from privacy_engine.engine import PrivacyEngine
from privacy_engine.integrations.lightning import DPStrategy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilon", type=float, default=3.0, help="target epsilon of the whole run")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=384, help="expected (Poisson) batch size")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-example clipping bound")
    parser.add_argument("--feature-clip", type=float, default=3.0, help="clip standardised features to +-this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 epochs: a reduced run")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = 2
    return args


class DigitsClassifier(pl.LightningModule):
    """A plain LightningModule: nothing here is about privacy."""

    def __init__(self, train: TensorDataset, test: TensorDataset, args: argparse.Namespace) -> None:
        super().__init__()
        self.model = make_model()
        self.train_set, self.test_set, self.args = train, test, args

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)

    def training_step(self, batch, batch_idx):
        features, labels = batch
        loss = nn.functional.cross_entropy(self(features), labels)
        self.log("train_loss", loss, prog_bar=True)  # computed without noise: not part of the private release
        return loss

    def validation_step(self, batch, batch_idx):
        features, labels = batch
        self.log("test_accuracy", (self(features).argmax(dim=1) == labels).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.args.lr, momentum=self.args.momentum)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.args.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.test_set, batch_size=len(self.test_set))


class PrintEpochs(pl.Callback):
    """One line per epoch: the held-out accuracy and the epsilon spent so far."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        epsilon = trainer.strategy.get_epsilon()
        print(f"epoch {trainer.current_epoch + 1:>2}: test accuracy {float(metrics['test_accuracy']):.2%}, "
              f"epsilon {epsilon:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(1)  # a 64-64-10 MLP gains nothing from threads
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)  # keep the output to what a person wants to see
    start = time.perf_counter()
    pl.seed_everything(args.seed, verbose=False)  # the model's initialisation (never the noise: see below)
    train, test = load_data(args.seed, args.feature_clip)
    print(f"digits: {len(train)} training and {len(test)} test examples, 64 features, 10 classes")
    module = DigitsClassifier(train, test, args)
    strategy = DPStrategy(
        target_epsilon=args.epsilon, target_delta=args.delta, max_grad_norm=args.max_grad_norm,
        # A PLD grid of 1e-3 instead of 1e-4: epsilon ~10x faster to compute every epoch, at most ~0.5 % higher.
        privacy_engine=PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=1e-3)),
        noise_seed=args.seed,  # reproducible noise and batches; leave it out for OS entropy
    )  # fmt: skip
    trainer = pl.Trainer(
        max_epochs=args.epochs, strategy=strategy,  # the one line that makes training private
        logger=False, enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_progress_bar=False, callbacks=[PrintEpochs()],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
        trainer.fit(module)
    accuracy = float(trainer.callback_metrics["test_accuracy"])
    epsilon = strategy.get_epsilon()
    optimizer = strategy.private_optimizer
    print()
    print(f"DP-SGD with Lightning: test accuracy {accuracy:.2%}, (epsilon, delta) = ({epsilon:.2f}, {args.delta:g})")
    print(
        f"{optimizer.steps_taken} steps, expected batch {args.batch_size}, noise multiplier "
        f"{optimizer.noise_multiplier:.3f}, clip norm {args.max_grad_norm}, lr {args.lr}, momentum {args.momentum}, "
        f"PLD accounting; total time {time.perf_counter() - start:.1f} s"
    )
    return {"accuracy": accuracy, "epsilon": epsilon, "target_epsilon": args.epsilon}


if __name__ == "__main__":
    main()
