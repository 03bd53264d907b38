"""The pager on a real GPU: pinned host copies, device memory given back, side-stream restores
(pipelined and not) with the same values, views and training losses (skipped without a GPU)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

from gpu_trace import runtime
from gpu_trace.runtime.server.server import Server
from gpu_trace.runtime.sharing.sessions import Session

TOKEN = "pager-gpu-token-0123456789"


@pytest.fixture
def remote() -> Iterator[tuple[Server, torch.device]]:
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    with Server("127.0.0.1:0", token=TOKEN, device="cuda:0", idle_s=None) as server:
        dev = runtime.connect(server.address, token=TOKEN)
        try:
            yield server, dev
        finally:
            runtime.disconnect()


def _session(server: Server) -> Session:
    deadline = time.monotonic() + 30
    while len(server.sessions) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (session,) = server.sessions.values()
    return session


def _pinned(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is pinned for CUDA. Not ``t.is_pinned()``: that asks the process's
    accelerator, which in this process (a forwarding client too) is the ``remote`` backend, and
    it says no for every pointer. Naming the device is deprecated, but it is the one way to ask
    CUDA's host allocator."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return t.is_pinned("cuda")


def _finish(server: Server, session: Session) -> None:
    runtime.synchronize()
    with server.executor.lock:
        server.pager.settle(session, wait=True)
    assert not server.pager.is_paged(session)


@pytest.mark.parametrize("pipelined", [True, False])
def test_paged_out_to_pinned_memory_and_back(
    remote: tuple[Server, torch.device], pipelined: bool
) -> None:
    server, dev = remote
    server.pager.pipelined = pipelined
    g = torch.Generator().manual_seed(0)
    local = [torch.randn(n, generator=g) for n in (1 << 20, 3000, 1 << 18, 7)]
    tensors = [t.to(dev) for t in local]
    base = torch.arange(1000.0, device=dev)
    view = base[100:200].view(10, 10)
    runtime.synchronize()
    session = _session(server)
    handles = [t._rt.id for t in (*tensors, base, view)]
    before = torch.cuda.memory_allocated(0)
    freed = server.pager.request_page_out(session, reason="test")
    assert freed == session.account.paged_bytes == session.usage.evicted_bytes > 4 << 20
    assert before - torch.cuda.memory_allocated(0) >= freed - 512 * len(handles)
    for h in handles:
        t = session.handles.get(h)
        assert t.device.type == "cpu" and _pinned(t)
    out = server.pager.page_outs[-1]
    assert out.pinned and server.pager.pin_failures == 0
    assert out.bytes > 4 << 20 and out.copy_ns > 0 and out.bytes_per_s > 0
    view.mul_(-1)  # brings the session back, on the session's own stream
    doubled = [(t * 2).cpu() for t in tensors]  # ops on tensors coming back
    assert all(torch.equal(d, x * 2) for d, x in zip(doubled, local))
    _finish(server, session)
    for h in handles:
        assert session.handles.get(h).device.type == "cuda"
    sb, sv = session.handles.get(base._rt.id), session.handles.get(view._rt.id)
    assert sb.untyped_storage().data_ptr() == sv.untyped_storage().data_ptr()
    assert torch.equal(base.cpu()[100:200], -torch.arange(100.0, 200.0))
    assert all(torch.equal(t.cpu(), x) for t, x in zip(tensors, local))
    assert session.account.paged_bytes == session.usage.evicted_bytes == 0
    (stats,) = server.pager.restores
    assert stats.pipelined is pipelined and stats.bytes == freed
    assert stats.all_ns > 0 and stats.first_op_ns > 0 and stats.bytes_per_s > 0


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def _train(
    dev: Any, init: dict[str, torch.Tensor], steps: int, between: Callable[[], None]
) -> list[float]:
    model = _model()
    model.load_state_dict(init)  # not drawn here: the server in this process seeds torch too
    model = model.to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g).to(dev)
        y = torch.randint(0, 10, (32,), generator=g).to(dev)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        between()
    return losses


def test_training_paged_out_between_steps_is_bitwise_the_same_on_the_gpu(
    remote: tuple[Server, torch.device],
) -> None:
    server, dev = remote
    torch.manual_seed(0)
    runtime.synchronize()
    init = {k: v.clone() for k, v in _model().state_dict().items()}
    plain = _train(dev, init, 4, lambda: None)
    session = _session(server)

    def page_out() -> None:
        runtime.synchronize()
        assert server.pager.request_page_out(session, reason="test") > 0

    paged = _train(dev, init, 4, page_out)
    assert paged == plain
    assert session.usage.evictions == 4 and session.usage.restores == 3
