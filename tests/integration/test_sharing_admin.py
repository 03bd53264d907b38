"""A shared server with several tenants on loopback: tokens name tenants, a wrong token is refused
the same way whatever tenants exist, who sees which sessions, eviction, and /metrics scraped over
HTTP and parsed."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from gpu_trace import cli, runtime
from gpu_trace.runtime.client import admin_requests
from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.client.connection import Connection
from gpu_trace.runtime.protocol import auth, wire
from gpu_trace.runtime.protocol.wire import MsgType
from gpu_trace.runtime.server import admin
from gpu_trace.runtime.server.metrics import MetricsServer
from gpu_trace.runtime.server.server import Server
from gpu_trace.runtime.sharing.tenants import Tenant

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789xyz"
OPS = "ops-token-0123456789abc"
CAPACITY = 1 << 30
TENANTS = [
    Tenant("alice", ALICE, memory_fraction=0.5, weight=2.0),
    Tenant("bob", BOB, memory_bytes=64 << 20, priority=1),
    Tenant("ops", OPS, admin=True),
]


@pytest.fixture
def shared() -> Iterator[Server]:
    with Server("127.0.0.1:0", tenants=TENANTS, device_memory=CAPACITY) as server:
        yield server


@pytest.fixture
def alice(shared: Server) -> Iterator[torch.device]:
    dev = runtime.connect(shared.address, token=ALICE)
    yield dev
    runtime.disconnect()


@pytest.fixture
def bob(shared: Server) -> Iterator[Connection]:
    conn = Connection(shared.address, token=BOB)
    yield conn
    conn.close()


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _refusal(address: str, mac: str) -> bytes:
    """The raw frame a server answers a HELLO carrying ``mac`` with."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        reader = wire.FrameReader(sock, wire.MAX_FRAME)
        writer = wire.FrameWriter(sock)
        assert reader.read()[0] == MsgType.CHALLENGE
        hello = {"v": wire.PROTOCOL_VERSION, "mac": mac, "client": {"host": "test"}}
        writer.send(wire.json_frame(MsgType.HELLO, hello))
        mtype, body = reader.read()
        assert mtype == MsgType.ERROR
        return body


# ---- authentication ------------------------------------------------------------------------------


def test_a_token_says_which_tenant_a_client_is(
    shared: Server, alice: torch.device, bob: Connection
) -> None:
    assert rt.conn is not None and rt.conn.tenant == "alice"
    assert bob.tenant == "bob"
    tenants = {s.tenant.name: s.tenant for s in shared.sessions.values()}
    assert tenants == {"alice": TENANTS[0], "bob": TENANTS[1]}


def test_a_wrong_token_gets_the_same_refusal_whatever_tenants_exist(shared: Server) -> None:
    wrong = auth.mac("not-anyones-token-0123", bytes(32))
    with Server("127.0.0.1:0", token="the-only-token-0123456") as lone:
        answers = {
            _refusal(server.address, mac)
            for server in (shared, lone)
            for mac in (wrong, "0" * 64, "short", "é" * 64)
        }
    assert answers == {b'{"message":"authentication failed"}'}
    with pytest.raises(runtime.ProtocolMismatch) as info:
        runtime.connect(shared.address, token="not-anyones-token-0123")
    assert str(info.value).endswith("refused the session: authentication failed")
    for name in ("alice", "bob", "ops"):
        assert name not in str(info.value)


# ---- listing and eviction ------------------------------------------------------------------------


def test_a_tenant_sees_its_own_sessions_and_an_admin_sees_all(
    shared: Server, alice: torch.device, bob: Connection
) -> None:
    x = torch.ones(1 << 16, device=alice) * 2
    assert x.sum().item() == 2 << 16
    ids = {s.tenant.name: s.id for s in shared.sessions.values()}

    mine = admin_requests.list_sessions(shared.address, ALICE)
    assert not mine["admin"] and mine["viewer"] == "alice"
    assert [s["session"] for s in mine["sessions"]] == [ids["alice"]]
    assert [t["tenant"] for t in mine["tenants"]] == ["alice"]
    assert "sessions" not in mine["server"]  # nothing about other tenants
    assert admin_requests.list_sessions(shared.address, BOB)["sessions"][0]["session"] == ids["bob"]

    everything = admin_requests.list_sessions(shared.address, OPS)
    assert everything["admin"]
    assert {s["session"] for s in everything["sessions"]} == set(ids.values())
    assert everything["server"]["sessions"] == 2
    assert everything["server"]["device_memory_bytes"] == CAPACITY
    row = next(s for s in everything["sessions"] if s["tenant"] == "alice")
    assert row["memory_bytes"] >= x.numel() * 4
    assert row["memory_limit_bytes"] == CAPACITY // 2
    assert row["ops"] >= 3 and row["busy_ns"] > 0
    assert row["state"] in admin.STATES
    assert row["host"] == socket.gethostname()
    tenants = {t["tenant"]: t for t in everything["tenants"]}
    assert tenants["alice"]["memory_bytes"] == row["memory_bytes"]
    assert tenants["bob"]["memory_limit_bytes"] == 64 << 20
    assert tenants["ops"]["sessions"] == 0 and tenants["ops"]["admin"]
    text = admin_requests.format_listing(everything)
    assert "alice" in text and "bob" in text and "SESSION" in text


