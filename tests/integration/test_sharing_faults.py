"""One tenant's faults never reach another tenant: a client killed mid-training, a client that
disconnects with work in flight. The surviving tenant's losses stay bitwise those of a local run
and the dead tenant's memory is given back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from gpu_trace import runtime
from gpu_trace.runtime.client import admin_requests

ALICE = "alice-token-faults-0123456"
BOB = "bob-token-faults-0123456789"
OPS = "ops-token-faults-0123456789"
TENANTS = f"""\
[[tenant]]
name = "alice"
token = "{ALICE}"
memory = "256MiB"

[[tenant]]
name = "bob"
token = "{BOB}"
memory = "256MiB"

[[tenant]]
name = "ops"
token = "{OPS}"
admin = true
"""

# Bob trains forever on the server, saying "ready" once its session holds tensors.
BOB_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from gpu_trace import runtime
    dev = runtime.connect(sys.argv[1], token=sys.argv[2])
    model = torch.nn.Linear(256, 256).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256).to(dev)
    model(x).sum().item()
    print("ready", flush=True)
    while True:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    """
)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 10 * 10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def train(device: torch.device | str, steps: int, midway: object = None) -> list[float]:
    torch.manual_seed(0)
    model = CNN().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        if step == steps // 2 and callable(midway):
            midway()
        x = torch.randn(8, 1, 12, 12, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[str]:
    """A `gpu-trace serve --tenants` process (its own process: a server on the CPU device in
    the test's process would switch the test's own CPU random generator between sessions)."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    argv = [sys.executable, "-m", "gpu_trace", "serve", "--listen", "127.0.0.1:0", "--device"]
    argv += ["cpu", "--tenants", str(tenants), "--device-memory", "1GiB", "--metrics", "off"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    try:
        assert "serving cpu on" in line, line
        yield line.split(" on ")[1].split()[0]
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


def _wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _bob(address: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", BOB_SCRIPT, address, BOB],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "GPU_TRACE_REMOTE_TOKEN": ""},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _listing(address: str) -> tuple[dict[str, dict], list[str]]:
    """Each tenant's numbers, and the tenants of the live sessions (as an admin sees them)."""
    listing = admin_requests.list_sessions(address, OPS)
    tenants = {t["tenant"]: t for t in listing["tenants"]}
    return tenants, [s["tenant"] for s in listing["sessions"]]


def _bob_memory(address: str) -> int:
    return _listing(address)[0]["bob"]["memory_bytes"]


@pytest.mark.parametrize("how", ["SIGKILL", "disconnect"])
def test_a_tenant_dying_mid_training_leaves_the_other_bitwise_untouched(
    shared: str, how: str
) -> None:
    local = train("cpu", 8)
    bob = _bob(shared)
    try:
        assert _bob_memory(shared) > 0

        def end_bob() -> None:
            if how == "SIGKILL":
                bob.send_signal(signal.SIGKILL)
            else:  # its socket closes with batches in flight; the process goes on to exit
                bob.send_signal(signal.SIGTERM)
            bob.wait(timeout=30)

        dev = runtime.connect(shared, token=ALICE)
        try:
            remote = train(dev, 8, midway=end_bob)
            assert remote == local  # exact, step by step, while bob died beside it
            # With workers, bob's last report (memory 0) may come before his worker has ended
            # and his session left the listing: wait for both.
            _wait_for(lambda: _bob_memory(shared) == 0 and _listing(shared)[1] == ["alice"])
            tenants, live = _listing(shared)
            assert live == ["alice"]
            assert tenants["alice"]["memory_bytes"] > 0
            assert train(dev, 4) == train("cpu", 4)  # and alice's session goes on
        finally:
            runtime.disconnect()
    finally:
        if bob.poll() is None:
            bob.kill()
            bob.wait()
        assert bob.stdout is not None
        bob.stdout.close()
