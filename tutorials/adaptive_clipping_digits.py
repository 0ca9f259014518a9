"""Adaptive clipping against a tuned fixed clip norm, on the digits model, at the same epsilon.

    python tutorials/adaptive_clipping_digits.py              # epsilon = 3, seeds 0-2
    python tutorials/adaptive_clipping_digits.py --epsilon 1 --seeds 5

The model, data and DP-SGD hyper-parameters are those of ``dpsgd_digits.py`` (whose fixed clip norm, 1.0,
was tuned on the test split). The adaptive run starts from a clip norm ten times smaller (0.1, untuned) and
lets it track the median per-example norm (Andrew et al. 2021: gamma 0.5, eta 0.2, sigma_b = batch / 20).
Both runs calibrate their noise multiplier for the same (epsilon, delta) over the same steps: adaptive
clipping's count of unclipped examples is paid for inside that sigma (the gradient gets sigma_delta > sigma).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from dpsgd_digits import accuracy, load_data, make_model  # the same model and data (run from tutorials/)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from accountants import make_accountant
from privacy_engine.engine import PrivacyEngine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=384)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--fixed-clip", type=float, default=1.0, help="the tuned fixed clip norm")
    parser.add_argument("--initial-clip", type=float, default=0.1, help="adaptive clipping's starting clip norm")
    parser.add_argument("--seeds", type=int, default=3)
    return parser.parse_args()


def train(args: argparse.Namespace, train_data: TensorDataset, seed: int, adaptive: bool) -> tuple[nn.Module, float, list]:
    torch.manual_seed(seed)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = DataLoader(train_data, batch_size=args.batch_size, shuffle=True)
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=1e-3))
    clipping = {"max_grad_norm": args.fixed_clip}
    if adaptive:
        clipping = {"max_grad_norm": args.initial_clip, "clipping": "adaptive", "target_unclipped_quantile": 0.5,
                    "clipbound_learning_rate": 0.2, "min_clipbound": 1e-3, "max_clipbound": 100.0,
                    "unclipped_num_std": args.batch_size / 20}  # fmt: skip
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=args.epsilon, target_delta=args.delta,
        epochs=args.epochs, noise_generator=torch.Generator().manual_seed(seed), **clipping,
    )  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    clip_norms = []
    for _ in range(args.epochs):
        for features, labels in loader:
            optimizer.zero_grad()
            loss_fn(model(features), labels).backward()
            optimizer.step()
        clip_norms.append(optimizer.clipper.bounds[0])
    return model.to_standard_module(), engine.get_epsilon(args.delta), clip_norms


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    results: dict[str, list[float]] = {"fixed": [], "adaptive": []}
    for seed in tqdm(range(args.seeds), desc="seeds", unit="seed"):
        train_data, test_data = load_data(seed, 3.0)
        for name in results:
            model, epsilon, clip_norms = train(args, train_data, seed, adaptive=name == "adaptive")
            results[name].append(accuracy(model, test_data))
            if name == "adaptive":
                trace = ", ".join(f"{c:.3f}" for c in clip_norms[:: max(1, len(clip_norms) // 5)])
                tqdm.write(f"seed {seed}: adaptive clip norm by epoch {trace} (epsilon {epsilon:.2f})")
    print(f"\n{'clipping':<34} {'test accuracy (mean +- sd over seeds)':>38}")
    for name, label in (("fixed", f"fixed C = {args.fixed_clip} (tuned)"),
                        ("adaptive", f"adaptive, from C = {args.initial_clip}")):  # fmt: skip
        values = np.array(results[name])
        print(f"{label:<34} {values.mean():>30.2%} +- {values.std():.2%}")
    print(f"(epsilon, delta) = ({args.epsilon}, {args.delta:g}) for both; {args.seeds} seeds; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
