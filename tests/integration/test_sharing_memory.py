"""Memory quotas and per-tenant accounting on a real server on loopback, with real clients.

Tenants here have tiny quotas (a few float32 tensors of 4096 elements, 16 KiB each). Clients
speak the protocol (several per test, of one tenant or of several) or are the real forwarding
client (``runtime.connect``), one per process.
"""

from __future__ import annotations

import gc
import itertools
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpu_trace import runtime
from gpu_trace.runtime.protocol import auth, wire
from gpu_trace.runtime.protocol.wire import MsgType
from gpu_trace.runtime.server.server import Server
from gpu_trace.runtime.sharing.tenants import Tenant

N = 4096  # elements of one test tensor
T = N * 4  # its bytes (float32)
LIMIT = 4 * T  # 64 KiB: four tensors

FAIL = Tenant("fail", "fail-token-0123456789", memory_bytes=LIMIT)
WAIT = Tenant("wait", "wait-token-0123456789", memory_bytes=LIMIT, on_quota="wait", wait_s=60)
HASTY = Tenant("hasty", "hasty-token-0123456789", memory_bytes=LIMIT, on_quota="wait", wait_s=0.3)
FREE = Tenant("free", "free-token-0123456789")  # no quota
TENANTS = [FAIL, WAIT, HASTY, FREE]


@pytest.fixture
def server() -> Iterator[Server]:
    with Server("127.0.0.1:0", tenants=TENANTS, device_memory=1 << 30) as srv:
        yield srv


_open: list[Client] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()


class Client:
    """A protocol-level client of one tenant; batches may be sent and answered separately."""

    def __init__(self, server: Server, tenant: Tenant, trace: bool = False) -> None:
        host, port = server.address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=20)
        _open.append(self)
        self.reader = wire.FrameReader(self.sock, wire.MAX_FRAME)
        self.writer = wire.FrameWriter(self.sock)
        mtype, body = self.reader.read()
        nonce = bytes.fromhex(json.loads(body)["nonce"])
        client = {"host": "test", "trace": "1"} if trace else {"host": "test"}
        hello = {"v": 1, "mac": auth.mac(tenant.token, nonce), "client": client}
        self.writer.send(wire.json_frame(MsgType.HELLO, hello))
        mtype, body = self.reader.read()
        assert mtype == MsgType.WELCOME, body
        self.welcome = json.loads(body)
        self.session = server.sessions[self.welcome["session"]]
        self.seq = 0
        self.handles = itertools.count(1)
        self.traces: list[dict[str, Any]] = []
        self.data: list[tuple[dict, bytearray]] = []

    def send(self, ops: list, free: list | None = None, blobs: list | None = None, data=b""):
        self.seq += 1
        head: dict[str, Any] = {"seq": self.seq, "ops": ops, "free": free or []}
        if blobs:
            head["blobs"] = blobs
        self.writer.send(*wire.split_frame(MsgType.BATCH, head, [data]))

    def until(self, want: int) -> dict:
        self.data = []
        while True:
            mtype, body = self.reader.read()
            if mtype == MsgType.DATA:
                head, data = wire.decode_split(body)
                self.data.append((head, bytearray(data)))
            elif mtype == MsgType.CHUNK:
                self.data[-1][1].extend(wire.decode_chunk(body)[2])
            elif mtype == MsgType.TRACE:
                self.traces.append(json.loads(body))
            elif mtype == MsgType.ERROR:
                raise wire.ProtocolError(json.loads(body)["message"])
            if mtype == want:
                return json.loads(body) if body else {}

    def batch(self, ops: list, **kw: Any) -> dict:
        self.send(ops, **kw)
        return self.until(MsgType.DONE)

    def ones_op(self, n: int = N) -> tuple[int, list]:
        h = next(self.handles)
        kwargs = {"dtype": {"d": "float32"}, "device": {"v": "r"}}
        return h, ["aten::ones.default", [[n]], kwargs, [h]]

    def ones(self, n: int = N) -> int:
        h, op = self.ones_op(n)
        done = self.batch([op])
        assert done["ok"], done
        return h

    def fetch(self, handle: int) -> torch.Tensor:
        done = self.batch([["rt::fetch", [{"h": handle}, 99], {}, None]])
        assert done["ok"], done
        head, data = self.data[0]
        from gpu_trace.runtime.protocol import values

        dt, shape, _ = values.tensor_meta(head["dtype"], head["shape"], head["nbytes"])
        return values.tensor_from_bytes(dt, shape, data)

    def bye(self) -> None:
        self.writer.send(wire.frame(MsgType.BYE))
        self.until(MsgType.BYE)

    def close(self) -> None:
        self.sock.close()
        if self in _open:
            _open.remove(self)


