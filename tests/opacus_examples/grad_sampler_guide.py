# ruff: noqa: PLR0402, C408, UP035, UP006  (Opacus's code, kept as Opacus writes it)
"""Opacus's tutorial guide_to_grad_sampler.ipynb: wrap a layer in GradSampleModule, register a grad
sampler (for a custom linear layer here, so that the library's own nn.Linear sampler is left alone),
check it with check_per_sample_gradients_are_correct, and train with it. The notebook's sampler reads
``activations`` as a tensor (an older Opacus API); Opacus 1.6 passes the list of the layer's inputs,
so the sampler below takes ``activations[0]``, as Opacus 1.6's own linear sampler does. The notebook
does not train; here one make_private run uses the registered sampler. Privacy-library calls verbatim."""

import copy
import warnings
from typing import Dict

import torch
import torch.nn as nn
from opacus import PrivacyEngine
from opacus.grad_sample import GradSampleModule, register_grad_sampler
from opacus.utils.per_sample_gradients_utils import check_per_sample_gradients_are_correct
from torch.utils.data import DataLoader, TensorDataset

warnings.simplefilter("ignore")
torch.manual_seed(0)


class MyLinear(nn.Linear):
    """A user's own linear layer (the guide's example layer is nn.Linear itself)."""


lin_mod = MyLinear(42, 2)
print(f"Before wrapping: {lin_mod}")
gs_lin_mod = GradSampleModule(lin_mod)
print(f"After wrapping : {gs_lin_mod}")
gs_lin_mod.remove_hooks()

CALLS = []


@register_grad_sampler([MyLinear])
def compute_linear_grad_sample(
    layer: nn.Linear, activations: torch.Tensor, backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """
    Computes per sample gradients for ``nn.Linear`` layer
    Args:
        layer: Layer
        activations: Activations
        backprops: Backpropagations
    """
    CALLS.append(1)
    activations = activations[0]
    gs = torch.einsum("n...i,n...j->nij", backprops, activations)
    ret = {layer.weight: gs}
    if layer.bias is not None:
        ret[layer.bias] = torch.einsum("n...k->nk", backprops)
    return ret


N, Z, W = 10, 3, 5
x_shape = [N, Z, W]
x = torch.randn(x_shape)
model = MyLinear(W, W + 2)
CHECK_PASSED = check_per_sample_gradients_are_correct(x, model)
assert CHECK_PASSED  # This will fail only if the per sample gradients do not match the micro-batch gradients.
CALLS_IN_CHECK = len(CALLS)

model = nn.Sequential(MyLinear(W, 8), nn.ReLU(), nn.Flatten(), MyLinear(8 * Z, 2))
initial = copy.deepcopy(model.state_dict())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data_loader = DataLoader(TensorDataset(torch.randn(40, Z, W), torch.randint(0, 2, (40,))), batch_size=10)
privacy_engine = PrivacyEngine()
model, optimizer, data_loader = privacy_engine.make_private(
    module=model, optimizer=optimizer, data_loader=data_loader, noise_multiplier=1.0, max_grad_norm=1.0
)
losses = []
for xb, yb in data_loader:
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"ε = {privacy_engine.get_epsilon(1e-5):.2f}")

RESULT = dict(engine=privacy_engine, delta=1e-5, model=model, initial=initial, losses=losses,
              check_passed=CHECK_PASSED, sampler_calls=len(CALLS), sampler_calls_in_check=CALLS_IN_CHECK)
