# ruff: noqa: PLR0402, C408  (Opacus's code, kept as Opacus writes it)
"""Opacus's tutorial guide_to_module_validator.ipynb: register BatchNorm validators and a fixer,
then ModuleValidator.is_valid / validate / fix. The notebook shows the calls on nn.Linear only; here
they also run on a small model with BatchNorm, which is then trained with make_private. The
notebook uses ShouldReplaceModuleError and a logger without importing them; both are imported here.
It registers validators globally; the test puts the registries back afterwards. Privacy-library calls
verbatim."""

import copy
import logging
import warnings

import torch
import torch.nn as nn
from opacus import PrivacyEngine
from opacus.validators import ModuleValidator, register_module_validator
from opacus.validators.errors import ShouldReplaceModuleError
from opacus.validators.utils import register_module_fixer
from torch.utils.data import DataLoader, TensorDataset

warnings.simplefilter("ignore")
logger = logging.getLogger(__name__)
torch.manual_seed(0)


@register_module_validator([nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm])
def validate_bathcnorm(module):
    return [Exception("BatchNorm is not supported")]


@register_module_validator([nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm])
def validate(module) -> None:
    return [
        ShouldReplaceModuleError(
            "BatchNorm cannot support training with differential privacy. "
            "The reason for it is that BatchNorm makes each sample's normalized value "
            "depend on its peers in a batch, ie the same sample x will get normalized to "
            "a different value depending on who else is in its batch."
        )
    ]


def _batchnorm_to_groupnorm(module) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, module.num_features), module.num_features, affine=module.affine)


@register_module_fixer([nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm])
def fix(module) -> nn.GroupNorm:
    logger.info("The default batch_norm fixer replaces BatchNorm with GroupNorm.")
    return _batchnorm_to_groupnorm(module)


model = torch.nn.Linear(2, 1)
if not ModuleValidator.is_valid(model):
    model = ModuleValidator.fix(model)
LINEAR_VALID = ModuleValidator.is_valid(model)

# The same calls on a model that needs the fixer.
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 2))
ERRORS_BEFORE = ModuleValidator.validate(model, strict=False)
VALID_BEFORE = ModuleValidator.is_valid(model)
if not ModuleValidator.is_valid(model):
    model = ModuleValidator.fix(model)
VALID_AFTER = ModuleValidator.is_valid(model)
FIXED_TYPES = [type(m).__name__ for m in model.modules()]

initial = copy.deepcopy(model.state_dict())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data_loader = DataLoader(TensorDataset(torch.randn(40, 3, 8, 8), torch.randint(0, 2, (40,))), batch_size=10)
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


# The notebook's last cell (it registers this fixer with register_module_validator, as written there).
@register_module_validator([nn.BatchNorm2d])
def fix_batchnorm2d(module):
    return nn.InstanceNorm2d(module.num_features)


RESULT = dict(engine=privacy_engine, delta=1e-5, model=model, initial=initial, losses=losses,
              linear_valid=LINEAR_VALID, errors_before=ERRORS_BEFORE, valid_before=VALID_BEFORE,
              valid_after=VALID_AFTER, fixed_types=FIXED_TYPES)
