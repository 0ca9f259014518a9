"""Private LoRA fine-tuning of a model sharded with FSDP2 (``fully_shard``), 2 processes on CPU (gloo).

    torchrun --nproc_per_node=2 tutorials/fsdp_lora.py          # epsilon = 3, delta = 1e-5 (about a minute)
    torchrun --nproc_per_node=2 tutorials/fsdp_lora.py --quick  # 5 epochs (what the test runs)
    python tutorials/fsdp_lora.py                               # the single-process run alone

The set-up of DP fine-tuning, in small: a network is first trained without privacy on *public* data (here
the digits 0-4 of a public part of scikit-learn's digits), then adapted to *private* data (all ten digits)
with DP, training only LoRA adapters on its hidden layers (``peft``) and a fresh output layer. For a model that
does not fit one device, each block is sharded with ``fully_shard`` and the whole model once more; the private
part is then the usual three lines::

    model, optimizer, loader = engine.make_private_with_epsilon(module=model, optimizer=optimizer,
                                                                data_loader=loader, grad_sample_mode="ghost", ...)
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()

Every rank Poisson-samples its own half of the private examples at the global rate; the per-example norms
are computed in a first backward pass (FSDP all-gathers each block as usual), the clipped sum is
reduce-scattered by FSDP in a second; each rank adds the noise of its own shard from its own stream and the
step is accounted once, as one process running the same mechanism (``privacy_engine.engine.sharded``).

After the sharded run, rank 0 trains the same adapters in one process (``--no-compare`` skips it) at the
same epsilon. The two runs draw different batches and noise, so their accuracies differ by the usual
seed-to-seed spread.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dpsgd_digits, next to this file

import dpsgd_digits

from accountants import make_accountant
from privacy_engine.engine import PrivacyEngine


class Block(nn.Module):
    """A residual block: x + tanh(W x + b)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Net(nn.Module):
    def __init__(self, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def split(train: TensorDataset, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(public: digits 0-4 of a random 30 %, private: the other 70 %, all ten digits)."""
    features, labels = train.tensors
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    public, private = order[: int(0.3 * len(order))], order[int(0.3 * len(order)) :]
    public = public[labels[public] < 5]
    return TensorDataset(features[public], labels[public]), TensorDataset(features[private], labels[private])


def pretrained(public: TensorDataset, seed: int) -> Net:
    """The network trained without privacy on the public digits (the "pre-trained model")."""
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(30):
        for features, labels in DataLoader(public, batch_size=64, shuffle=True):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(features), labels).backward()
            optimizer.step()
    return model


def with_adapters(model: Net, rank: int) -> nn.Module:
    """LoRA adapters (rank ``rank``) on every hidden layer; the base frozen; a fresh output layer trained."""
    torch.manual_seed(1)
    model.head.reset_parameters()
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["embed", "linear"], lora_dropout=0.0,
                        modules_to_save=["head"])  # fmt: skip
    return get_peft_model(model, config)


def train_private(args: argparse.Namespace, model: nn.Module, private: TensorDataset, *, sharded: bool) -> tuple:
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    loader = DataLoader(private, batch_size=args.batch_size)  # the expected GLOBAL batch, over all private examples
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=1e-3))
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, grad_sample_mode="ghost", target_epsilon=args.epsilon,
        target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.max_grad_norm, noise_seed=args.seed,
    )  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        for features, labels in loader:  # this rank's part of the global Poisson batch (may be empty)
            loss = loss_fn(model(features), labels)
            loss.backward()
            optimizer.step()  # every rank, every step: FSDP's collectives pair the ranks
            optimizer.zero_grad()
        if (not sharded or dist.get_rank() == 0) and (epoch + 1) % max(1, args.epochs // 5) == 0:
            print(f"  {'sharded' if sharded else '1 process'}: epoch {epoch + 1}/{args.epochs}, "
                  f"epsilon {engine.get_epsilon(args.delta):.2f}", flush=True)  # fmt: skip
    return model, optimizer, engine


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        features, labels = data.tensors
        correct = float((model(features).argmax(dim=1) == labels).float().mean())
    model.train()
    return correct


def main(argv: list[str] | None = None, *, init_method: str | None = None, rank: int | None = None,
         world_size: int | None = None) -> list[tuple[str, float, float | None]]:
    """Run the tutorial; returns rank 0's table rows (name, test accuracy, epsilon or None). Under torchrun the
    process group comes from its environment; ``init_method``/``rank``/``world_size`` start one without it (a
    file store: what the test does)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilon", type=float, default=3.0, help="target epsilon of the whole private run")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128, help="expected (Poisson) GLOBAL batch size")
    parser.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--feature-clip", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="5 epochs")
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="skip the single-process run on rank 0")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = 5
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ or init_method is not None
    if distributed:
        store = {} if init_method is None else {"init_method": init_method, "rank": rank, "world_size": world_size}
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60), **store)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    train, test = dpsgd_digits.load_data(args.seed, args.feature_clip)
    public, private = split(train, args.seed)
    base = pretrained(public, args.seed)
    rows = [("pre-trained on public 0-4", accuracy(base, test), None)]
    if rank == 0:
        print(f"digits: {len(public)} public (0-4), {len(private)} private, {len(test)} test; {world_size} rank(s)")
    if distributed:
        start = time.perf_counter()
        model = with_adapters(copy.deepcopy(base), args.lora_rank)
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.base_model.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model, optimizer, engine = train_private(args, model, private, sharded=True)
        optimizer.remove_hooks()
        epsilon = engine.get_epsilon(args.delta)
        # Gather the full parameters (collective) to evaluate on rank 0.
        full = {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in model.named_parameters()}
        seconds = time.perf_counter() - start
        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
            return []
        evaluated = with_adapters(Net(), args.lora_rank)
        evaluated.load_state_dict({**evaluated.state_dict(), **full})
        rows.append((f"DP LoRA, FSDP2 x{world_size}", accuracy(evaluated, test), epsilon))
        print(f"  sharded run: {engine.accountant.steps} global steps, noise multiplier "
              f"{optimizer.noise_multiplier:.3f}, {seconds:.1f} s")  # fmt: skip
    if not distributed or args.compare:
        start = time.perf_counter()
        model, optimizer, engine = train_private(args, with_adapters(copy.deepcopy(base), args.lora_rank),
                                                 private, sharded=False)  # fmt: skip
        rows.append(("DP LoRA, 1 process", accuracy(model, test), engine.get_epsilon(args.delta)))
        print(f"  1-process run: {engine.accountant.steps} steps, noise multiplier {optimizer.noise_multiplier:.3f}, "
              f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    print()
    print(f"{'model':<28} {'test accuracy':>13}   privacy of the private digits")
    for name, correct, eps in rows:
        privacy = "(trained on public data only)" if eps is None else f"(epsilon, delta) = ({eps:.2f}, {args.delta:g})"
        print(f"{name:<28} {correct:>13.2%}   {privacy}")
    return rows


if __name__ == "__main__":
    main()
