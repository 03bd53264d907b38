"""A tutorial-style PyTorch training loop (the "quickstart" shape): a small CNN on random
FashionMNIST-sized images, a DataLoader, SGD, a few epochs of a few steps. Recorded by
``make_samples.py`` with ``gpu-trace record`` for ``sample_traces/runs/local-training``.

Runs on the CPU, or on the GPU of a `gpu-trace serve` server under ``record --remote``.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
#: Seconds to stop half-way (the two-tenant sample: an idle session its server pages out).
PAUSE_S = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
BATCH = 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = TensorDataset(torch.randn(STEPS * BATCH, 1, 28, 28), torch.randint(0, 10, (STEPS * BATCH,)))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    model = Net().to(device)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    for step, (x, y) in enumerate(loader):
        if PAUSE_S and step == STEPS // 2:
            time.sleep(PAUSE_S)
        x, y = x.to(device), y.to(device)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
