"""Record what the engine releases on a fixed set of workloads, or compare with a recording.

A restructure must leave every result bit for bit as it was. This script runs seeded workloads through
the public API only (``make_private``, ``GradSampleModule``, the accountants), so the same script runs on
the code before and after a change:

    PYTHONPATH=/tmp/base python scripts/golden_outputs.py record /tmp/golden_base.pt   # the old tree
    python scripts/golden_outputs.py compare /tmp/golden_base.pt                       # this tree

Without a path both use ``/tmp/golden_base.pt``. ``compare`` exits 1 and names every tensor or number that differs (``torch.equal``, no tolerance).
Recorded: parameters after each private step (hooks, ghost, per-layer clipping, BandMF, truncated
sampling, accumulation of two batches, a GPT-2 from a config when transformers is installed),
``grad_sample`` of every parameter of a mixed model, and epsilons of the RDP and PLD accountants.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import GradSampleModule, PrivacyEngine

#: Where ``record`` / ``compare`` read and write when no path is given.
DEFAULT_PATH = "/tmp/golden_base.pt"


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _conv_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)
    )


def _data(shape: tuple[int, ...], n: int = 64, classes: int = 3) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, *shape, generator=generator), torch.randint(0, classes, (n,), generator=generator))


def _train(name: str, build, shape, out: dict, *, steps: int = 3, batches_per_step: int = 1, **settings) -> None:
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(_data(shape), batch_size=16)
    engine = PrivacyEngine(accountant=settings.pop("accountant", "rdp"))
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_seed=7, **settings
    )
    batches = iter(loader)
    for step in range(steps):
        optimizer.zero_grad()
        for _ in range(batches_per_step):
            x, y = next(batches)
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        for index, p in enumerate(model.parameters()):
            out[f"{name}/step{step}/param{index}"] = p.detach().clone()
    out[f"{name}/epsilon"] = torch.tensor(engine.get_epsilon(delta=1e-5), dtype=torch.float64)


def _private_runs(out: dict) -> None:
    _train("hooks", _mlp, (6,), out, noise_multiplier=1.1, max_grad_norm=1.0)
    _train("ghost", _mlp, (6,), out, noise_multiplier=1.1, max_grad_norm=1.0, grad_sample_mode="ghost")
    _train("per_layer", _mlp, (6,), out, noise_multiplier=1.1, max_grad_norm=[0.5, 0.5, 0.5, 0.5], clipping="per_layer")
    # Hooks named: recorded when hooks was the default; the default ("auto") now takes ghost for a CNN.
    _train("conv", _conv_model, (2, 5, 5), out, noise_multiplier=0.9, max_grad_norm=0.7, accountant="pld",
           grad_sample_mode="hooks")  # fmt: skip
    _train("bandmf", _mlp, (6,), out, noise_multiplier=1.3, max_grad_norm=1.0, noise_mechanism="bandmf",
           num_bands=2, total_steps=8, accountant="pld")  # fmt: skip
    _train("truncated", _mlp, (6,), out, noise_multiplier=1.2, max_grad_norm=1.0, max_batch_size=20,
           accountant="pld")  # fmt: skip
    _train("shuffled", _mlp, (6,), out, noise_multiplier=1.2, max_grad_norm=1.0, poisson_sampling=False)
    _train("accumulate", _mlp, (6,), out, steps=1, batches_per_step=2, noise_multiplier=1.0, max_grad_norm=1.0,
           accountant="pld")  # fmt: skip


def _gpt2_runs(out: dict) -> None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return
    for mode in ("hooks", "ghost"):
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)
        config.attn_implementation = "eager"
        model = GPT2LMHeadModel(config)
        generator = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 50, (32, 8), generator=generator)
        loader = DataLoader(TensorDataset(ids), batch_size=8)
        engine = PrivacyEngine()
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=5, grad_sample_mode=mode,
        )  # fmt: skip
        for step, (x,) in enumerate(loader):
            if step == 2:
                break
            optimizer.zero_grad()
            model(input_ids=x, labels=x).loss.backward()
            optimizer.step()
        for index, p in enumerate(model.parameters()):
            out[f"gpt2_{mode}/param{index}"] = p.detach().clone()


def _grad_samples(out: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(10, 6), nn.LayerNorm(6), nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 4)
    ).double()
    wrapped = GradSampleModule(model)
    tokens = torch.randint(0, 10, (5, 7))
    wrapped(tokens).square().sum().backward()
    for index, p in enumerate(model.parameters()):
        out[f"grad_sample/param{index}"] = p.grad_sample.detach().clone()


def _epsilons(out: dict) -> None:
    for kind in ("rdp", "pld"):
        engine = PrivacyEngine(accountant=kind)
        accountant = engine.accountant
        accountant.step(noise_multiplier=1.1, sample_rate=0.01, num_steps=200) if _takes_num_steps(accountant) else [
            accountant.step(noise_multiplier=1.1, sample_rate=0.01) for _ in range(200)
        ]
        accountant.step(noise_multiplier=0.8, sample_rate=0.02)
        out[f"accountant_{kind}/epsilon"] = torch.tensor(accountant.get_epsilon(delta=1e-6), dtype=torch.float64)


def _takes_num_steps(accountant) -> bool:
    import inspect

    return "num_steps" in inspect.signature(accountant.step).parameters


def collect() -> dict:
    out: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _private_runs(out)
        _grad_samples(out)
        _epsilons(out)
        _gpt2_runs(out)
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 1:
        argv = [*argv, DEFAULT_PATH]
    if len(argv) != 2 or argv[0] not in ("record", "compare"):
        print(__doc__)
        return 2
    command, path = argv
    results = collect()
    if command == "record":
        torch.save(results, path)
        print(f"recorded {len(results)} results to {path}")
        return 0
    expected = torch.load(path, weights_only=True)
    differ = sorted(k for k in expected if k not in results or not torch.equal(expected[k], results[k]))
    extra = sorted(set(results) - set(expected))
    for key in differ:
        print(f"DIFFERS: {key}")
    for key in extra:
        print(f"new (not compared): {key}")
    print(f"{len(expected) - len(differ)}/{len(expected)} results bit for bit equal")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
