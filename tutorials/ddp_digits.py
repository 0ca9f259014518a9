"""DP-SGD on the handwritten digits with 2 processes (DistributedDataParallel, gloo on CPU).

    torchrun --nproc_per_node=2 tutorials/ddp_digits.py            # epsilon = 3, delta = 1e-5
    torchrun --nproc_per_node=2 tutorials/ddp_digits.py --seed 1 --no-compare

The same data, model and hyper-parameters as ``dpsgd_digits.py`` (imported from it), trained by
two ranks together: the model is wrapped in torch's ``DistributedDataParallel`` and every rank
calls ``make_private_with_epsilon`` with the same arguments and the same loader over the whole
training set, whose ``batch_size`` (384) is the expected *global* batch. Each rank then
Poisson-samples its own half of the examples at the global rate, clips its examples, and one
all-reduce per step sums the clipped gradients with the noise drawn once, on rank 0. Every rank
ends with the same model and reports the same epsilon, that of one process running the same
global mechanism.

Afterwards rank 0 trains the single-process DP-SGD model of ``dpsgd_digits.py`` (same seed and
epsilon) for comparison (``--no-compare`` skips it). The two runs draw different batches and
noise, so their accuracies differ by the usual seed-to-seed spread (93.6-95.8 % single-process
over seeds 0-4).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dpsgd_digits, next to this file

import dpsgd_digits

from accountants import make_accountant
from privacy_engine.engine import PrivacyEngine


def train_distributed(
    args: argparse.Namespace, train: TensorDataset, rank: int
) -> tuple[nn.Module, PrivacyEngine, float]:
    torch.manual_seed(args.seed)
    model = dpsgd_digits.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    # The loader every rank passes: the whole training set, batch_size = the expected global batch.
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    accountant = make_accountant("pld", value_discretization_interval=1e-3) if args.accountant == "pld" else "rdp"
    engine = PrivacyEngine(accountant=accountant)
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=DistributedDataParallel(model),
        optimizer=optimizer,
        data_loader=loader,
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        epochs=args.epochs,
        max_grad_norm=args.max_grad_norm,
        noise_generator=torch.Generator().manual_seed(args.seed),
    )
    loss_fn = nn.CrossEntropyLoss()
    epsilon = 0.0
    progress = tqdm(total=args.epochs * len(loader), desc=f"DP-SGD, {dist.get_world_size()} ranks", unit="step",
                    disable=rank != 0)  # fmt: skip
    for _ in range(args.epochs):
        for features, labels in loader:  # this rank's part of the global Poisson batch (may be empty)
            optimizer.zero_grad()
            loss = loss_fn(model(features), labels)
            loss.backward()
            optimizer.step()  # every rank, every step: the step all-reduces
            progress.update()
        epsilon = engine.get_epsilon(args.delta)
        progress.set_postfix(epsilon=f"{epsilon:.2f}")
    progress.close()
    return model.to_standard_module(), engine, optimizer.noise_multiplier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilon", type=float, default=3.0, help="target epsilon of the whole run")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=384, help="expected (Poisson) GLOBAL batch size")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-example clipping bound")
    parser.add_argument("--feature-clip", type=float, default=3.0, help="clip standardised features to +-this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accountant", choices=("pld", "rdp"), default="pld")
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="skip the single-process DP-SGD run on rank 0")  # fmt: skip
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit("launch with: torchrun --nproc_per_node=2 tutorials/ddp_digits.py")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    train, test = dpsgd_digits.load_data(args.seed, args.feature_clip)
    if rank == 0:
        print(f"digits: {len(train)} training and {len(test)} test examples; {world_size} ranks (gloo, CPU)")
    model, engine, noise_multiplier = train_distributed(args, train, rank)
    epsilon = engine.get_epsilon(args.delta)
    # Every rank holds the same model and the same ledger: check it, as a user would want to.
    checks = [None] * world_size
    summary = (torch.cat([p.detach().flatten() for p in model.parameters()]), epsilon)
    dist.all_gather_object(checks, summary)
    same = all(torch.equal(c[0], checks[0][0]) and c[1] == checks[0][1] for c in checks)
    distributed_seconds = time.perf_counter() - start
    if rank == 0:
        rows = [(f"DP-SGD, {world_size} ranks", dpsgd_digits.accuracy(model, test), epsilon)]
        if args.compare:
            with warnings.catch_warnings():
                # A deliberate single-process run inside the process group: not the mistake the warning is for.
                warnings.filterwarnings("ignore", message=".*not wrapped in DistributedDataParallel")
                single_model, single_engine, _ = dpsgd_digits.train_private(args, train)
            rows.append(("DP-SGD, 1 process", dpsgd_digits.accuracy(single_model, test),
                         single_engine.get_epsilon(args.delta)))  # fmt: skip
        print()
        print(f"{'model':<20} {'test accuracy':>13}   privacy")
        for name, accuracy, eps in rows:
            print(f"{name:<20} {accuracy:>13.2%}   (epsilon, delta) = ({eps:.2f}, {args.delta:g})")
        print(
            f"\n{world_size} ranks: {engine.accountant.steps} global steps, expected global batch {args.batch_size} "
            f"(~{args.batch_size / world_size:.0f} per rank), noise multiplier {noise_multiplier:.3f}; parameters and "
            f"epsilon identical on every rank: {same}; distributed run {distributed_seconds:.1f} s"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