def _wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def _waiting(server: Server, tenant: Tenant) -> int:
    return server.memory.snapshot()[tenant.name]["waiting"]


# ---- fail ----------------------------------------------------------------------------------------


def test_over_quota_fails_the_op_with_used_asked_limit_and_the_session_goes_on(
    server: Server,
) -> None:
    c = Client(server, FAIL)
    held = [c.ones() for _ in range(4)]  # exactly the quota
    h, op = c.ones_op()
    done = c.batch([op])
    assert not done["ok"]
    error = done["error"]
    assert error["type"] == "QuotaError" and error["op"] == "aten::ones.default"
    assert error["quota"] == {
        "tenant": "fail",
        "used": LIMIT,
        "asked": T,
        "limit": LIMIT,
        "kind": "quota",
    }
    assert f"used {LIMIT} bytes + asked {T} bytes > limit {LIMIT} bytes" in error["message"]
    # An op whose output size is not an argument: sized by the server, refused before it ran.
    out = next(c.handles)
    done = c.batch([["aten::add.Tensor", [{"h": held[0]}, {"h": held[1]}], {}, [out]]])
    assert done["error"]["type"] == "QuotaError" and done["error"]["quota"]["asked"] == T
    assert c.session.account.bytes == LIMIT and len(c.session.handles) == 4
    # The session goes on: free, allocate again, values are right.
    c.batch([], free=held[:2])
    out = next(c.handles)
    assert c.batch([["aten::add.Tensor", [{"h": held[2]}, {"h": held[3]}], {}, [out]]])["ok"]
    assert torch.equal(c.fetch(out), torch.full((N,), 2.0))
    assert c.session.usage.quota_errors == 2
    assert server.memory.snapshot()["fail"]["used_bytes"] == 3 * T


def test_the_client_gets_quota_exceeded_at_its_next_sync_point(server: Server) -> None:
    dev = runtime.connect(server.address, token=FAIL.token)
    try:
        xs = [torch.ones(N, device=dev) for _ in range(6)]  # two too many; nothing waits yet
        with pytest.raises(runtime.QuotaExceeded) as info:
            runtime.synchronize()
        err = info.value
        assert isinstance(err, runtime.RemoteOpError)
        assert (err.tenant, err.used, err.asked, err.limit) == ("fail", LIMIT, T, LIMIT)
        assert "over its memory quota" in str(err) and "issued at" in str(err)
        # Frees go with the next batch; an op refused for memory first frees what the batch's
        # remaining ops do not name, so this fits.
        del xs
        gc.collect()
        assert (torch.ones(N, device=dev) * 2).sum().item() == 2.0 * N
        assert server.memory.snapshot()["fail"]["used_bytes"] < LIMIT
    finally:
        runtime.disconnect()


def test_uploads_count_against_the_quota(server: Server) -> None:
    c = Client(server, FAIL)
    big = torch.arange(5 * N, dtype=torch.float32)  # 80 KiB: more than the quota
    done = c.batch(
        [["aten::clone.default", [{"b": 1}], {}, [1]]],
        blobs=[[1, "float32", [5 * N], 5 * T]],
        data=big.numpy().tobytes(),
    )
    assert done["error"]["type"] == "QuotaError" and done["error"]["quota"]["asked"] == 5 * T
    small = torch.arange(N, dtype=torch.float32)
    done = c.batch(
        [["aten::clone.default", [{"b": 2}], {}, [2]]],
        blobs=[[2, "float32", [N], T]],
        data=small.numpy().tobytes(),
    )
    assert done["ok"], done
    assert torch.equal(c.fetch(2), small)
    assert c.session.account.bytes == T and c.session.blobs.pending_bytes == 0


def test_clients_of_one_tenant_share_its_quota(server: Server) -> None:
    c1, c2 = Client(server, FAIL), Client(server, FAIL)
    for _ in range(3):
        c1.ones()
    c2.ones()
    h, op = c2.ones_op()
    done = c2.batch([op])
    assert done["error"]["quota"]["used"] == LIMIT  # c1's bytes and c2's
    snap = server.memory.snapshot()["fail"]
    assert snap["used_bytes"] == LIMIT and snap["sessions"] == 2


