# ruff: noqa: PLR0402, C408  (Opacus's code, kept as Opacus writes it)
"""Opacus's examples/imdb.py, small: the embedding-bag-style sentiment model on synthetic token-id
reviews of varying length (dicts with "input_ids" and "label", as the tokenised dataset yields), with
``poisson_sampling=False`` as in the original. Only the privacy-library calls are kept verbatim."""

import copy
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from opacus import PrivacyEngine
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

args = SimpleNamespace(
    batch_size=16, epochs=1, lr=0.02, sigma=0.56, max_per_sample_grad_norm=1.0, delta=1e-5,
    max_sequence_length=32, device="cpu", disable_dp=False, secure_rng=False, workers=0, vocab_size=1000,
    num_reviews=64,
)
args.__dict__.update(globals().get("SETTINGS", {}))
torch.manual_seed(0)


class SampleNet(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 16)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x):
        x = self.emb(x)
        x = x.transpose(1, 2)
        x = self.pool(x).squeeze()
        x = self.fc1(x)
        x = F.relu(x)
        x = self.fc2(x)
        return x


class SyntheticReviews(Dataset):
    def __init__(self, num_reviews, vocab_size, max_length):
        lengths = torch.randint(8, max_length + 1, (num_reviews,))
        self.items = [{"input_ids": torch.randint(0, vocab_size, (int(n),)), "label": torch.randint(0, 2, ())}
                      for n in lengths]

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


def binary_accuracy(preds, y):
    correct = (y.long() == torch.argmax(preds, dim=1)).float()
    return correct.sum() / len(correct)


def padded_collate(batch, padding_idx=0):
    x = pad_sequence([elem["input_ids"] for elem in batch], batch_first=True, padding_value=padding_idx)
    y = torch.stack([elem["label"] for elem in batch]).long()
    return x, y


def train(args, model, train_loader, optimizer, privacy_engine, epoch):
    criterion = nn.CrossEntropyLoss()
    losses, accuracies = [], []
    device = torch.device(args.device)
    model = model.train().to(device)
    for data, label in train_loader:
        data = data.to(device)
        label = label.to(device)
        optimizer.zero_grad()
        predictions = model(data).squeeze(1)
        loss = criterion(predictions, label)
        acc = binary_accuracy(predictions, label)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        accuracies.append(acc.item())
    epsilon = privacy_engine.accountant.get_epsilon(delta=args.delta)
    print(f"Train Epoch: {epoch} \t Train Loss: {np.mean(losses):.6f} (ε = {epsilon:.2f}, δ = {args.delta})")
    return losses


device = torch.device(args.device)
train_dataset = SyntheticReviews(args.num_reviews, args.vocab_size, args.max_sequence_length)
train_loader = DataLoader(train_dataset, num_workers=args.workers, batch_size=args.batch_size,
                          collate_fn=padded_collate, pin_memory=False, shuffle=True)
model = SampleNet(vocab_size=args.vocab_size).to(device)
initial = copy.deepcopy(model.state_dict())
optimizer = optim.Adam(model.parameters(), lr=args.lr)
privacy_engine = PrivacyEngine(secure_mode=args.secure_rng)
model, optimizer, train_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    noise_multiplier=args.sigma,
    max_grad_norm=args.max_per_sample_grad_norm,
    poisson_sampling=False,
)
losses = []
for epoch in range(1, args.epochs + 1):
    losses += train(args, model, train_loader, optimizer, privacy_engine, epoch)

RESULT = dict(engine=privacy_engine, delta=args.delta, model=model, initial=initial, losses=losses)
