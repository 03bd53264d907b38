"""The pager's host memory: pinned where the device is CUDA (never on the CPU device, where a CPU
build of torch cannot pin), pageable when pinning fails, and each page-out's and restore's
bandwidth recorded. A real server on loopback, CPU device; the CUDA decision through the pager's
``pin`` seam (tests/gpu/test_pager_gpu.py checks the real pinned copies)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from gpu_trace import runtime
from gpu_trace.runtime.server.server import Server
from gpu_trace.runtime.sharing.pager import Pager
from gpu_trace.runtime.sharing.scheduler import PolicyScheduler
from gpu_trace.runtime.sharing.sessions import Session

TOKEN = "pager-pinning-token-0123456789"


@pytest.fixture
def remote() -> Iterator[tuple[Server, torch.device]]:
    with Server("127.0.0.1:0", token=TOKEN, idle_s=None) as server:
        dev = runtime.connect(server.address, token=TOKEN)
        try:
            yield server, dev
        finally:
            runtime.disconnect()


def _session(server: Server) -> Session:
    deadline = time.monotonic() + 30  # a hang guard, not a timing assertion
    while len(server.sessions) != 1:
        assert time.monotonic() < deadline, "no session"
        time.sleep(0.005)
    (session,) = server.sessions.values()
    return session


def test_host_copies_are_pinned_where_the_device_is_cuda() -> None:
    def pager(device: str) -> Pager:
        return Pager(device, threading.Lock(), PolicyScheduler(), lambda: [], idle_s=None)

    assert pager("cuda:0").pin is True  # made without touching a device: no GPU needed
    assert pager("cuda").pin is True
    assert pager("cpu").pin is False


def test_a_page_out_that_cannot_pin_uses_pageable_memory_and_says_so_once(
    remote: tuple[Server, torch.device], caplog: pytest.LogCaptureFixture
) -> None:
    # The CUDA decision on this CPU build: pinning raises here, so the pager must have tried.
    server, dev = remote
    pager = server.pager
    pager.pin = True
    local = [torch.arange(1000.0), torch.arange(3.0)]
    tensors = [t.to(dev) for t in local]
    runtime.synchronize()
    session = _session(server)
    with caplog.at_level(logging.WARNING, logger="gpu_trace.runtime.sharing.pager"):
        assert pager.request_page_out(session, reason="test") > 0
        stats = pager.page_outs[-1]
        assert stats.pinned is False and pager.pin_failures == 2
        assert all(session.handles.get(t._rt.id).device.type == "cpu" for t in tensors)
        assert [t.cpu().tolist() for t in tensors] == [t.tolist() for t in local]
        runtime.synchronize()
        assert pager.request_page_out(session, reason="test") > 0
    assert pager.pin_failures == 4
    assert len([r for r in caplog.records if "could not pin" in r.getMessage()]) == 1


def test_page_outs_and_restores_report_their_bandwidth(
    remote: tuple[Server, torch.device],
) -> None:
    server, dev = remote
    pager = server.pager
    tensors = [torch.ones(n).to(dev) for n in (1 << 16, 100, 7)]
    runtime.synchronize()
    session = _session(server)
    freed = pager.request_page_out(session, reason="test")
    assert freed > 0
    out = pager.page_outs[-1]
    assert out.pinned is False and pager.pin_failures == 0  # the CPU device never pins
    assert out.bytes == sum(t.numel() * 4 for t in tensors) and out.storages == 3
    assert out.copy_ns > 0 and out.all_ns >= out.copy_ns and out.bytes_per_s > 0
    assert (tensors[0] * 2).sum().item() == 2 * (1 << 16)  # brings the session back
    with server.executor.lock:
        pager.settle(session, wait=True)
    back = pager.restores[-1]
    assert back.bytes == freed and back.bytes_per_s == back.bytes * 1e9 / back.all_ns
