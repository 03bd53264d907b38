"""Idle reclamation and fast switching on a real server on loopback: sessions paged out to host
memory and back, with real clients and real torch on the CPU device."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

from gpu_trace import runtime
from gpu_trace.runtime.protocol import auth, wire
from gpu_trace.runtime.protocol.wire import MsgType
from gpu_trace.runtime.server.server import Server
from gpu_trace.runtime.sharing.sessions import Session
from gpu_trace.runtime.sharing.tenants import Tenant

TOKEN = "pager-test-token-0123456789"
TOKEN_A = "pager-tenant-a-0123456789"
TOKEN_B = "pager-tenant-b-0123456789"


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached")
        time.sleep(0.005)


@pytest.fixture
def remote() -> Iterator[tuple[Server, torch.device]]:
    """A server (idle paging off) and the in-process forwarding client's device on it."""
    with Server("127.0.0.1:0", token=TOKEN, idle_s=None) as server:
        dev = runtime.connect(server.address, token=TOKEN)
        try:
            yield server, dev
        finally:
            runtime.disconnect()


def _only_session(server: Server) -> Session:
    _wait_for(lambda: len(server.sessions) == 1, "one session")
    (session,) = server.sessions.values()
    return session


def _page_out(server: Server, session: Session) -> int:
    runtime.synchronize()
    return server.pager.request_page_out(session, reason="test")


def _server_tensor(session: Session, t: torch.Tensor) -> torch.Tensor:
    return session.handles.get(t._rt.id)


# ---- training across page-outs -------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc1 = nn.Linear(4 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.c1(x))), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in Net().state_dict().items()}


def _train(
    device: Any,
    steps: int,
    init: dict[str, torch.Tensor],
    between: Callable[[], None] = lambda: None,
) -> list[float]:
    # The weights come from ``init``: a server in this process seeds torch's global generator
    # (``rt::seed``, a new session's stream) from its own thread, whenever its batches run.
    model = Net()
    model.load_state_dict(init)
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 1, 12, 12, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        between()
    return losses


@pytest.mark.parametrize("pipelined", [True, False])
def test_training_paged_out_between_steps_gives_the_same_losses(pipelined: bool) -> None:
    steps = 5
    init = _initial_state()
    local = _train("cpu", steps, init)
    with Server("127.0.0.1:0", token=TOKEN, idle_s=None) as server:
        dev = runtime.connect(server.address, token=TOKEN)
        try:
            unpaged = _train(dev, steps, init)
        finally:
            runtime.disconnect()
    with Server("127.0.0.1:0", token=TOKEN, idle_s=0.02) as server:
        server.pager.pipelined = pipelined
        dev = runtime.connect(server.address, token=TOKEN)
        try:
            session = _only_session(server)
            pager = server.pager

            def idle() -> None:  # wait, idle, until the sweeper has paged the session out
                _wait_for(
                    lambda: pager.is_paged(session) and not pager.is_restoring(session),
                    "idle page-out",
                )
                assert session.account.resident_bytes == 0
                assert session.account.paged_bytes == session.account.bytes > 0
                assert session.usage.evicted_bytes == session.account.paged_bytes

            paged = _train(dev, steps, init, idle)
        finally:
            runtime.disconnect()
    assert paged == unpaged == local  # exact float equality, step by step
    # Paged out after every step, and maybe mid-step too (the client paused for 20 ms).
    usage = session.usage
    assert usage.evictions >= steps
    assert usage.restores == usage.evictions - 1  # the last page-out is never restored
    restores = [r for r in pager.restores if r.session == session.id]
    assert len(restores) == usage.restores
    assert all(r.pipelined is pipelined and r.bytes > 0 and r.all_ns > 0 for r in restores)


# ---- views and aliasing --------------------------------------------------------------------------


