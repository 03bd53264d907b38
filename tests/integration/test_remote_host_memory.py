"""Host memory beside a forwarded session, as on a GPU: ``pin_memory()`` and
``DataLoader(pin_memory=True)``, ``non_blocking`` copies both ways, and DataLoader workers (fork
and spawn) next to the session, which a forked child must never touch. A real server on loopback
(CPU device)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_trace import runtime
from gpu_trace.runtime.client import cuda
from gpu_trace.runtime.protocol.errors import ServerGone
from tests import serving

TOKEN = "host-memory-test-token-0123"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    with serving.served(tmp_path_factory.mktemp("home"), TOKEN, device="cpu") as found:
        yield found


@pytest.fixture
def transparent(served: tuple[str, dict[str, str]]) -> Iterator[torch.device]:
    dev = runtime.connect(served[0], token=TOKEN)
    cuda.patch()
    try:
        yield dev
    finally:
        cuda.unpatch()
        runtime.disconnect()


@pytest.mark.usefixtures("transparent")
def test_pinned_tensors_and_non_blocking_copies() -> None:
    """Before: every ``pin_memory()`` raised NotImplementedError (the remote device, the
    process's accelerator, has no pinned allocator), as did ``pin_memory=True`` factories."""
    t = torch.arange(12.0).reshape(4, 3)
    p = t.pin_memory()
    assert p is not t and torch.equal(p, t) and p.stride() == t.stride()
    assert p.is_pinned() and p[1:].is_pinned() and not t.is_pinned()
    assert p.pin_memory() is p  # already pinned
    assert torch.empty(5, pin_memory=True).is_pinned()
    assert torch.zeros(2, 2, pin_memory=True).is_pinned()

    x = p.to("cuda", non_blocking=True)
    y = p.cuda(non_blocking=True)
    assert x.is_cuda and y.is_cuda and torch.equal((x + y).cpu(), 2 * t)
    back = (x * 3).to("cpu", non_blocking=True)
    into = torch.empty(4, 3).pin_memory()
    into.copy_(y - 1, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, 3 * t) and torch.equal(into, t - 1) and into.is_pinned()


def test_a_forked_child_leaves_the_parents_session_alone(
    transparent: torch.device,
) -> None:
    """A child forked after the session opened (a DataLoader worker) inherits its socket and
    state, not its threads. Before, the child's ``torch.manual_seed`` sent a batch on the
    parent's socket and the parent's session died (``DONE for unknown batch``). Now the child
    has no remote device (a clear error, as CUDA after a fork) and the parent goes on."""
    x = torch.arange(6.0, device="cuda")
    assert x.sum().item() == 15.0
    junk = x * 2  # freed in the child: must not reach the server either
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            os.close(read)
            torch.manual_seed(123)  # seeds the device too, unless it is in a bad fork
            del junk
            gc.collect()
            try:
                torch.ones(2, device="cuda")
                said = "no error"
            except ServerGone as exc:
                said = str(exc)
            bad = torch.remote._is_in_bad_fork()  # type: ignore[attr-defined]
            os.write(write, json.dumps({"said": said, "bad_fork": bad}).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child = json.loads(f.read())
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert child["bad_fork"] is True
    assert f"forked from process {os.getpid()}" in child["said"]
    assert "'spawn' start method" in child["said"]
    y = x + 1  # the parent's session is whole
    assert y.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    c = runtime.current()
    assert c is not None and c.broken is None


LOADER = """
import json, sys
import torch
from torch.utils.data import DataLoader, TensorDataset


def main(method):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(
        data, batch_size=16, shuffle=True, num_workers=2, pin_memory=True,
        multiprocessing_context=method,
    )
    losses, pinned = [], []
    for epoch in range(2):
        for x, y in loader:
            pinned.append(x.is_pinned() and y.is_pinned())
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    print("RESULT " + json.dumps({"losses": losses, "pinned": all(pinned), "device": str(x.device)}))


if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_and_pinned_batches_beside_a_forwarded_session(
    method: str, served: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    """`record --remote` of a training loop whose DataLoader has two workers and pins its
    batches: the losses are bitwise the CPU's; the batches arrive pinned; only the program holds
    a session (a spawned worker runs the recording's start-up too, and connects only if it
    uses the device). Before: fork killed the session (``ServerGone: bad message ... DONE for
    unknown batch``), and pinning raised NotImplementedError with either."""
    address, env = served
    prog = tmp_path / "loader.py"
    prog.write_text(textwrap.dedent(LOADER))
    local = subprocess.run(
        [sys.executable, str(prog), method], capture_output=True, text=True, timeout=300, env=env
    )
    expected = serving.result(local)
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "record", "--no-ingest", "--run-dir", str(run_dir),
         "--remote", address, "--", sys.executable, str(prog), method],
        capture_output=True, text=True, timeout=600, env={**env, "GPU_TRACE_NVTX": "off"},
    )  # fmt: skip
    got = serving.result(out)
    assert got["device"] == "remote:0" and got["pinned"] is True
    assert got["losses"] == expected["losses"]  # bitwise
    sessions = sorted(p.name for p in (run_dir / "stats").glob("server-*.json"))
    assert len(sessions) == 1, sessions
    assert "DONE for unknown batch" not in out.stderr