def test_a_runaway_tenant_leaves_other_tenants_alone(server: Server) -> None:
    runaway, other = Client(server, FAIL), Client(server, FREE, trace=True)
    a, b = other.ones(), other.ones()
    refused = None
    for i in range(100):
        h, op = runaway.ones_op()
        done = runaway.batch([op])
        out = next(other.handles)
        theirs = other.batch([["aten::add.Tensor", [{"h": a}, {"h": b}], {"alpha": i}, [out]]])
        assert theirs["ok"], theirs
        assert torch.equal(other.fetch(out), torch.full((N,), 1.0 + i))
        other.batch([], free=[out])
        if not done["ok"]:
            refused = done["error"]
            break
    assert refused is not None and refused["type"] == "QuotaError" and i == 4
    snap = server.memory.snapshot()
    assert snap["free"]["used_bytes"] == 2 * T and snap["fail"]["used_bytes"] == LIMIT
    assert other.session.usage.quota_errors == 0 and runaway.session.usage.quota_errors == 1
    # The other tenant's run sees its own tenant's numbers only.
    other.bye()
    counters = [c for t in other.traces for c in t["counters"]]
    assert counters and {c[3]["tenant"] for c in counters} == {"free"}


# ---- wait ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["free", "close"])
def test_wait_mode_waits_until_another_session_of_the_tenant_frees(
    server: Server, how: str
) -> None:
    holder, waiter = Client(server, WAIT), Client(server, WAIT, trace=True)
    held = [holder.ones() for _ in range(3)]
    x, make_x = waiter.ones_op()
    y, make_y = waiter.ones_op()
    z = next(waiter.handles)
    waiter.send(
        [
            make_x,
            make_y,  # 80 KiB with x: waits here
            ["aten::add.Tensor", [{"h": x}, {"h": y}], {}, [z]],
            ["aten::sum.default", [{"h": z}], {}, [z + 1]],
            ["aten::_local_scalar_dense.default", [{"h": z + 1}], {}, None],
        ]
    )
    _wait_for(lambda: _waiting(server, WAIT) == 1)
    other = Client(server, FREE)  # another tenant's work runs meanwhile
    assert torch.equal(other.fetch(other.ones()), torch.ones(N))
    assert _waiting(server, WAIT) == 1
    if how == "free":
        assert holder.batch([], free=held)["ok"]
    else:
        holder.close()
    done = waiter.until(MsgType.DONE)
    assert done["ok"], done
    assert done["results"] == {"4": 2.0 * N}
    assert torch.equal(waiter.fetch(z), torch.full((N,), 2.0))
    assert waiter.session.usage.quota_waits == 1 and waiter.session.usage.quota_errors == 0
    assert _waiting(server, WAIT) == 0
    waiter.bye()
    spans = [s for t in waiter.traces for s in t["spans"] if s[2] == "server/quota-wait"]
    assert len(spans) == 1
    attrs = spans[0][6]
    assert attrs["reason"] == "quota" and attrs["outcome"] == "ran"
    assert (attrs["asked"], attrs["used"], attrs["limit"]) == (str(T), str(LIMIT), str(LIMIT))
    assert spans[0][4] <= spans[0][5]


def test_a_seeded_op_that_waited_draws_the_same_numbers(server: Server) -> None:
    holder, waiter = Client(server, WAIT), Client(server, WAIT)
    held = [holder.ones() for _ in range(3)]
    x = waiter.ones()
    r = next(waiter.handles)
    # rand_like is refused before it runs (sized by the server), and runs once there is room,
    # drawing what it would have drawn.
    waiter.send(
        [
            ["rt::seed", [123], {}, None],
            ["aten::rand_like.default", [{"h": x}], {}, [r]],
        ]
    )
    _wait_for(lambda: _waiting(server, WAIT) == 1)
    assert waiter.session.account.bytes == T
    holder.batch([], free=held[:1])
    assert waiter.until(MsgType.DONE)["ok"]
    expected = torch.rand(N, generator=torch.Generator().manual_seed(123))
    assert torch.equal(waiter.fetch(r), expected)


def test_a_wait_runs_out_after_wait_s(server: Server) -> None:
    holder, waiter = Client(server, HASTY), Client(server, HASTY)
    for _ in range(3):
        holder.ones()
    h, op = waiter.ones_op(2 * N)
    done = waiter.batch([op])
    assert done["error"]["type"] == "QuotaError"
    assert "waited 0.3 s" in done["error"]["message"]
    assert done["error"]["quota"]["asked"] == 2 * T
    assert waiter.session.usage.quota_waits == 1 and waiter.session.usage.quota_errors == 1
    assert _waiting(server, HASTY) == 0
    assert waiter.ones()  # goes on