def test_views_still_alias_their_base_after_a_restore(
    remote: tuple[Server, torch.device],
) -> None:
    client_server, dev = remote
    base = torch.arange(24, dtype=torch.float32, device=dev)
    view = base[4:16].view(3, 4)
    trans = view.t()
    z = torch.complex(torch.arange(4.0), torch.ones(4)).to(dev)
    zc = z.conj()
    other = torch.ones(5, device=dev)
    runtime.synchronize()
    session = _only_session(client_server)
    sb, sv, st_ = (_server_tensor(session, t) for t in (base, view, trans))
    ids = [id(x) for x in (sb, sv, st_)]
    assert _page_out(client_server, session) > 0
    assert client_server.pager.is_paged(session)
    assert sb.untyped_storage().data_ptr() == sv.untyped_storage().data_ptr()
    trans.mul_(10)  # through a view of a view: the batch brings the session back
    expected = torch.arange(24, dtype=torch.float32)
    expected[4:16].view(3, 4).t().mul_(10)
    assert torch.equal(base.cpu(), expected)
    assert torch.equal(view.cpu(), expected[4:16].view(3, 4))
    assert torch.equal(zc.cpu(), torch.complex(torch.arange(4.0), torch.ones(4)).conj())
    assert torch.equal(other.cpu(), torch.ones(5))
    runtime.synchronize()
    _wait_for(lambda: not client_server.pager.is_paged(session), "restore finished")
    # The same tensor objects on the server, sharing one storage again, on the device.
    sb2, sv2, st2 = (_server_tensor(session, t) for t in (base, view, trans))
    assert [id(x) for x in (sb2, sv2, st2)] == ids
    ptr = sb2.untyped_storage().data_ptr()
    assert sv2.untyped_storage().data_ptr() == ptr == st2.untyped_storage().data_ptr()
    assert sv2._base is sb2 and sv2._version == sb2._version
    assert _server_tensor(session, zc).is_conj()


# ---- pipelining ----------------------------------------------------------------------------------


def _hooked(server: Server) -> tuple[list[tuple[str, int]], threading.Event]:
    log: list[tuple[str, int]] = []
    first_op = threading.Event()
    lock = threading.Lock()

    def hook(event: str, index: int) -> None:
        with lock:
            log.append((event, index))
        if event == "op" and index == 0:
            first_op.set()

    server.pager.hook = hook
    return log, first_op


def test_pipelined_restore_runs_the_first_op_before_the_last_storage_is_back(
    remote: tuple[Server, torch.device],
) -> None:
    client_server, dev = remote
    tensors = [torch.full((1000,), float(i), device=dev) for i in range(8)]
    session = _only_session(client_server)
    assert _page_out(client_server, session) == 8 * 4000
    log, first_op = _hooked(client_server)
    order: list[list[int]] = []
    copier_waited = []

    def hook(event: str, index: int, inner: Any = client_server.pager.hook) -> None:
        if event == "copy" and index == 0:
            order.extend(client_server.pager.restore_order(session))
        if event == "copy" and index == len(order) - 1:
            # The copier holds back the last storage until the batch's first op has run: with
            # pipelining that happens; without, this would wait in vain.
            copier_waited.append(first_op.wait(30))
        inner(event, index)

    client_server.pager.hook = hook
    value = (tensors[3] * 2).sum().item()
    assert value == 6000.0
    with client_server.executor.lock:  # the copier finishes in the background
        client_server.pager.settle(session, wait=True)
    last = len(order) - 1
    assert copier_waited == [True], (log, order)
    assert order[0] == [tensors[3]._rt.id]  # the storage the first op needs comes back first
    assert log.index(("op", 0)) < log.index(("copied", last))
    assert ("copied", 0) in log[: log.index(("op", 0))]
    assert [t.sum().item() for t in tensors] == [1000.0 * i for i in range(8)]


def test_unpipelined_restore_brings_everything_back_before_the_first_op(
    remote: tuple[Server, torch.device],
) -> None:
    client_server, dev = remote
    client_server.pager.pipelined = False
    tensors = [torch.full((1000,), float(i), device=dev) for i in range(4)]
    session = _only_session(client_server)
    assert _page_out(client_server, session) > 0
    log, _ = _hooked(client_server)
    assert (tensors[2] + 1).sum().item() == 3000.0
    copied = [i for event, i in log if event == "copied"]
    assert len(copied) >= 4
    assert log.index(("op", 0)) > log.index(("copied", copied[-1]))
    (stats,) = client_server.pager.restores
    assert not stats.pipelined and stats.first_op_ns == stats.all_ns > 0


def test_graphs_kept_for_backward_stay_resident_and_backward_is_exact(
    remote: tuple[Server, torch.device],
) -> None:
    client_server, dev = remote
    init = {k: v.clone() for k, v in nn.LSTM(8, 16, batch_first=True).state_dict().items()}

    def run(device: Any, page: Callable[[], None]) -> tuple[float, list[torch.Tensor]]:
        lstm = nn.LSTM(8, 16, batch_first=True)
        lstm.load_state_dict(init)  # not drawn here: the server in this process seeds torch
        lstm = lstm.to(device)
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2)).to(device)
        out, _ = lstm(x)
        loss = out.square().mean()
        page()
        loss.backward()
        return loss.item(), [p.grad.cpu() for p in lstm.parameters()]

    session = _only_session(client_server)
    kept: list[int] = []

    def page() -> None:
        kept.append(_page_out(client_server, session))
        assert session.graphs  # rt::fn kept the LSTM's graph for backward

    remote = run(dev, page)
    local = run("cpu", lambda: None)
    assert remote[0] == local[0]
    assert all(torch.equal(a, b) for a, b in zip(remote[1], local[1]))
    assert kept and kept[0] > 0  # the parameters were paged out...
    assert session.usage.restores == 1  # ...and came back for backward


