# ruff: noqa: PLR0402, C408  (Opacus's code, kept as Opacus writes it)
"""Opacus's examples/mnist.py, small: SampleConvNet on synthetic 1x28x28 images, two runs (the second
makes the loader the first run returned private again), as ``--n-runs 2``. Only the privacy-library
calls of the original are kept verbatim; data, sizes and epochs are small."""

import copy
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from opacus import PrivacyEngine
from torch.utils.data import TensorDataset

args = SimpleNamespace(
    batch_size=16, epochs=1, n_runs=2, lr=0.1, sigma=1.0, max_per_sample_grad_norm=1.0, delta=1e-5,
    device="cpu", disable_dp=False, secure_rng=False, num_examples=64,
)
args.__dict__.update(globals().get("SETTINGS", {}))
torch.manual_seed(0)


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(x, 2, 1)
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2, 1)
        x = x.view(-1, 32 * 4 * 4)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return x


def train(args, model, device, train_loader, optimizer, privacy_engine, epoch):
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    epsilon = privacy_engine.accountant.get_epsilon(delta=args.delta)
    print(f"Train Epoch: {epoch} \tLoss: {np.mean(losses):.6f} (ε = {epsilon:.2f}, δ = {args.delta})")
    return losses


device = torch.device(args.device)
images = torch.randn(args.num_examples, 1, 28, 28)
train_loader = torch.utils.data.DataLoader(
    TensorDataset(images, torch.randint(0, 10, (args.num_examples,))),
    batch_size=args.batch_size,
    num_workers=0,
    pin_memory=False,
)
runs = []
for _ in range(args.n_runs):
    model = SampleConvNet().to(device)
    initial = copy.deepcopy(model.state_dict())
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0)
    privacy_engine = PrivacyEngine(secure_mode=args.secure_rng)
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        noise_multiplier=args.sigma,
        max_grad_norm=args.max_per_sample_grad_norm,
    )
    losses = []
    for epoch in range(1, args.epochs + 1):
        losses += train(args, model, device, train_loader, optimizer, privacy_engine, epoch)
    runs.append(dict(engine=privacy_engine, model=model, initial=initial, losses=losses))

# What the test reads: the last run (its loader is the first run's, made private again).
RESULT = dict(
    engine=runs[-1]["engine"], delta=args.delta, model=runs[-1]["model"], initial=runs[-1]["initial"],
    losses=[loss for run in runs for loss in run["losses"]], runs=runs,
)
