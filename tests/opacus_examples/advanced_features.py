# ruff: noqa: C408  (Opacus's code, kept as Opacus writes it)
"""Opacus's tutorial intro_to_advanced_features.ipynb: make_private, then its pieces by hand:
GradSampleModule, forbid_accumulation_hook, DPDataLoader.from_data_loader, DPOptimizer with an
RDPAccountant step hook, and a DPOptimizer subclass with Laplace noise (the processed-flag helpers).
The notebook stops after defining each piece; here each one also takes a training step, so that the
test can check that it trains. Only the privacy-library calls are kept verbatim."""

import copy
import warnings

import torch
from opacus import GradSampleModule, PrivacyEngine
from opacus.accountants import RDPAccountant
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from opacus.privacy_engine import forbid_accumulation_hook
from torch import nn
from torch.distributions.laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

warnings.simplefilter("ignore")
torch.manual_seed(0)


class SampleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        x = self.fc1(x)
        x = self.fc2(x)
        return x


DATASET = TensorDataset(torch.randn(100, 16), torch.randint(0, 2, (100,)))

# ---------------------------------------------------------------- make_private
privacy_engine = PrivacyEngine()
model = SampleNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data_loader = DataLoader(DATASET, batch_size=10)
model, optimizer, data_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=data_loader,
    max_grad_norm=1.0,
    noise_multiplier=1.0,
)
print(f"After make_private(). Model:{type(model)}, Optimizer:{type(optimizer)}, DataLoader:{type(data_loader)}")

# ---------------------------------------------------------------- the pieces by hand
model = SampleNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data_loader = DataLoader(DATASET, batch_size=10)
model = GradSampleModule(model)
y = model(torch.randn(10, 16))
y.sum().backward()
grad = model.fc1.weight.grad
grad_sample = model.fc1.weight.grad_sample
grad_sample_aggregated = grad_sample.mean(dim=0)
GRAD_SAMPLE_MATCHES = torch.allclose(grad, grad_sample_aggregated)
print("Average grad_sample over 1st dimension. Equal to original: ", GRAD_SAMPLE_MATCHES)
model.zero_grad()

handle = model.register_forward_pre_hook(forbid_accumulation_hook)
model(torch.randn(10, 16)).sum().backward()
print("First backward successful")
try:
    model(torch.randn(10, 16)).sum().backward()
    SECOND_BACKWARD_REFUSED = False
except ValueError as error:
    SECOND_BACKWARD_REFUSED = True
    print("Second backward refused:", error)
model.zero_grad()
handle.remove()

dp_data_loader = DPDataLoader.from_data_loader(data_loader, distributed=False)
print("Is dataset the same: ", dp_data_loader.dataset == data_loader.dataset)
print(f"DPDataLoader length: {len(dp_data_loader)}, original: {len(data_loader)}")
data_loader = dp_data_loader
batch_sizes = [len(x) for x, y in dp_data_loader]
print("Batch sizes sampled:", batch_sizes)

sample_rate = 1 / len(data_loader)
expected_batch_size = int(len(data_loader.dataset) * sample_rate)
optimizer = DPOptimizer(
    optimizer=optimizer,
    noise_multiplier=1.0,
    max_grad_norm=1.0,
    expected_batch_size=expected_batch_size,
)
accountant = RDPAccountant()
optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))

initial = copy.deepcopy(model.state_dict())
criterion = nn.CrossEntropyLoss()
losses = []
for x, y in data_loader:
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"{len(accountant)} steps, ε = {accountant.get_epsilon(delta=1e-5):.2f} (RDP)")


# ---------------------------------------------------------------- custom noise by subclassing
class LaplaceDPOptimizer(DPOptimizer):
    def add_noise(self):
        laplace = Laplace(loc=0, scale=self.noise_multiplier * self.max_grad_norm)
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = laplace.sample(p.summed_grad.shape)
            p.grad = p.summed_grad + noise
            _mark_as_processed(p.summed_grad)


laplace_model = GradSampleModule(SampleNet())
laplace_optimizer = LaplaceDPOptimizer(
    optimizer=torch.optim.SGD(laplace_model.parameters(), lr=0.1),
    noise_multiplier=1.0,
    max_grad_norm=1.0,
    expected_batch_size=expected_batch_size,
)
laplace_initial = copy.deepcopy(laplace_model.state_dict())
for x, y in DPDataLoader.from_data_loader(DataLoader(DATASET, batch_size=10)):
    laplace_optimizer.zero_grad()
    criterion(laplace_model(x), y).backward()
    laplace_optimizer.step()

RESULT = dict(
    engine=privacy_engine, accountant=accountant, delta=1e-5, model=model, initial=initial, losses=losses,
    laplace_model=laplace_model, laplace_initial=laplace_initial, grad_sample_matches=GRAD_SAMPLE_MATCHES,
    second_backward_refused=SECOND_BACKWARD_REFUSED, batch_sizes=batch_sizes,
)
