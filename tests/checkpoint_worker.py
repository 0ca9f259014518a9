"""Fresh processes for tests/test_checkpoints.py.

    python tests/checkpoint_worker.py resume OUT RUN=CHECKPOINT [RUN=CHECKPOINT ...]
    python tests/checkpoint_worker.py slow-save PATH

``resume``: for each run, builds it anew (other seeds, so that only the checkpoint can make it match),
loads the checkpoint, trains ``RESUMED_STEPS`` more steps and writes what it saw to OUT (plain types
only: the test loads it with weights_only=True). RUN is ``CONFIG`` (the rdp accountant, loaded with
``data_loader=``) or ``CONFIG,ACCOUNTANT,WAY``: WAY ``engine`` loads with ``data_loader=``, ``opacus``
as Opacus's ``load_checkpoint(path=, module=, optimizer=)`` does, without it. ``slow-save``: writes a large
checkpoint to PATH with each write slowed down, so that the test can kill the process mid-write.
The test, not this file, holds the expectations.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from privacy_engine import PrivacyEngine  # noqa: E402

NUM_EXAMPLES = 40
BATCH_SIZE = 5
STEPS_BEFORE_SAVE = 5
RESUMED_STEPS = 5  # crosses the epoch boundary (8 steps an epoch)
DELTA = 1e-5

CONFIGS = {
    "gaussian-hooks": {"mechanism": "gaussian", "grad_sample_mode": "hooks"},
    "gaussian-ghost": {"mechanism": "gaussian", "grad_sample_mode": "ghost"},
    "bandmf-hooks": {"mechanism": "bandmf", "grad_sample_mode": "hooks"},
    "bandmf-ghost": {"mechanism": "bandmf", "grad_sample_mode": "ghost"},
}


def build(config: str, seed: int = 0, accountant: str = "rdp"):
    """(engine, model, optimizer, criterion, loader) of one configuration; ``seed`` sets the model's
    initialisation, the noise seed and torch's global generator (which drives Poisson sampling)."""
    settings = CONFIGS[config]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: state that must carry over
    data = torch.Generator().manual_seed(1234)
    features = torch.randn(NUM_EXAMPLES, 6, generator=data)
    labels = torch.randint(0, 3, (NUM_EXAMPLES,), generator=data)
    loader = DataLoader(TensorDataset(features, labels), batch_size=BATCH_SIZE)
    engine = PrivacyEngine(accountant=accountant)
    kwargs = {"noise_multiplier": 1.0, "max_grad_norm": 0.5, "noise_seed": 7 + seed,
              "grad_sample_mode": settings["grad_sample_mode"]}  # fmt: skip
    if settings["mechanism"] == "bandmf":
        kwargs.update(noise_mechanism="bandmf", num_bands=4, total_steps=16)
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader, **kwargs)
    return engine, model, optimizer, nn.CrossEntropyLoss(), loader


def batches(loader):
    """The loader's batches across epochs, as one stream (the step counter runs on across epochs)."""
    while True:
        yield from loader


def train(model, optimizer, criterion, stream, steps: int) -> list[dict]:
    """Train ``steps`` steps; per step the batch, the private gradients (clipped sum plus noise) and
    the parameters after the update."""
    records = []
    for _ in range(steps):
        inputs, targets = next(stream)
        optimizer.zero_grad()
        criterion(model(inputs), targets).backward()
        optimizer.step()
        records.append({
            "inputs": inputs.clone(),
            "targets": targets.clone(),
            "grads": [p.grad.detach().clone() for p in model.parameters()],
            "params": [p.detach().clone() for p in model.parameters()],
        })  # fmt: skip
    return records


def resume(out: str, pairs: list[str]) -> None:
    results = {}
    for pair in pairs:
        run, checkpoint = pair.split("=", 1)
        config, accountant, way = run.split(",") if "," in run else (run, "rdp", "engine")
        engine, model, optimizer, criterion, loader = build(config, seed=99, accountant=accountant)
        loader_argument = {"data_loader": loader} if way == "engine" else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.load_checkpoint(path=checkpoint, module=model, optimizer=optimizer, **loader_argument)
        loaded_params = [p.detach().clone() for p in model.parameters()]
        records = train(model, optimizer, criterion, batches(loader), RESUMED_STEPS)
        results[run] = {"records": records, "epsilon": engine.get_epsilon(DELTA), "loaded_params": loaded_params,
                        "history": engine.accountant.state_dict()["history"],
                        "warnings": [str(warning.message) for warning in caught]}  # fmt: skip
    torch.save(results, out)


def slow_save(path: str) -> None:
    from privacy_engine.engine import checkpoint

    original_write = checkpoint._HashingWriter.write

    def slow_write(self, data):
        # Slowed down so that the test's SIGKILL lands while the payload is being written.
        time.sleep(0.02)
        return original_write(self, data)

    checkpoint._HashingWriter.write = slow_write
    payload = {"format": checkpoint.PAYLOAD_FORMAT, "blocks": [torch.full((1 << 16,), float(i)) for i in range(200)]}
    print("writing", flush=True)
    checkpoint.write_checkpoint(path, payload)
    print("done", flush=True)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "resume":
        resume(sys.argv[2], sys.argv[3:])
    elif command == "slow-save":
        slow_save(sys.argv[2])
    else:
        raise SystemExit(f"unknown command {command!r}")
