# ruff: noqa: PLR0402, C408  (Opacus's code, kept as Opacus writes it)
"""Opacus's examples/dcgan.py, small: the DCGAN whose discriminator is trained privately (two
forwards, real and fake, before one backward), its generator non-privately through the private
discriminator, on synthetic 1x64x64 images. 60 images in batches of 16, so N is not a multiple of the
batch size (the engines' sample rates differ there: 16/60 here, 1/len(loader) = 1/4 in Opacus).
Only the privacy-library calls are kept verbatim."""

import copy
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.optim as optim
import torch.utils.data
from opacus import PrivacyEngine
from torch.utils.data import TensorDataset

opt = SimpleNamespace(
    workers=0, batch_size=16, imageSize=64, nz=8, ngf=8, ndf=8, epochs=1, lr=0.0002, beta1=0.5, ngpu=0,
    device="cpu", disable_dp=False, secure_rng=False, sigma=1.0, max_per_sample_grad_norm=1.0, delta=1e-5,
    num_images=60,
)
opt.__dict__.update(globals().get("SETTINGS", {}))
torch.manual_seed(0)
dataset = TensorDataset(torch.rand(opt.num_images, 1, 64, 64) * 2 - 1, torch.zeros(opt.num_images))
nc = 1
dataloader = torch.utils.data.DataLoader(dataset, num_workers=int(opt.workers), batch_size=opt.batch_size)
device = torch.device(opt.device)
ngpu = int(opt.ngpu)
nz = int(opt.nz)
ngf = int(opt.ngf)
ndf = int(opt.ndf)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        m.weight.data.normal_(0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        m.weight.data.normal_(1.0, 0.02)
        m.bias.data.fill_(0)


class Generator(nn.Module):
    def __init__(self, ngpu):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.GroupNorm(min(32, ndf * 8), ndf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, ndf * 4), ndf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, ndf * 2), ndf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, ndf), ndf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ngpu):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, ndf * 2), ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, ndf * 4), ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, ndf * 8), ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input):
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


netG = Generator(ngpu).to(device)
netG.apply(weights_init)
netD = Discriminator(ngpu).to(device)
netD.apply(weights_init)
initial = copy.deepcopy(netD.state_dict())
criterion = nn.BCELoss()
FIXED_NOISE = torch.randn(opt.batch_size, nz, 1, 1, device=device)
REAL_LABEL = 1.0
FAKE_LABEL = 0.0
optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

privacy_engine = PrivacyEngine(secure_mode=opt.secure_rng)
netD, optimizerD, dataloader = privacy_engine.make_private(
    module=netD,
    optimizer=optimizerD,
    data_loader=dataloader,
    noise_multiplier=opt.sigma,
    max_grad_norm=opt.max_per_sample_grad_norm,
)
optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

losses = []
for epoch in range(opt.epochs):
    for i, data in enumerate(dataloader, 0):
        optimizerD.zero_grad(set_to_none=True)
        real_data = data[0].to(device)
        batch_size = real_data.size(0)
        label_true = torch.full((batch_size,), REAL_LABEL, device=device)
        output = netD(real_data)
        errD_real = criterion(output, label_true)
        noise = torch.randn(batch_size, nz, 1, 1, device=device)
        fake = netG(noise)
        label_fake = torch.full((batch_size,), FAKE_LABEL, device=device)
        output = netD(fake.detach())
        errD_fake = criterion(output, label_fake)
        errD = errD_real + errD_fake
        errD.backward()
        optimizerD.step()
        optimizerD.zero_grad(set_to_none=True)

        optimizerG.zero_grad()
        label_g = torch.full((batch_size,), REAL_LABEL, device=device)
        output_g = netD(fake)
        errG = criterion(output_g, label_g)
        errG.backward()
        optimizerG.step()
        losses.append(errD.item())
        epsilon = privacy_engine.accountant.get_epsilon(delta=opt.delta)
        print(f"epoch: {epoch}, Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f} (ε = {epsilon:.2f})")

RESULT = dict(engine=privacy_engine, delta=opt.delta, model=netD, initial=initial, losses=losses)
