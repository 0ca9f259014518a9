# ruff: noqa: PLR0402, C408  (Opacus's code, kept as Opacus writes it)
"""Opacus's examples/char-lstm-classification.py, small: the character-level name classifier with
DPLSTM, DPGRU or DPRNN (``SETTINGS["mode"]``) on synthetic byte-encoded names of varying length,
padded by the script's collate function. Only the privacy-library calls are kept verbatim."""

import copy
from statistics import mean
from types import SimpleNamespace

import torch
import torch.nn as nn
from opacus import PrivacyEngine
from opacus.layers import DPGRU, DPLSTM, DPRNN
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

args = SimpleNamespace(
    mode="lstm", batch_size=8, embedding_size=16, hidden_size=32, n_layers=1, bidirectional=False,
    learning_rate=2.0, epochs=1, train_split=0.8, sigma=1.0, max_per_sample_grad_norm=1.5, disable_dp=False,
    secure_rng=False, delta=8e-5, num_names=50, num_languages=4, device="cpu",
)
args.__dict__.update(globals().get("SETTINGS", {}))
torch.manual_seed(0)
VOCAB_SIZE = 256 + 3


class SyntheticNamesDataset(Dataset):
    """Byte-encoded random "names" (<s> bytes </s>) of 3 to 10 characters with a language label."""

    def __init__(self, num_names, num_languages):
        self.labels = [f"language{i}" for i in range(num_languages)]
        self.samples = []
        for _ in range(num_names):
            length = int(torch.randint(3, 11, ()))
            encoded = [256] + torch.randint(97, 123, (length,)).tolist() + [257]
            self.samples.append((torch.LongTensor(encoded), torch.randint(0, num_languages, ()).long()))

    def __getitem__(self, i):
        return self.samples[i]

    def __len__(self):
        return len(self.samples)


class CharNNClassifier(nn.Module):
    def __init__(self, rnn_type, embedding_size, hidden_size, output_size, num_layers=1, bidirectional=False,
                 vocab_size=VOCAB_SIZE):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.rnn = rnn_type(embedding_size, hidden_size, num_layers=num_layers, bidirectional=bidirectional,
                            batch_first=True)
        self.out_layer = nn.Linear(hidden_size, output_size)

    def forward(self, x, hidden=None):
        x = self.embedding(x)  # -> [B, T, D]
        x, _ = self.rnn(x, hidden)  # -> [B, T, H]
        x = x[:, -1, :]  # -> [B, H]
        x = self.out_layer(x)  # -> [B, C]
        return x


def padded_collate(batch, padding_idx=0):
    x = pad_sequence([elem[0] for elem in batch], batch_first=True, padding_value=padding_idx)
    y = torch.stack([elem[1] for elem in batch]).long()
    return x, y


def train(model, criterion, optimizer, train_loader, epoch, privacy_engine, target_delta, device):
    model.train()
    accs, losses = [], []
    for x, y in train_loader:
        x = x.to(device)
        y = y.to(device)
        logits = model(x)
        loss = criterion(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        accs.append(float(logits.argmax(-1).eq(y).sum()) / max(len(y), 1))
        losses.append(float(loss) if len(y) else 0.0)
    epsilon = privacy_engine.accountant.get_epsilon(delta=target_delta)
    print(f"\t Epoch {epoch}. Accuracy: {mean(accs):.6f} | Loss: {mean(losses):.6f} | (ε = {epsilon:.2f})")
    return losses


device = torch.device(args.device)
ds = SyntheticNamesDataset(args.num_names, args.num_languages)
train_len = int(args.train_split * len(ds))
test_len = len(ds) - train_len
generator = None
train_ds, test_ds = torch.utils.data.random_split(ds, [train_len, test_len], generator=generator)
rnn_type = {"rnn": DPRNN, "gru": DPGRU, "lstm": DPLSTM}[args.mode]
model = CharNNClassifier(rnn_type, args.embedding_size, args.hidden_size, len(ds.labels), args.n_layers,
                         args.bidirectional)
model = model.to(device)
initial = copy.deepcopy(model.state_dict())
train_loader = DataLoader(train_ds, batch_size=args.batch_size, num_workers=0, pin_memory=False,
                          collate_fn=padded_collate)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)

privacy_engine = PrivacyEngine(secure_mode=args.secure_rng)
model, optimizer, train_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    noise_multiplier=args.sigma,
    max_grad_norm=args.max_per_sample_grad_norm,
)
losses = []
for epoch in range(args.epochs):
    losses += train(model, criterion, optimizer, train_loader, epoch, privacy_engine, args.delta, device=device)

RESULT = dict(engine=privacy_engine, delta=args.delta, model=model, initial=initial, losses=losses)
