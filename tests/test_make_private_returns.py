"""What ``make_private`` returns: the engine's own ``PrivacyEngine`` gives ``(module, optimizer,
data_loader)`` in every ``grad_sample_mode``, so a script switches modes by one keyword; the Opacus
namespace gives Opacus's ``(module, optimizer, criterion, data_loader)`` in ghost mode."""

from __future__ import annotations

import inspect
import runpy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine
from privacy_engine.capture import GradSampleModule, ManualGradSampleModule
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.opacus import PrivacyEngine as OpacusPrivacyEngine
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.optimizer import DPOptimizer
from tests.conftest import module_fingerprint

MODES = ["hooks", "functorch", "ew", "ghost", "no_op"]
WRAPPER = {"hooks": GradSampleModule, "functorch": GradSampleModule, "ew": GradSampleModule,
           "ghost": GhostClippingModule, "no_op": ManualGradSampleModule}  # fmt: skip
ENTRY_POINTS = {
    "make_private": {"noise_multiplier": 1.0},
    "make_private_with_epsilon": {"target_epsilon": 3.0, "target_delta": 1e-5, "epochs": 1},
}


def make_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    return model, optimizer, DataLoader(dataset, batch_size=8)


def call(engine, entry_point, mode, **extra):
    model, optimizer, loader = make_setup()
    method = getattr(engine, entry_point)
    return method(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=1.0, grad_sample_mode=mode,
                  **ENTRY_POINTS[entry_point], **extra)  # fmt: skip


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("mode", MODES)
def test_the_engine_returns_module_optimizer_and_loader_in_every_mode(mode, entry_point):
    made = call(PrivacyEngine(accountant="rdp"), entry_point, mode)
    assert len(made) == 3
    module, optimizer, loader = made
    assert type(module) is WRAPPER[mode]
    assert isinstance(optimizer, DPOptimizer) and isinstance(loader, DPDataLoader)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_the_engine_refuses_a_criterion_before_wrapping(entry_point):
    model, optimizer, loader = make_setup()
    before = module_fingerprint(model)
    with pytest.raises(TypeError, match=r"criterion.*\(module, optimizer, data_loader\) in every grad_sample_mode"):
        getattr(PrivacyEngine(accountant="rdp"), entry_point)(
            module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=1.0, grad_sample_mode="ghost",
            criterion=nn.CrossEntropyLoss(), **ENTRY_POINTS[entry_point],
        )  # fmt: skip
    assert module_fingerprint(model) == before
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_the_opacus_namespace_returns_the_criterion_given_in_ghost_mode(entry_point):
    criterion = nn.CrossEntropyLoss(label_smoothing=0.0)
    made = call(OpacusPrivacyEngine(accountant="rdp"), entry_point, "ghost", criterion=criterion)
    assert len(made) == 4
    module, optimizer, returned, loader = made
    assert isinstance(module, GhostClippingModule) and isinstance(optimizer, DPOptimizer)
    assert returned is criterion and isinstance(loader, DPDataLoader)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_the_opacus_namespace_default_criterion_follows_loss_reduction(loss_reduction):
    _, _, criterion, _ = call(OpacusPrivacyEngine(accountant="rdp"), "make_private", "ghost",
                              loss_reduction=loss_reduction)  # fmt: skip
    assert isinstance(criterion, nn.CrossEntropyLoss) and criterion.reduction == loss_reduction


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "no_op"])
def test_the_opacus_namespace_returns_three_values_outside_ghost_mode(mode):
    made = call(OpacusPrivacyEngine(accountant="rdp"), "make_private", mode, criterion=nn.CrossEntropyLoss())
    assert len(made) == 3 and isinstance(made[0], WRAPPER[mode])


def test_runtime_signatures_show_criterion_only_in_the_opacus_namespace():
    for name in ENTRY_POINTS:
        assert "criterion" not in inspect.signature(getattr(PrivacyEngine, name)).parameters
        assert "criterion" in inspect.signature(getattr(OpacusPrivacyEngine, name)).parameters


# A user's script; the test changes nothing in it but the mode.
SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from privacy_engine import PrivacyEngine

torch.manual_seed(0)
features = torch.randn(64, 10)
labels = (features[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(features, labels), batch_size=16)
criterion = nn.CrossEntropyLoss()

engine = PrivacyEngine(accountant="rdp")
model, optimizer, loader = engine.make_private(
    module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
    noise_seed=0, grad_sample_mode="{mode}",
)
for epoch in range(2):
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
epsilon = engine.get_epsilon(delta=1e-5)
"""


def test_a_script_switches_grad_sample_mode_with_no_other_change(tmp_path):
    runs = {}
    for mode in ("hooks", "functorch", "ghost"):
        script = tmp_path / f"train_{mode}.py"
        script.write_text(SCRIPT.replace("{mode}", mode))
        runs[mode] = runpy.run_path(str(script))
    reference = runs["hooks"]
    assert reference["engine"].accountant.steps == 2 * len(reference["loader"]) and reference["epsilon"] > 0
    for mode, run in runs.items():
        assert run["epsilon"] == reference["epsilon"], mode
        # Same seeds, same Poisson batches, same noise: the same model up to float rounding.
        for ours, theirs in zip(run["model"].parameters(), reference["model"].parameters()):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=mode)


def test_the_readme_block_runs_in_ghost_mode_by_uncommenting_one_line(tmp_path):
    """README's "Two added lines": uncomment its ``grad_sample_mode="ghost"`` line, keep the rest."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Two added lines"):]
    block = section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]
    assert '    # grad_sample_mode="ghost",' in block
    block = block.replace('    # grad_sample_mode="ghost",', '    grad_sample_mode="ghost",')
    loop = "for x, y in loader:\n    optimizer.zero_grad()\n    nn.functional.cross_entropy(model(x), y).backward()\n" \
           "    optimizer.step()\n"  # fmt: skip
    block = block.replace("# ... the usual training loop ...\n", loop)
    setup = (
        "import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "model = nn.Sequential(nn.Linear(6, 3))\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loader = DataLoader(TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,))), batch_size=8)\n"
    )
    script = tmp_path / "readme_ghost.py"
    script.write_text(setup + block)
    ran = runpy.run_path(str(script))
    assert isinstance(ran["model"], GhostClippingModule) and ran["engine"].accountant.steps == len(ran["loader"])