def test_only_an_admin_may_evict(shared: Server, alice: torch.device) -> None:
    x = torch.ones(8, device=alice)
    (sid,) = shared.sessions
    with pytest.raises(admin_requests.AdminError, match="needs an admin tenant"):
        admin_requests.evict(shared.address, sid, ALICE)
    with pytest.raises(admin_requests.AdminError, match="needs an admin tenant"):
        admin_requests.evict(shared.address, sid, BOB)
    with pytest.raises(admin_requests.AdminError, match="no session 9999"):
        admin_requests.evict(shared.address, 9999, OPS)
    assert (x + 1).sum().item() == 16.0


def test_an_evicted_session_gets_a_clear_error_and_its_memory_is_freed(
    shared: Server, alice: torch.device, bob: Connection
) -> None:
    x = torch.ones(1 << 18, device=alice)
    assert x.sum().item() == 1 << 18
    victim = next(s for s in shared.sessions.values() if s.tenant.name == "alice")
    assert victim.account.bytes >= 1 << 20
    admin_requests.evict(shared.address, victim.id, OPS)
    with pytest.raises(runtime.ServerGone, match="session evicted by an administrator"):
        (x * 2).sum().item()
    _wait_for(lambda: victim.id not in shared.sessions and victim.account.bytes == 0)
    assert len(victim.handles) == 0
    bob.ping()  # the other session goes on
    listing = admin_requests.list_sessions(shared.address, OPS)
    assert [s["tenant"] for s in listing["sessions"]] == ["bob"]
    ended = next(t for t in listing["tenants"] if t["tenant"] == "alice")
    assert ended["ops"] >= 2 and ended["sessions_opened"] == 1  # its usage outlives it


def test_the_servers_reason_wins_over_a_failed_send(shared: Server, alice: torch.device) -> None:
    """The server says why it ends a session, then closes it. A client whose next send fails
    (the connection is gone) still reports what the server said, not a broken pipe."""
    from gpu_trace.runtime.protocol.wire import PING_BODY, MsgType, frame

    x = torch.ones(8, device=alice)
    assert x.sum().item() == 8
    (victim,) = shared.sessions.values()
    admin_requests.evict(shared.address, victim.id, OPS)
    _wait_for(lambda: victim.id not in shared.sessions)
    conn = runtime.current()
    conn.writer.send(frame(MsgType.PING, PING_BODY.pack(1)))  # reaches a closed socket
    time.sleep(0.2)  # its reset is back: the next send fails, with the ERROR still unread
    with pytest.raises(runtime.ServerGone, match="session evicted by an administrator"):
        (x * 2).sum().item()


def test_gpu_trace_tenants_lists_and_evicts(
    shared: Server, alice: torch.device, python: str
) -> None:
    torch.ones(4, device=alice).sum().item()
    (sid,) = shared.sessions

    def tenants(*args: str) -> subprocess.CompletedProcess:
        argv = [python, "-m", "gpu_trace", "tenants", shared.address, *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    out = tenants("--token", OPS, "--json")
    assert out.returncode == 0, out.stderr
    assert [s["session"] for s in json.loads(out.stdout)["sessions"]] == [sid]
    out = tenants("--token", ALICE)
    assert out.returncode == 0 and "alice" in out.stdout and "its own sessions" in out.stdout
    out = tenants("--token", BOB, "--evict", str(sid))
    assert out.returncode == 1 and "needs an admin tenant's token" in out.stderr
    out = tenants("--token", "not-anyones-token-0123")
    assert out.returncode == 1 and "authentication failed" in out.stderr
    out = tenants("--token", OPS, "--evict", str(sid))
    assert out.returncode == 0 and f"evicted session {sid}" in out.stdout
    with pytest.raises(runtime.ServerGone, match="evicted"):
        torch.ones(4, device=alice).sum().item()


# ---- /metrics ------------------------------------------------------------------------------------


def _get(url: str, token: str | None = None) -> tuple[int, str, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()


def test_metrics_are_prometheus_text_per_tenant_and_session(
    shared: Server, alice: torch.device, bob: Connection
) -> None:
    x = torch.ones(1 << 16, device=alice)
    assert x.sum().item() == 1 << 16
    with MetricsServer(shared, "127.0.0.1:0") as metrics:
        status, ctype, text = _get(metrics.url)
        assert _get(metrics.url.replace("/metrics", "/"))[0] == 404
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name: str, **labels: str) -> float:
        fam = families[name.removesuffix("_total")]
        want = name if name.endswith("_total") else fam.name
        hits = [s.value for s in fam.samples if s.name == want and s.labels == labels]
        assert len(hits) == 1, (name, labels, fam.samples)
        return hits[0]

    alice_id, bob_id = (
        str(next(s.id for s in shared.sessions.values() if s.tenant.name == n))
        for n in ("alice", "bob")
    )
    assert value("gpu_trace_sessions") == 2
    assert value("gpu_trace_device_memory_bytes", device="cpu") == CAPACITY
    assert families["gpu_trace_server_batches"].type == "counter"
    assert value("gpu_trace_tenant_memory_bytes", tenant="alice") >= (1 << 16) * 4
    assert value("gpu_trace_tenant_memory_limit_bytes", tenant="alice") == CAPACITY // 2
    assert value("gpu_trace_tenant_memory_limit_bytes", tenant="bob") == 64 << 20
    assert value("gpu_trace_tenant_sessions", tenant="ops") == 0
    assert value("gpu_trace_tenant_ops_total", tenant="alice") >= 2
    assert value("gpu_trace_tenant_busy_seconds_total", tenant="alice") > 0
    assert value("gpu_trace_session_ops_total", tenant="alice", session=alice_id) >= 2
    assert value("gpu_trace_session_memory_bytes", tenant="bob", session=bob_id) == 0
    info = {s.labels["tenant"]: s.labels for s in families["gpu_trace_session_info"].samples}
    assert info["alice"]["session"] == alice_id and info["alice"]["state"] in admin.STATES
    for fam in families.values():  # counters end in _total, every family has help
        assert fam.documentation
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples)
    assert "# TYPE gpu_trace_tenant_ops_total counter" in text


