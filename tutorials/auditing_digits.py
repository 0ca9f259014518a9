"""One-run privacy auditing of DP-SGD on scikit-learn's handwritten digits, at epsilon 1, 4 and 16.

    python tutorials/auditing_digits.py                 # epsilon in {1, 4, 16}, delta = 1e-5
    python tutorials/auditing_digits.py --epsilons 2 8 --canaries 2000
    python tutorials/auditing_digits.py --quick          # a reduced run (a few seconds; what the test runs)
    python tutorials/auditing_digits.py --kind input     # input canaries: examples appended to the data

Every run trains the digits MLP of ``dpsgd_digits.py`` with ``make_private_with_epsilon(...,
audit=AuditConfig(num_canaries=...))``: each of the canaries is included with probability 1/2 and, when
included, adds a unit direction scaled to the clip norm to the clipped sum before the noise, at every step it
is Poisson-sampled in, as one more example would. After training, ``engine.audit_report()`` scores the
canaries against what was released and turns the scores into an epsilon lower bound (Steinke, Nasr, Jagielski
2023) at 95 % confidence. The accountant's epsilon is an upper bound: the audit must stay below it (a bound
near it would mean a bug, and ``audit_report`` warns), and it should rise with epsilon.

With ``--kind input`` the canaries are examples instead (``AuditConfig(kind="input", num_classes=10)``): each
an ``N(0, 1)`` input of the digits' 64 features with a uniformly random label, included with probability 1/2
in the dataset the private loader samples (so the dataset, and the sample rate ``batch_size / (n + k)``,
grow with the ``k`` included), scored after training by ``-loss`` of the model on it. They are sampled,
clipped and noised as the real examples are; the bound is weaker (a canary's loss says less than its gradient
direction does), and the canaries take a share of each batch.

What to expect: one-run auditing with canaries in one training run is far from tight; the lower bound is a
small fraction of the claim. Gradient canaries cost one extra matrix-vector product per step (scoring) and
change no privacy loss of the real examples (they are data-independent and counted nowhere).
"""

from __future__ import annotations

import argparse
import time

import torch
from dpsgd_digits import accuracy, load_data, make_model  # the same model and data (run from tutorials/)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from accountants import make_accountant
from privacy_engine.auditing import AuditConfig, AuditReport
from privacy_engine.engine import PrivacyEngine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 16.0], help="target epsilons")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta")
    parser.add_argument(
        "--canaries", type=int, default=None,
        help="canaries per run (half included); default 3000 gradient, 500 input canaries (appended examples)",
    )  # fmt: skip
    parser.add_argument(
        "--kind", choices=["gradient", "input"], default="gradient",
        help="gradient canaries (added to the clipped sums) or input canaries (appended examples)",
    )  # fmt: skip
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=384, help="expected (Poisson) batch size")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-example clipping bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 epochs, 200 canaries, epsilons 4 and 16")
    args = parser.parse_args(argv)
    if args.canaries is None:
        args.canaries = 3000 if args.kind == "gradient" else 500
    if args.quick:
        args.epochs, args.canaries, args.epsilons = 2, 200, [4.0, 16.0]
    return args


def audit_config(args: argparse.Namespace) -> AuditConfig:
    """Gradient canaries, or input canaries labelled uniformly over the 10 digits."""
    if args.kind == "input":
        return AuditConfig(num_canaries=args.canaries, kind="input", num_classes=10)
    return AuditConfig(num_canaries=args.canaries)


def audited_run(args: argparse.Namespace, epsilon: float, train: TensorDataset,
                test: TensorDataset) -> tuple[AuditReport, float]:  # fmt: skip
    """Train at ``epsilon`` with canaries; (the audit report, test accuracy)."""
    torch.manual_seed(args.seed)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=1e-3))
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=epsilon, target_delta=args.delta,
        epochs=args.epochs, max_grad_norm=args.max_grad_norm, noise_generator=torch.Generator().manual_seed(args.seed),
        audit=audit_config(args),
    )  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    progress = tqdm(total=args.epochs * len(loader), desc=f"epsilon {epsilon:g}", unit="step", leave=False)
    for _ in range(args.epochs):
        for features, labels in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(features), labels)
            loss.backward()
            optimizer.step()
            progress.update()
            progress.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    progress.close()
    return engine.audit_report(), accuracy(model, test)


def main(argv: list[str] | None = None) -> list[AuditReport]:
    args = parse_args(argv)
    torch.set_num_threads(1)  # a 64-64-10 MLP gains nothing from threads
    start = time.perf_counter()
    train, test = load_data(args.seed, 3.0)
    print(f"digits: {len(train)} training examples; {args.canaries} {args.kind} canaries per run, "
          f"{args.epochs} epochs, expected batch {args.batch_size}, delta {args.delta:g}")  # fmt: skip
    reports, accuracies = [], []
    for epsilon in args.epsilons:
        report, test_accuracy = audited_run(args, epsilon, train, test)
        reports.append(report)
        accuracies.append(test_accuracy)
    print()
    print(f"{'target eps':>10} {'accountant eps':>14} {'lower bound (95%)':>17} {'GDP variant':>11} "
          f"{'ratio':>6} {'steps':>5} {'test acc.':>9}")  # fmt: skip
    for epsilon, report, test_accuracy in zip(args.epsilons, reports, accuracies):
        print(f"{epsilon:>10g} {report.claimed_epsilon:>14.3f} {report.epsilon_lower_bound:>17.3f} "
              f"{report.gdp_epsilon_lower_bound:>11.3f} {report.epsilon_lower_bound / report.claimed_epsilon:>6.3f} "
              f"{report.steps:>5d} {test_accuracy:>9.2%}")  # fmt: skip
    print("\nlower bound: one-run epsilon-DP bound (Steinke et al. 2023), valid for any mechanism; GDP variant: the")
    print("f-DP test's epsilon, a bound only for Gaussian privacy curves (shown, not compared).")
    print(f"total time {time.perf_counter() - start:.1f} s")
    return reports


if __name__ == "__main__":
    main()
