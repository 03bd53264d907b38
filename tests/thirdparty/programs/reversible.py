"""Reversible residual layers as Reformer's and RevNet's implementations write them: a custom
autograd.Function keeps no activations and, in its backward, recomputes each half from the
layer's output and calls Tensor.backward on it to get the gradients."""

import hashlib

import torch
from torch import nn


class RevFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, f, g):
        x1, x2 = x.chunk(2, dim=-1)
        with torch.no_grad():
            y1 = x1 + f(x2)
            y2 = x2 + g(y1)
        ctx.f, ctx.g = f, g
        y = torch.cat([y1, y2], dim=-1)
        ctx.save_for_backward(y.detach())
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        y1, y2 = y.chunk(2, dim=-1)
        dy1, dy2 = dy.chunk(2, dim=-1)
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gy1 = ctx.g(y1)
            gy1.backward(dy2)  # the g layer's parameters get their gradients here
        with torch.no_grad():
            x2 = y2 - gy1
            dx1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_()
            fx2 = ctx.f(x2)
            fx2.backward(dx1)
        with torch.no_grad():
            dx2 = dy2 + x2.grad
        return torch.cat([dx1, dx2], dim=-1), None, None


class RevBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())
        self.g = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())

    def forward(self, x):
        return RevFunction.apply(x, self.f, self.g)


class RevNet(nn.Module):
    def __init__(self, d=32, depth=4):
        super().__init__()
        self.embed = nn.Linear(8, 2 * d)
        self.blocks = nn.ModuleList(RevBlock(d) for _ in range(depth))
        self.head = nn.Linear(2 * d, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
x = torch.randn(256, 8)
y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
model = RevNet().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(8):
    batch = slice(step % 4 * 64, step % 4 * 64 + 64)
    loss = nn.functional.cross_entropy(model(x[batch].to(device)), y[batch].to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print("step", step, "loss", loss.item().hex())
digest = hashlib.sha256()
for name, t in model.state_dict().items():
    digest.update(name.encode() + t.detach().cpu().numpy().tobytes())
print("weights", digest.hexdigest())