def test_metrics_off_loopback_need_an_admin_token(shared: Server) -> None:
    with MetricsServer(shared, "0.0.0.0:0") as metrics:
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        status, _, body = _get(url)
        assert status == 401 and "Bearer" in body
        assert _get(url, BOB)[0] == 401
        assert _get(url, OPS + "x")[0] == 401
        status, _, text = _get(url, OPS)
        assert status == 200 and "gpu_trace_tenant_sessions" in text
    with (
        Server("127.0.0.1:0", tenants=TENANTS[:2]) as no_admin,
        pytest.raises(ValueError, match="need an admin tenant"),
    ):
        MetricsServer(no_admin, "0.0.0.0:0")


# ---- gpu-trace serve's flags ---------------------------------------------------------------------


def test_serve_refuses_a_bad_tenants_file_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[[tenant]]\nname = "bob"\ntoken = "{BOB}"\nmemory = 1.5\n')
    assert cli.main(["serve", "--tenants", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f'{path}:4: tenant "bob": memory must be a fraction in (0, 1]' in err
    assert cli.main(["serve", "--tenants", str(path), "--token", OPS]) == 2
    assert "not both" in capsys.readouterr().err
    path.write_text(f'[[tenant]]\nname = "bob"\ntoken = "{BOB}"\n')
    assert cli.main(["serve", "--tenants", str(path), "--device-memory", "lots"]) == 2
    assert "not a byte size" in capsys.readouterr().err
    assert cli.main(["serve", "--tenants", str(path), "--metrics", "0.0.0.0:0"]) == 2
    assert "need an admin tenant" in capsys.readouterr().err
    assert cli.main(["serve", "--tenants", str(path), "--spin-us", "-5"]) == 2
    assert "spin must be in [0, 1000000] microseconds" in capsys.readouterr().err


def test_serve_policy_choices_are_the_policies() -> None:
    from gpu_trace.runtime.sharing.policies import DEFAULT_POLICY, POLICIES

    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    (action,) = [a for a in commands.choices["serve"]._actions if a.dest == "policy"]
    assert tuple(action.choices) == POLICIES and action.default == DEFAULT_POLICY


def test_an_admin_pages_a_session_out_and_its_next_op_brings_it_back(
    shared: Server, alice: torch.device, python: str
) -> None:
    x = torch.arange(1 << 16, dtype=torch.float32, device=alice)
    y = x[::2]  # a view: it must still alias x when it comes back
    assert y.sum().item() == float(sum(range(0, 1 << 16, 2)))
    (session,) = shared.sessions.values()
    with pytest.raises(admin_requests.AdminError, match="paging out a session needs an admin"):
        admin_requests.page_out(shared.address, session.id, ALICE)
    with pytest.raises(admin_requests.AdminError, match="no session 9999"):
        admin_requests.page_out(shared.address, 9999, OPS)
    out = subprocess.run(
        [python, "-m", "gpu_trace", "tenants", shared.address, "--token", OPS, "--json",
         "--page-out", str(session.id)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    moved = json.loads(out.stdout)
    assert moved["paged_out"] == session.id and moved["bytes"] >= x.numel() * 4
    assert session.usage.evictions == 1 and session.usage.evicted_bytes == moved["bytes"]
    row = admin_requests.list_sessions(shared.address, OPS)["sessions"][0]
    assert row["evicted_bytes"] == moved["bytes"] and row["state"] == "paged-out"
    x.mul_(2)  # the next op restores; the view sees the in-place change
    assert y.sum().item() == float(2 * sum(range(0, 1 << 16, 2)))
    assert session.usage.restores == 1