# ---- reclaim, accounting, spans ------------------------------------------------------------------


class Raw:
    """A protocol-level client (one session) of a given tenant."""

    def __init__(self, address: str, token: str, trace: bool = False) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.reader = wire.FrameReader(self.sock, wire.MAX_FRAME)
        self.writer = wire.FrameWriter(self.sock)
        mtype, body = self.reader.read()
        assert mtype == MsgType.CHALLENGE
        nonce = bytes.fromhex(json.loads(body)["nonce"])
        client = {"host": "test", **({"trace": "1"} if trace else {})}
        hello = {"v": wire.PROTOCOL_VERSION, "mac": auth.mac(token, nonce), "client": client}
        self.writer.send(wire.json_frame(MsgType.HELLO, hello))
        mtype, body = self.reader.read()
        assert mtype == MsgType.WELCOME, body
        self.session_id = json.loads(body)["session"]
        self.seq = 0

    def batch(self, ops: list, free: list | None = None) -> dict:
        self.seq += 1
        head = {"seq": self.seq, "ops": ops, "free": free or []}
        self.writer.send(*wire.split_frame(MsgType.BATCH, head, [b""]))
        while True:
            mtype, body = self.reader.read()
            if mtype == MsgType.DONE:
                done = json.loads(body)
                assert done["ok"], done
                return done
            if mtype == MsgType.ERROR:
                raise wire.ProtocolError(json.loads(body)["message"])

    def close(self) -> None:
        self.sock.close()


def _zeros(handle: int, n: int) -> list:
    return [
        "aten::zeros.default",
        [[n]],
        {"dtype": {"d": "float32"}, "device": {"v": "r"}},
        [handle],
    ]


@pytest.fixture
def tenant_server() -> Iterator[Server]:
    tenants = [Tenant(name="a", token=TOKEN_A), Tenant(name="b", token=TOKEN_B)]
    with Server("127.0.0.1:0", tenants=tenants, idle_s=None) as server:
        yield server


def test_reclaim_pages_out_other_tenants_idle_sessions_first(tenant_server: Server) -> None:
    server, pager = tenant_server, tenant_server.pager
    clients: dict[str, Raw] = {}
    sizes = (
        ("a1", TOKEN_A, 1000),
        ("a2", TOKEN_A, 2000),
        ("b1", TOKEN_B, 3000),
        ("b2", TOKEN_B, 4000),
    )
    try:
        for name, token, n in sizes:  # in this order: a1 is the least recently active
            c = clients[name] = Raw(server.address, token)
            c.batch([_zeros(1, n)])
        s = {name: server.sessions[c.session_id] for name, c in clients.items()}

        def reclaim(need: int) -> int:  # as the executor's thread does, making room for a1
            with server.executor.lock:
                return pager.reclaim(need, for_session=s["a1"], reason="capacity")

        def out() -> list[bool]:  # which sessions are paged out (not on their way back)
            return [pager.is_paged(x) and not pager.is_restoring(x) for x in s.values()]

        assert reclaim(1) == 3000 * 4  # another tenant's, least recently active: b1
        assert out() == [False, False, True, False]
        assert s["b1"].usage.evictions == 1 and s["b1"].account.resident_bytes == 0
        clients["b1"].batch([_zeros(2, 10)])  # b1 is back, and now more recent than b2
        assert reclaim(1) == 4000 * 4
        assert out() == [False, False, False, True]
        # Then the rest of tenant b, then a1's own tenant; never a1 itself.
        assert reclaim(10**9) == 3000 * 4 + 40 + 2000 * 4
        assert out() == [False, True, True, True]
        assert reclaim(10**9) == 0  # nothing idle is left
        assert s["b1"].usage.evictions == 2 and s["b1"].usage.restores == 1
    finally:
        for c in clients.values():
            c.close()


