"""Scripts written the way Opacus's documentation writes them run with only their import changed.

Each script below is plain Opacus usage. The test runs it with ``from opacus import PrivacyEngine``
replaced by ``from privacy_engine import PrivacyEngine`` and nothing else touched; where Opacus is
installed it also runs the original, to show the script really is Opacus code and that both report
a similar epsilon for the same training.
"""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

OPACUS_IMPORT = "from opacus import PrivacyEngine"
OUR_IMPORT = "from privacy_engine import PrivacyEngine"

# The shape of Opacus's README / "Training with Opacus" tutorial.
MAKE_PRIVATE_SCRIPT = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from opacus import PrivacyEngine

torch.manual_seed(0)
features = torch.randn(96, 10)
labels = (features[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
criterion = nn.CrossEntropyLoss()
data_loader = DataLoader(TensorDataset(features, labels), batch_size=16)

privacy_engine = PrivacyEngine()
model, optimizer, data_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=data_loader,
    noise_multiplier=1.0,
    max_grad_norm=1.0,
)

for epoch in range(2):
    model.train()
    for data, target in data_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
    epsilon = privacy_engine.get_epsilon(delta=1e-5)
    print(f"epoch {epoch}: loss {loss.item():.3f} (epsilon = {epsilon:.2f}, delta = 1e-5)")
'''

# make_private_with_epsilon, Adam, an LR scheduler, the accountant read directly.
WITH_EPSILON_SCRIPT = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from opacus import PrivacyEngine

EPOCHS = 2
torch.manual_seed(1)
features = torch.randn(80, 10)
labels = (features.sum(1) > 0).long()
model = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
train_loader = DataLoader(TensorDataset(features, labels), batch_size=20, shuffle=True)

privacy_engine = PrivacyEngine(accountant="rdp")
model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    epochs=EPOCHS,
    target_epsilon=5.0,
    target_delta=1e-5,
    max_grad_norm=1.2,
)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
print(f"Using sigma={optimizer.noise_multiplier} and C={optimizer.max_grad_norm}")

for epoch in range(EPOCHS):
    model.train()
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    scheduler.step()
epsilon = privacy_engine.accountant.get_epsilon(delta=1e-5)
'''


def run_script(source: str, directory: Path) -> dict:
    """Run ``source`` as a script file (as ``python script.py`` would) and return its globals."""
    path = directory / "train.py"
    path.write_text(source)
    return runpy.run_path(str(path), run_name="__main__")


def with_our_import(source: str) -> str:
    assert source.count(OPACUS_IMPORT) == 1
    return source.replace(OPACUS_IMPORT, OUR_IMPORT)


@pytest.fixture(scope="module")
def our_make_private_run(tmp_path_factory):
    return run_script(with_our_import(MAKE_PRIVATE_SCRIPT), tmp_path_factory.mktemp("ours"))


def test_make_private_script_runs_with_only_the_import_changed(our_make_private_run):
    epsilon = our_make_private_run["epsilon"]
    assert 0 < epsilon < math.inf
    assert our_make_private_run["privacy_engine"].accountant.steps == 2 * 6  # 2 epochs of round(96 / 16) steps
    assert math.isfinite(our_make_private_run["loss"].item())


def test_make_private_with_epsilon_script_runs_with_only_the_import_changed(tmp_path):
    result = run_script(with_our_import(WITH_EPSILON_SCRIPT), tmp_path)
    assert 0 < result["epsilon"] <= 5.0
    assert result["optimizer"].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**2)  # the scheduler drove it


def test_the_same_script_under_opacus_reports_a_similar_epsilon(our_make_private_run, tmp_path):
    pytest.importorskip("opacus")
    theirs = run_script(MAKE_PRIVATE_SCRIPT, tmp_path)["epsilon"]
    # Same sigma, sample rate and step count; PLD (ours) and PRV (Opacus's default) accounting.
    assert our_make_private_run["epsilon"] == pytest.approx(theirs, rel=0.02)
