"""One rank of the 2-process user-level DDP job that tests/test_user_level_ddp.py spawns (gloo, file store).

    python tests/user_level_ddp_worker.py RANK WORLD_SIZE OUT_DIR

For each grad_sample_mode (hooks, ghost): a DDP-wrapped MLP, ``make_private(privacy_unit="user")`` with noise
off, ``loss_reduction="sum"`` and learning rate 0, a few steps; writes, per step, the dataset indices of this
rank's rows (in row order) and the released gradient, plus the loader's rates, to OUT_DIR/rank{RANK}.pt (plain
types: the test loads it with weights_only=True). The test holds the expectations and the reference.
"""

from __future__ import annotations

import datetime
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from privacy_engine import PrivacyEngine

NUM_EXAMPLES, NUM_USERS, EXPECTED_USERS, K, STEPS = 40, 10, 4, 2, 4


def data() -> tuple[TensorDataset, list[int]]:
    """(features, label, index) and the user of each example (uneven counts); the same on every rank and in the
    test."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_EXAMPLES, 5, generator=generator, dtype=torch.float64) * 3
    y = torch.randint(0, 3, (NUM_EXAMPLES,), generator=generator)
    user_ids = (torch.arange(NUM_EXAMPLES) * 7 % NUM_USERS).tolist()
    return TensorDataset(x, y, torch.arange(NUM_EXAMPLES)), user_ids


def mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 6, dtype=torch.float64), nn.Tanh(), nn.Linear(6, 3, dtype=torch.float64))


def run(mode: str) -> dict:
    dataset, user_ids = data()
    model = DistributedDataParallel(mlp())
    engine = PrivacyEngine()
    wrapped, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(dataset, batch_size=EXPECTED_USERS), noise_multiplier=0.0, max_grad_norm=1.0,
        grad_sample_mode=mode, loss_reduction="sum", privacy_unit="user", user_ids=user_ids, examples_per_user=K,
    )  # fmt: skip
    record = {"indices": [], "released": [], "sample_rate": loader.sample_rate,
              "expected_batch_size": float(optimizer.expected_batch_size)}  # fmt: skip
    batches = (batch for _ in range(STEPS) for batch in loader)  # epochs of round(users / batch_size) steps
    for _ in range(STEPS):
        x, y, index = next(batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(wrapped(x), y, reduction="sum").backward()
        optimizer.step()
        record["indices"].append(index.tolist())
        record["released"].append(torch.cat([p.grad.reshape(-1) for p in optimizer.params]).clone())
    return record


def main() -> None:
    rank, world_size, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    results: dict = {}
    try:
        for mode in ("hooks", "ghost"):
            results[mode] = run(mode)
    except Exception:  # noqa: BLE001  (reported to the test, which fails with it)
        results["traceback"] = traceback.format_exc()
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