def test_a_tenants_idle_s_wins_over_the_servers_default() -> None:
    tenants = [Tenant(name="a", token=TOKEN_A, idle_s=0.02), Tenant(name="b", token=TOKEN_B)]
    with Server("127.0.0.1:0", tenants=tenants, idle_s=None) as server:
        a, b = Raw(server.address, TOKEN_A), Raw(server.address, TOKEN_B)
        try:
            a.batch([_zeros(1, 10)])
            b.batch([_zeros(1, 10)])
            sa, sb = server.sessions[a.session_id], server.sessions[b.session_id]
            _wait_for(lambda: sa.usage.evictions == 1, "tenant a paged out")
            assert server.pager.idle_limit_s(sa) == 0.02 and server.pager.idle_limit_s(sb) is None
            assert sb.usage.evictions == 0
        finally:
            a.close()
            b.close()


def test_accounting_of_a_page_out_and_restore_is_exact(tenant_server: Server) -> None:
    server = tenant_server
    c = Raw(server.address, TOKEN_A)
    try:
        c.batch(
            [
                _zeros(1, 1000),  # 4000 bytes
                ["aten::slice.Tensor", [{"h": 1}, 0, 10, 20], {}, [2]],  # a view: no bytes
                _zeros(3, 500),  # 2000 bytes
                _zeros(4, 250),  # 1000 bytes, freed while paged out
            ]
        )
        session = server.sessions[c.session_id]
        account, usage = session.account, session.usage
        assert account.bytes == 7000 and account.paged_bytes == 0
        assert server.pager.request_page_out(session) == 7000
        assert (account.bytes, account.paged_bytes, account.resident_bytes) == (7000, 7000, 0)
        assert (usage.evictions, usage.restores, usage.evicted_bytes) == (1, 0, 7000)
        assert server.memory.resident(session) == 0
        assert server.memory.snapshot()["a"]["used_bytes"] == 7000
        assert server.pager.request_page_out(session) == 0  # already out: nothing more
        assert usage.evictions == 1
        c.batch([], free=[4])  # frees only: no restore
        assert (account.bytes, account.paged_bytes, usage.evicted_bytes) == (6000, 6000, 6000)
        assert usage.restores == 0 and server.pager.is_paged(session)
        c.batch([["aten::add_.Scalar", [{"h": 2}, 1.0], {}, [None]]])
        with server.executor.lock:
            server.pager.settle(session, wait=True)
        assert (account.bytes, account.paged_bytes, account.resident_bytes) == (6000, 0, 6000)
        assert (usage.evictions, usage.restores, usage.evicted_bytes) == (1, 1, 0)
        assert not server.pager.is_paged(session)
        (stats,) = server.pager.restores
        assert (stats.bytes, stats.storages, stats.pipelined) == (6000, 2, True)
        assert stats.first_op_ns > 0 and stats.all_ns > 0
        t = session.handles.get(1)
        assert t[10:20].eq(1).all() and t[:10].eq(0).all()
    finally:
        c.close()


class _Captured:
    """An in-memory :class:`~gpu_trace.runtime.server.sink.Sink`: every session traced."""

    kind = "memory"
    server_device = ""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def accepts(self, client: dict[str, str]) -> bool:
        return client.get("trace") == "1"

    def export(self, session: Session, body: dict) -> None:
        self.bodies.append(body)

    def clock(self, session: Session, samples: list[tuple[int, int, int, int]]) -> None:
        pass

    def session_closed(self, session: Session) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_evict_and_restore_are_recorded_in_a_traced_session() -> None:
    sink = _Captured()
    with Server("127.0.0.1:0", token=TOKEN, idle_s=None, sink=sink) as server:
        c = Raw(server.address, TOKEN, trace=True)
        try:
            c.batch([_zeros(1, 100)])
            session = server.sessions[c.session_id]
            assert server.pager.request_page_out(session, reason="admin") == 400
            c.batch([["aten::neg.default", [{"h": 1}], {}, [2]]])
            with server.executor.lock:
                server.pager.settle(session, wait=True)
            spans = [s for b in sink.bodies for s in b["spans"]] + session.log.spans
            counters = [x for b in sink.bodies for x in b["counters"]] + session.log.counters
        finally:
            c.close()
    (evict,) = [s for s in spans if s[2] == "server/evict"]
    assert evict[6]["reason"] == "admin" and evict[6]["bytes"] == "400"
    (restore,) = [s for s in spans if s[2] == "server/restore"]
    assert restore[6]["bytes"] == "400" and restore[6]["pipelined"] == "1"
    assert restore[4] <= restore[5]
    by_metric = {(m, v) for m, _ts, v, labels in counters if labels.get("tenant") == "default"}
    assert ("evictions", 1.0) in by_metric and ("restores", 1.0) in by_metric
