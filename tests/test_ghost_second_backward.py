"""Ghost clipping and two backward passes through ONE forward (each reaching other layers).

Ghost clipping clips at the end of each backward pass from the norms that pass saw. A second backward
through the same forward (two heads, two losses, two ``backward()`` calls) would clip the same examples a
second time: one example could then move the release by sqrt(2) C, up to 2 C. Hooks mode sums the passes per
example before clipping (C). The engine refuses the second pass, naming the layer, before anything of it is
kept; summing the losses and calling backward once is exact. Written as the user's loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine

C = 1.0


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(3, 4)
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.a(h), self.b(h)


class HeadsWithoutTrunk(TwoHeads):
    def forward(self, x):
        return self.a(torch.tanh(x @ torch.ones(3, 4, dtype=x.dtype))), self.b(x @ torch.ones(3, 4, dtype=x.dtype))


def _private(model, mode, rows=1):
    torch.manual_seed(0)
    data = TensorDataset(100 * torch.randn(16, 3, dtype=torch.float64), torch.zeros(16))
    engine = PrivacyEngine()
    wrapped, optimizer, loader = engine.make_private(
        module=model.double(), optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=DataLoader(data, batch_size=rows),
        noise_multiplier=0.0, max_grad_norm=C, grad_sample_mode=mode, poisson_sampling=False, loss_reduction="sum",
    )  # fmt: skip
    return engine, wrapped, optimizer, loader


def _released_norm(model, before):
    return float(torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before))))


@pytest.mark.parametrize("model_type", [TwoHeads, HeadsWithoutTrunk])
def test_a_second_backward_through_one_forward_is_refused_in_ghost_mode(model_type):
    torch.manual_seed(1)
    model = model_type()
    engine, wrapped, optimizer, loader = _private(model, "ghost")
    x, _ = next(iter(loader))
    out_a, out_b = wrapped(x)
    out_a.pow(2).sum().backward(retain_graph=True)  # the shared trunk's graph is needed again
    with pytest.raises(RuntimeError, match=r"second backward pass (through one forward|ran through the same forward)"):
        out_b.pow(2).sum().backward()
    assert engine.accountant.steps == 0


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("model_type", [TwoHeads, HeadsWithoutTrunk])
def test_one_backward_of_the_summed_losses_releases_each_example_clipped_once(mode, model_type):
    torch.manual_seed(1)
    model = model_type()
    _, wrapped, optimizer, loader = _private(model, mode)
    x, _ = next(iter(loader))
    before = [p.detach().clone() for p in model.parameters()]
    out_a, out_b = wrapped(x)
    (out_a.pow(2).sum() + out_b.pow(2).sum()).backward()
    optimizer.step()
    # One example of norm >> C: the release (lr 1, sum reduction, noise off) is its clipped gradient.
    assert _released_norm(model, before) == pytest.approx(C, rel=1e-9)


def test_hooks_mode_sums_two_backwards_of_one_forward_before_clipping():
    torch.manual_seed(1)
    model = HeadsWithoutTrunk()  # (through a shared trunk, hooks mode refuses the second pass: retain_graph)
    _, wrapped, optimizer, loader = _private(model, "hooks")
    x, _ = next(iter(loader))
    before = [p.detach().clone() for p in model.parameters()]
    out_a, out_b = wrapped(x)
    out_a.pow(2).sum().backward()
    out_b.pow(2).sum().backward()
    optimizer.step()
    assert _released_norm(model, before) == pytest.approx(C, rel=1e-9)


def test_an_output_left_out_of_the_loss_does_not_block_the_next_step():
    torch.manual_seed(1)
    model = TwoHeads()
    engine, wrapped, optimizer, loader = _private(model, "ghost", rows=4)
    for step, (x, _) in enumerate(loader):
        out_a, _unused = wrapped(x)
        out_a.pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            break
    assert engine.accountant.steps == 3
