"""A seeded PyTorch program whose every printed value depends on the RNG streams it uses.

Run plain and under `gpu-trace record` by tests/integration/test_program_state.py: the output must
be identical. A module is called on a new thread and inside DataLoader workers (so recording makes
a buffer there), and Python's `random`, NumPy's and torch's generators are drawn from after
training and in the workers.
"""

import hashlib
import os
import random
import signal
import sys
import threading
import time
import warnings

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

random.seed(0)
np.random.seed(0)
torch.manual_seed(0)
torch.set_num_threads(1)


class Noisy(Dataset):
    """Items drawn from all three generators of the worker, through a module."""

    def __init__(self) -> None:
        self.jitter = nn.Linear(4, 4)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            x = self.jitter(torch.full((4,), float(i)) + torch.rand(4))
        return x + random.random() + float(np.random.rand()), torch.tensor(i % 2)


model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.25), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.CrossEntropyLoss()
loader = DataLoader(Noisy(), batch_size=8, shuffle=True, num_workers=2)
for _epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        print("loss", loss.item().hex())

pause = float(os.environ.get("SEEDED_PAUSE", "0"))
if pause:
    # Under `--torch op`, a top-level module call this long after the session began cycles the
    # profiler's session, and the flusher makes its spans while the program goes on drawing.
    time.sleep(pause)
    model.eval()
    with torch.no_grad():
        model(torch.ones(1, 4))  # eval: no dropout, no draw
    model.train()
    time.sleep(pause / 4)

out = {}


def side() -> None:
    out["y"] = model(torch.ones(2, 4)).sum().item()  # dropout: draws from torch's generator


t = threading.Thread(target=side)
t.start()
t.join()
print("thread", t.name, out["y"].hex())
print("random", random.random().hex(), random.getrandbits(64))
print("numpy", np.random.rand().hex())
print(
    "torch", torch.rand(1).item().hex(), hashlib.sha256(torch.get_rng_state().numpy()).hexdigest()
)
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(weights).hexdigest())
print("warnings", hashlib.sha256(repr(warnings.filters).encode()).hexdigest())
# Not recording's (its threads are named gpu-trace-*), nor the DataLoader's queue feeders, which
# end on their own shortly after the last batch, plain or not.
others = ("gpu-trace", "QueueFeederThread")
print("threads", sorted(t.name for t in threading.enumerate() if not t.name.startswith(others)))
print("sigint", signal.getsignal(signal.SIGINT), "path", sys.path)
