# ruff: noqa: PLR0402, C408  (Opacus's code, kept as Opacus writes it)
"""Opacus's tutorial building_lstm_name_classifier.ipynb, small: a DPLSTM name classifier made private
with make_private_with_epsilon, on synthetic byte-encoded names (a random_split Subset, padded by the
notebook's collate function). The non-private comparison at the end of the notebook is left out (it
makes no privacy-library call). Only the privacy-library calls are kept verbatim."""

import copy
from statistics import mean

import torch
import torch.nn as nn
from opacus import PrivacyEngine
from opacus.layers import DPLSTM
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

SETTINGS = globals().get("SETTINGS", {})
torch.manual_seed(0)
VOCAB_SIZE = 256 + 3
secure_mode = False
train_split = 0.8
batch_size = 16
epochs = SETTINGS.get("epochs", 2)
learning_rate = 2.0
max_per_sample_grad_norm = 1.5
delta = 8e-5
epsilon = 4.0  # 12.0 in the notebook (its 50 epochs); a tighter target keeps the accounting fast
embedding_size = 16
hidden_size = 32
n_lstm_layers = 1
bidirectional_lstm = False


class NamesDataset(Dataset):
    """Synthetic stand-in for the notebook's dataset: (encoded name, language id) pairs."""

    def __init__(self, num_names=100, num_languages=5):
        self.labels = [f"language{i}" for i in range(num_languages)]
        self.samples = []
        for _ in range(num_names):
            length = int(torch.randint(3, 11, ()))
            encoded = [256] + torch.randint(97, 123, (length,)).tolist() + [257]
            self.samples.append((torch.LongTensor(encoded), torch.tensor(int(torch.randint(0, num_languages, ()))).long()))

    def __getitem__(self, i):
        return self.samples[i]

    def __len__(self):
        return len(self.samples)


def padded_collate(batch, padding_idx=0):
    x = pad_sequence([elem[0] for elem in batch], batch_first=True, padding_value=padding_idx)
    y = torch.stack([elem[1] for elem in batch]).long()
    return x, y


ds = NamesDataset()
train_len = int(train_split * len(ds))
test_len = len(ds) - train_len
train_ds, test_ds = torch.utils.data.random_split(ds, [train_len, test_len])
train_loader = DataLoader(train_ds, batch_size=batch_size, pin_memory=False, collate_fn=padded_collate)


def train(model, criterion, optimizer, train_loader, epoch, privacy_engine, device="cuda:0"):
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
    printstr = f"\t Epoch {epoch}. Accuracy: {mean(accs):.6f} | Loss: {mean(losses):.6f}"
    if privacy_engine:
        epsilon = privacy_engine.get_epsilon(delta)
        printstr += f" | (ε = {epsilon:.2f}, δ = {delta})"
    print(printstr)
    return losses


class CharNNClassifier(nn.Module):
    def __init__(self, embedding_size, hidden_size, output_size, num_lstm_layers=1, bidirectional=False,
                 vocab_size=VOCAB_SIZE):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.lstm = DPLSTM(embedding_size, hidden_size, num_layers=num_lstm_layers, bidirectional=bidirectional,
                           batch_first=True)
        self.out_layer = nn.Linear(hidden_size, output_size)

    def forward(self, x, hidden=None):
        x = self.embedding(x)  # -> [B, T, D]
        x, _ = self.lstm(x, hidden)  # -> [B, T, H]
        x = x[:, -1, :]  # -> [B, H]
        x = self.out_layer(x)  # -> [B, C]
        return x


device = torch.device("cpu")
model = CharNNClassifier(embedding_size, hidden_size, len(ds.labels), n_lstm_layers, bidirectional_lstm).to(device)
initial = copy.deepcopy(model.state_dict())
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)

privacy_engine = PrivacyEngine(secure_mode=secure_mode)
model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    max_grad_norm=max_per_sample_grad_norm,
    target_delta=delta,
    target_epsilon=epsilon,
    epochs=epochs,
)
losses = []
for epoch in range(epochs):
    losses += train(model, criterion, optimizer, train_loader, epoch, privacy_engine, device=device)

RESULT = dict(engine=privacy_engine, delta=delta, model=model, initial=initial, losses=losses, target_epsilon=epsilon)
