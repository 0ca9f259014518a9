# ruff: noqa: PLR0402, C408  (Opacus's code, kept as Opacus writes it)
"""Opacus's examples/cifar10.py, small: its convnet on synthetic 3x32x32 images, one process, with the
script's grad_sample_mode (hooks, functorch, ew, no_op) and --clip_per_layer / --optim / --lr-schedule
flags taken from SETTINGS. Only the privacy-library calls of the original are kept verbatim (imports
included: DPDDP and make_functional are imported at the top as in the original)."""

import copy
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import torch.utils.data
from opacus import PrivacyEngine
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.grad_sample.functorch import make_functional
from torch.func import grad_and_value, vmap
from torch.utils.data import TensorDataset

args = SimpleNamespace(
    grad_sample_mode="hooks", epochs=1, start_epoch=1, batch_size=16, lr=0.1, momentum=0.9, weight_decay=0,
    sigma=1.5, max_per_sample_grad_norm=10.0, disable_dp=False, secure_rng=False, delta=1e-5, optim="SGD",
    lr_schedule="cos", clip_per_layer=False, print_freq=10, num_examples=64,
)
args.__dict__.update(globals().get("SETTINGS", {}))
torch.manual_seed(0)
world_size = 1
device = "cpu"


def convnet(num_classes):
    return nn.Sequential(
        nn.Conv2d(3, 32, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(32, 64, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(64, 64, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(64, 128, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(start_dim=1, end_dim=-1),
        nn.Linear(128, num_classes, bias=True),
    )


def accuracy(preds, labels):
    return (preds == labels).mean()


def train(args, model, train_loader, optimizer, privacy_engine, epoch, device):
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses = []
    top1_acc = []

    if args.grad_sample_mode == "no_op":
        # Functorch prepare
        fmodel, _fparams = make_functional(model)

        def compute_loss_stateless_model(params, sample, target):
            batch = sample.unsqueeze(0)
            targets = target.unsqueeze(0)

            predictions = fmodel(params, batch)
            loss = criterion(predictions, targets)
            return loss

        ft_compute_grad = grad_and_value(compute_loss_stateless_model)
        ft_compute_sample_grad = vmap(ft_compute_grad, in_dims=(None, 0, 0))
        params = list(model.parameters())

    for i, (images, target) in enumerate(train_loader):
        images = images.to(device)
        target = target.to(device)
        output = model(images)

        if args.grad_sample_mode == "no_op":
            per_sample_grads, per_sample_losses = ft_compute_sample_grad(params, images, target)
            per_sample_grads = [g.detach() for g in per_sample_grads]
            loss = torch.mean(per_sample_losses)
            for p, g in zip(params, per_sample_grads):
                p.grad_sample = g
        else:
            loss = criterion(output, target)
            preds = np.argmax(output.detach().cpu().numpy(), axis=1)
            labels = target.detach().cpu().numpy()
            top1_acc.append(accuracy(preds, labels))
            loss.backward()

        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()

        if i % args.print_freq == 0 and not args.disable_dp:
            epsilon = privacy_engine.accountant.get_epsilon(delta=args.delta)
            print(f"\tTrain Epoch: {epoch} \tLoss: {np.mean(losses):.6f} (ε = {epsilon:.2f}, δ = {args.delta})")
    return losses


train_dataset = TensorDataset(torch.randn(args.num_examples, 3, 32, 32), torch.randint(0, 10, (args.num_examples,)))
generator = None
train_loader = torch.utils.data.DataLoader(
    train_dataset, batch_size=args.batch_size, generator=generator, num_workers=0, pin_memory=False
)
model = convnet(num_classes=10)
model = model.to(device)
initial = copy.deepcopy(model.state_dict())

if world_size > 1:
    model = DPDDP(model)

if args.optim == "SGD":
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
elif args.optim == "RMSprop":
    optimizer = optim.RMSprop(model.parameters(), lr=args.lr)
elif args.optim == "Adam":
    optimizer = optim.Adam(model.parameters(), lr=args.lr)

if args.clip_per_layer:
    n_layers = len([(n, p) for n, p in model.named_parameters() if p.requires_grad])
    max_grad_norm = [args.max_per_sample_grad_norm / np.sqrt(n_layers)] * n_layers
else:
    max_grad_norm = args.max_per_sample_grad_norm

privacy_engine = PrivacyEngine(secure_mode=args.secure_rng)
clipping = "per_layer" if args.clip_per_layer else "flat"
model, optimizer, train_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    noise_multiplier=args.sigma,
    max_grad_norm=max_grad_norm,
    clipping=clipping,
    grad_sample_mode=args.grad_sample_mode,
)

losses = []
for epoch in range(args.start_epoch, args.epochs + 1):
    if args.lr_schedule == "cos":
        lr = args.lr * 0.5 * (1 + np.cos(np.pi * epoch / (args.epochs + 1)))
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
    losses += train(args, model, train_loader, optimizer, privacy_engine, epoch, device)
    checkpoint = {"epoch": epoch + 1, "arch": "Convnet", "state_dict": model.state_dict(),
                  "optimizer": optimizer.state_dict()}

RESULT = dict(engine=privacy_engine, delta=args.delta, model=model, initial=initial, losses=losses,
              checkpoint=checkpoint)
