"""A DCGAN step as pytorch/examples writes it: the discriminator trained on real images and on
the generator's fakes (detached), then the generator's graph, made before the discriminator's
step, backwarded through the updated discriminator."""

import hashlib

import torch
from torch import nn

NZ, NGF, NDF, NC = 8, 8, 8, 1


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NGF),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(999)
# "real" 16x16 images: blobs at random places, every batch drawn up front
real_batches = []
for _ in range(6):
    centers = torch.randint(3, 13, (16, 2)).float()
    grid = torch.stack(torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij"))
    d2 = ((grid[None] - centers[:, :, None, None]) ** 2).sum(1, keepdim=True)
    real_batches.append(torch.exp(-d2 / 6) * 2 - 1)
# weights_init draws on the device: from CUDA's generator on a GPU, the CPU's here. Each is
# seeded just before, so both draw the same numbers (module construction drew from the CPU's).
netG = Generator().to(device)
torch.manual_seed(1)
netG.apply(weights_init)
netD = Discriminator().to(device)
torch.manual_seed(2)
netD.apply(weights_init)
criterion = nn.BCELoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
torch.manual_seed(5)  # the noise's stream, on the device
real_label, fake_label = 1.0, 0.0
for i, data in enumerate(real_batches):
    # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
    netD.zero_grad()
    real = data.to(device)
    label = torch.full((real.size(0),), real_label, dtype=real.dtype, device=device)
    errD_real = criterion(netD(real), label)
    errD_real.backward()
    noise = torch.randn(real.size(0), NZ, 1, 1, device=device)
    fake = netG(noise)
    label.fill_(fake_label)
    errD_fake = criterion(netD(fake.detach()), label)
    errD_fake.backward()
    optimizerD.step()
    # (2) Update G: maximize log(D(G(z))), through the generator's graph made above
    netG.zero_grad()
    label.fill_(real_label)
    errG = criterion(netD(fake), label)
    errG.backward()
    optimizerG.step()
    print(i, "Loss_D", (errD_real + errD_fake).item().hex(), "Loss_G", errG.item().hex())
digest = hashlib.sha256()
for net in (netG, netD):
    for name, t in net.state_dict().items():
        digest.update(name.encode() + t.detach().cpu().numpy().tobytes())
print("weights", digest.hexdigest())
