"""A program that profiles itself as PyTorch's profiler recipe does: torch.profiler.profile with
stacks and memory over a few training steps, then key_averages() (grouped by input shape and by
stack too). What it prints is exact: losses, the weights' hash, the ATen ops the profile counted,
whether it saw memory events, and how many of its stacks hold a frame of gpu-trace's flusher."""

import hashlib
import sys

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        return self.out(self.body(x))


device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
model = MLP().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(i):
    loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print("step", i, "loss", loss.item().hex())


step(0)  # one step first: PyTorch imports at its first record_function (see docs/frameworks.md)
with profile(
    activities=[ProfilerActivity.CPU], with_stack=True, profile_memory=True, record_shapes=True
) as prof:
    for i in range(1, 4):
        with record_function("train_step"):
            step(i)
averages = prof.key_averages()
print(averages.table(sort_by="self_cpu_time_total", row_limit=8), file=sys.stderr)
print(prof.key_averages(group_by_input_shape=True).table(row_limit=3), file=sys.stderr)
by_stack = prof.key_averages(group_by_stack_n=5)
print(by_stack.table(sort_by="self_cpu_time_total", row_limit=3), file=sys.stderr)
ops = sorted((e.key, e.count) for e in averages if e.key.startswith("aten::"))
print("ops", ops)
print("train_step", [e.count for e in averages if e.key == "train_step"])
print("memory events", any(e.cpu_memory_usage or e.device_memory_usage for e in prof.events()))
print("flusher frames", sum(any("tracer/background" in f for f in e.stack) for e in prof.events()))
digest = hashlib.sha256()
for name, t in model.state_dict().items():
    digest.update(name.encode() + t.detach().cpu().numpy().tobytes())
print("weights", digest.hexdigest())