def test_waiting_that_cannot_help_fails_at_once(server: Server) -> None:
    alone = Client(server, WAIT)
    for _ in range(3):
        alone.ones()
    h, op = alone.ones_op(2 * N)
    done = alone.batch([op])
    message = done["error"]["message"]
    assert done["error"]["type"] == "QuotaError"
    assert f"waiting cannot help: this session alone would hold {5 * T} bytes" in message
    assert alone.session.usage.quota_waits == 0
    # Another session that holds nothing cannot free anything either.
    Client(server, WAIT)
    h, op = alone.ones_op(2 * N)
    assert "waiting cannot help" in alone.batch([op])["error"]["message"]


# ---- accounting ----------------------------------------------------------------------------------


def test_usage_counts_ops_batches_bytes_and_time(server: Server) -> None:
    c = Client(server, FREE, trace=True)
    small = torch.arange(1000, dtype=torch.float32)
    done = c.batch(
        [["aten::clone.default", [{"b": 1}], {}, [1]]],
        blobs=[[1, "float32", [1000], 4000]],
        data=small.numpy().tobytes(),
    )
    assert done["ok"], done
    big = torch.randn(300_000)  # 1.2 MB: PUT and CHUNKs
    data = big.numpy().tobytes()
    c.writer.send(
        wire.json_frame(
            MsgType.PUT, {"blob": 2, "dtype": "float32", "shape": [300_000], "nbytes": len(data)}
        ),
        *wire.chunk_frames(2, memoryview(data)),
    )
    ops = [
        ["aten::clone.default", [{"b": 2}], {}, [2]],
        ["aten::mul.Tensor", [{"h": 2}, {"h": 2}], {}, [3]],
        ["aten::sum.default", [{"h": 3}], {}, [4]],
    ]
    assert c.batch(ops)["ok"]
    assert torch.equal(c.fetch(1), small)
    usage = c.session.usage
    assert usage.bytes_in == 4000 + len(data)
    assert usage.bytes_out == 4000
    assert (usage.batches, usage.ops) == (3, 5)
    assert usage.busy_ns > 0 and usage.queue_ns >= 0
    assert usage.last_active_ns > 0
    assert server.memory.snapshot()["free"]["used_bytes"] == 4000 + 2 * len(data) + 4
    c.bye()
    last: dict[str, float] = {}
    for t in c.traces:
        for metric, _ts, value, labels in t["counters"]:
            assert labels["tenant"] == "free"
            last[metric] = value
    assert {"session_memory_bytes", "tenant_memory_bytes", "busy_ns", "queue_wait_ns"} <= set(last)
    assert "quota_bytes" not in last  # no quota


def test_quota_counters_in_a_traced_run(server: Server) -> None:
    c = Client(server, WAIT, trace=True)
    c.ones()
    c.bye()
    counters = {c[0]: c for t in c.traces for c in t["counters"]}
    assert counters["quota_bytes"][2] == LIMIT
    assert counters["quota_bytes"][3] == {"tenant": "wait"}
    assert counters["tenant_memory_bytes"][2] == T
    assert counters["session_memory_bytes"][3] == {"session": str(c.session.id), "tenant": "wait"}


# ---- the device's capacity -----------------------------------------------------------------------

X = Tenant("x", "x-token-0123456789abc")
Y = Tenant("y", "y-token-0123456789abc")


def test_a_full_device_pages_idle_sessions_out_before_refusing() -> None:
    with Server("127.0.0.1:0", tenants=[X, Y], device_memory=4 * T) as srv:
        idle, busy = Client(srv, X), Client(srv, Y)
        held = [idle.ones() for _ in range(3)]
        big = busy.ones(2 * N)  # 5 T on a device of 4 T: the idle session is paged out
        snap = srv.memory.snapshot()
        assert snap["x"]["used_bytes"] == 3 * T and snap["x"]["resident_bytes"] == 0
        assert snap["y"]["resident_bytes"] == 2 * T
        assert idle.session.usage.evictions == 1
        # The idle session comes back (making room in turn) with its values; the storages its
        # batch did not use land in the background (the restore is pipelined).
        assert torch.equal(idle.fetch(held[0]), torch.ones(N))
        _wait_for(lambda: srv.memory.snapshot()["x"]["resident_bytes"] == 3 * T)
        assert torch.equal(busy.fetch(big), torch.ones(2 * N))


def test_more_than_the_device_fails_with_the_capacity() -> None:
    with Server("127.0.0.1:0", tenants=[X, Y], device_memory=4 * T) as srv:
        c = Client(srv, X)
        h, op = c.ones_op(5 * N)
        done = c.batch([op])
        assert done["error"]["type"] == "QuotaError"
        assert done["error"]["quota"] == {
            "tenant": "x",
            "used": 0,
            "asked": 5 * T,
            "limit": 4 * T,
            "kind": "capacity",
        }
        assert "device memory is full" in done["error"]["message"]
