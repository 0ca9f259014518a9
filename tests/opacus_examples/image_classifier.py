# ruff: noqa: PLR0402, C408  (Opacus's code, kept as Opacus writes it)
"""Opacus's tutorial building_image_classifier.ipynb, small: a ResNet with BatchNorm (a two-stage
ResNet-18-style network standing in for torchvision's resnet18, which is not a dependency), fixed with
ModuleValidator, made private with make_private_with_epsilon and trained with BatchMemoryManager and
RMSprop on synthetic CIFAR-shaped images. Only the privacy-library calls are kept verbatim."""

import copy
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.validators import ModuleValidator
from torch.utils.data import TensorDataset

warnings.simplefilter("ignore")
SETTINGS = globals().get("SETTINGS", {})
torch.manual_seed(0)
MAX_GRAD_NORM = 1.2
EPSILON = 8.0  # 50 in the notebook (its 20 epochs); a tighter target keeps this small run's accounting fast
DELTA = 1e-5
EPOCHS = SETTINGS.get("epochs", 1)
LR = 1e-3
BATCH_SIZE = 16
MAX_PHYSICAL_BATCH_SIZE = 8


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def resnet18(num_classes=10, width=8):
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        BasicBlock(width, width), BasicBlock(width, 2 * width, stride=2),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(2 * width, num_classes),
    )


train_dataset = TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=BATCH_SIZE)

model = resnet18(num_classes=10)
errors = ModuleValidator.validate(model, strict=False)
print(errors[-5:])
model = ModuleValidator.fix(model)
remaining = ModuleValidator.validate(model, strict=False)
assert remaining == [], remaining

device = torch.device("cpu")
model = model.to(device)
initial = copy.deepcopy(model.state_dict())
criterion = nn.CrossEntropyLoss()
optimizer = optim.RMSprop(model.parameters(), lr=LR)


def accuracy(preds, labels):
    return (preds == labels).mean()


privacy_engine = PrivacyEngine()
model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    epochs=EPOCHS,
    target_epsilon=EPSILON,
    target_delta=DELTA,
    max_grad_norm=MAX_GRAD_NORM,
)
print(f"Using sigma={optimizer.noise_multiplier} and C={MAX_GRAD_NORM}")


def train(model, train_loader, optimizer, epoch, device):
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses, top1_acc = [], []
    with BatchMemoryManager(
        data_loader=train_loader, max_physical_batch_size=MAX_PHYSICAL_BATCH_SIZE, optimizer=optimizer
    ) as memory_safe_data_loader:
        for i, (images, target) in enumerate(memory_safe_data_loader):
            optimizer.zero_grad()
            images = images.to(device)
            target = target.to(device)
            output = model(images)
            loss = criterion(output, target)
            preds = np.argmax(output.detach().cpu().numpy(), axis=1)
            labels = target.detach().cpu().numpy()
            top1_acc.append(accuracy(preds, labels))
            losses.append(loss.item())
            loss.backward()
            optimizer.step()
    epsilon = privacy_engine.get_epsilon(DELTA)
    print(f"\tTrain Epoch: {epoch} \tLoss: {np.mean(losses):.6f} (ε = {epsilon:.2f}, δ = {DELTA})")
    return losses


losses = []
for epoch in range(EPOCHS):
    losses += train(model, train_loader, optimizer, epoch + 1, device)

RESULT = dict(engine=privacy_engine, delta=DELTA, model=model, initial=initial, losses=losses,
              target_epsilon=EPSILON, validation_errors=errors)
