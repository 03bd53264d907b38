"""Connections that never authenticate, against a real server on loopback: idle ones and slowloris
trickles must not keep real clients out, nor outlive the handshake deadline, nor flood the log."""

from __future__ import annotations

import logging
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from gpu_trace import cli, runtime
from gpu_trace.runtime.protocol import auth, wire
from gpu_trace.runtime.protocol.wire import MsgType
from gpu_trace.runtime.server.server import Server

TOKEN = "connections-token-0123456"
HANDSHAKES_LOG = "gpu_trace.runtime.server.handshakes"

_sockets: list[socket.socket] = []


def _wait_readable(fd: object, timeout: float) -> bool:
    """Whether ``fd`` turns readable within ``timeout`` s (poll: select() refuses descriptors past
    1024, which a long test process holds)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(timeout * 1000)))


@pytest.fixture(autouse=True)
def _close_sockets() -> Iterator[None]:
    yield
    while _sockets:
        _sockets.pop().close()


def _connect(server: Server | int) -> socket.socket:
    """A connection to ``server`` (or to the server on that loopback port)."""
    port = server if isinstance(server, int) else server.port
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    _sockets.append(sock)
    return sock


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _run_op(server: Server | int) -> float:
    """A real client's handshake (the client library's own), then one batch: the op's value."""
    sock = _connect(server)
    reader, welcome = auth.client_handshake(sock, "the server", TOKEN, {"host": "test"})
    assert welcome["session"] > 0
    ops = [
        ["aten::ones.default", [[3]], {"dtype": {"d": "float32"}, "device": {"v": "r"}}, [1]],
        ["aten::sum.default", [{"h": 1}], {}, [2]],
        ["aten::_local_scalar_dense.default", [{"h": 2}], {}, None],
    ]
    wire.FrameWriter(sock).send(
        *wire.split_frame(MsgType.BATCH, {"seq": 1, "ops": ops, "free": []}, [b""])
    )
    mtype, body = reader.read()
    assert mtype == MsgType.DONE_VALUE, (mtype, body)
    return wire.decode_done_value(body)[3]


class Trickle:
    """Slowloris: connections that each send one byte of a HELLO now and then, never all of it."""

    def __init__(self, server: Server, count: int, every_s: float) -> None:
        self.socks = [_connect(server) for _ in range(count)]
        self.every_s = every_s
        # A HELLO header announcing a 4000-byte body: the server waits for the rest.
        self.data = wire.HEADER.pack(4000, MsgType.HELLO) + b"x" * 4000
        self.sent = 0
        self.closed: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for i in range(len(self.data)):  # bounded: never more bytes than a HELLO
            for sock in self.socks:
                if sock not in self.closed:
                    try:
                        sock.send(self.data[i : i + 1])
                    except OSError:
                        self.closed.add(sock)
            self.sent = i + 1
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _conn_threads() -> int:
    return sum(t.name == "gpu-trace-conn" for t in threading.enumerate())


def test_idle_and_trickling_connections_leave_room_for_real_clients(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Deadlines far away: what lets the real clients in is the bound, not a timeout.
    monkeypatch.setenv("GPU_TRACE_HANDSHAKE_TIMEOUT", "600")
    caplog.set_level(logging.WARNING, logger=HANDSHAKES_LOG)
    with Server("127.0.0.1:0", token=TOKEN) as server:
        limit = server.handshakes.limit
        assert limit == 64  # the default
        server.handshakes.log_every_s = 3600.0  # one line now, the rest at close
        idle = [_connect(server) for _ in range(200)]
        trickle = Trickle(server, 40, every_s=0.25)
        try:
            # However many wait, the server holds at most `limit` of them, threads included.
            _wait_for(lambda: len(server.handshakes) <= limit and _conn_threads() <= limit)
            values = [_run_op(server) for _ in range(9)]
            dev = runtime.connect(server.address, token=TOKEN)
            try:
                values.append(torch.ones(3, device=dev).sum().item())
            finally:
                runtime.disconnect()
            assert values == [3.0] * 10
            assert trickle.sent > 0
            ended = server.handshakes.ended["room"]
            # 240 waited, `limit` at a time; the 10 clients made room too, when it was full.
            assert 240 - limit <= ended <= 240 - limit + 10
        finally:
            trickle.stop()
        assert len(idle) == 200
    lines = [r.getMessage() for r in caplog.records if r.name == HANDSHAKES_LOG]
    assert len(lines) == 2, lines  # the first ending at once, every later one at close
    assert _counted(lines, "to make room") == ended


def test_the_handshake_deadline_ends_idle_and_trickling_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPU_TRACE_HANDSHAKE_TIMEOUT", "1")
    with Server("127.0.0.1:0", token=TOKEN) as server:
        assert server.handshakes.timeout_s == 1.0
        silent = _connect(server)
        # A byte every 0.1 s: a receive timeout of 1 s would never run out.
        trickle = Trickle(server, 1, every_s=0.1)
        try:
            _wait_for(lambda: trickle.closed or trickle.sent >= 300, timeout=60)
            assert trickle.closed, f"a connection that trickled {trickle.sent} bytes is still open"
        finally:
            trickle.stop()
        silent.settimeout(30)
        said = b""
        while chunk := silent.recv(4096):  # until the server hangs up
            said += chunk
        assert said[4] == MsgType.CHALLENGE and len(said) == 5 + wire.HEADER.unpack(said[:5])[0]
        _wait_for(lambda: server.handshakes.ended["timeout"] == 2)
        assert len(server.handshakes) == 0
        assert _run_op(server) == 3.0  # real clients are still welcome


def test_sessions_are_out_of_the_handshake_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_TRACE_MAX_HANDSHAKES", "2")
    with Server("127.0.0.1:0", token=TOKEN) as server:
        sock = _connect(server)
        reader, _ = auth.client_handshake(sock, server.address, TOKEN, {"host": "test"})
        for _ in range(6):  # each new one ends the oldest pending handshake, never a session
            _connect(server)
        _wait_for(lambda: server.handshakes.ended["room"] == 4)
        t0 = time.perf_counter_ns()
        wire.FrameWriter(sock).send(wire.frame(MsgType.PING, wire.PING_BODY.pack(t0)))
        mtype, body = reader.read()
        assert mtype == MsgType.PONG and wire.decode_pong(body)[0] == t0
        assert len(server.sessions) == 1 and len(server.handshakes) == 2


def test_wrong_tokens_are_counted_and_logged_in_bulk(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gpu_trace.runtime")
    with Server("127.0.0.1:0", token=TOKEN) as server:
        server.handshakes.log_every_s = 3600.0
        for _ in range(5):
            sock = _connect(server)
            with pytest.raises(runtime.ProtocolMismatch, match="authentication failed"):
                auth.client_handshake(sock, server.address, "not-the-token-0123456", {})
        _wait_for(lambda: server.handshakes.ended["refused"] == 5)
    lines = [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG]
    lines = [line for line in lines if "listening on" not in line]
    assert len(lines) == 2, lines  # no line per connection: the first at once, the rest at close
    assert _counted(lines, "refused") == 5


def _counted(lines: list[str], why: str) -> int:
    """The handshakes ended for ``why`` that log ``lines`` count."""
    return sum(int(n) for line in lines for n in re.findall(rf"(\d+) {why}", line))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GPU_TRACE_HANDSHAKE_TIMEOUT", "abc"),
        ("GPU_TRACE_HANDSHAKE_TIMEOUT", "nan"),
        ("GPU_TRACE_HANDSHAKE_TIMEOUT", "inf"),
        ("GPU_TRACE_HANDSHAKE_TIMEOUT", "0"),
        ("GPU_TRACE_HANDSHAKE_TIMEOUT", "-1"),
        ("GPU_TRACE_MAX_HANDSHAKES", "0"),
        ("GPU_TRACE_MAX_HANDSHAKES", "1.5"),
        ("GPU_TRACE_MAX_HANDSHAKES", "nan"),
        ("GPU_TRACE_MAX_HANDSHAKES", "inf"),
        ("GPU_TRACE_MAX_HANDSHAKES", "many"),
    ],
)
def test_bad_connection_settings_are_refused_before_serving(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="(?i)handshake"):
        Server("127.0.0.1:0", token=TOKEN)
    assert cli.main(["serve", "--listen", "127.0.0.1:0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # One line naming the setting (commands.check_settings, before the server is built).
    assert len(err) == 1 and name in err[0] and repr(value) in err[0], err


def test_bad_connection_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["serve", "--listen", "127.0.0.1:0", "--device", "cpu", "--token", TOKEN]
    assert cli.main([*flags, "--max-handshakes", "0"]) == 2
    assert cli.main([*flags, "--handshake-timeout", "nan"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "got 0" in err[0] and "got nan" in err[1], err


SERVER_OUT_OF_FDS = """
import logging, os, resource, sys, time
from gpu_trace.runtime.server.server import Server
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
server = Server("127.0.0.1:0", token=sys.argv[1], handshake_timeout_s=600).start()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
print(server.port, flush=True)
sys.stdin.read()  # until the test closes it
server.close()
"""


def test_running_out_of_file_descriptors_does_not_stop_accepting() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_OUT_OF_FDS, TOKEN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        port = int(proc.stdout.readline())
        # Far more than the 4 descriptors left: accept() fails with EMFILE for the rest.
        flood = [_connect(port) for _ in range(12)]
        ready = _wait_readable(proc.stderr, 30)
        first = proc.stderr.readline() if ready else ""
        assert "not accepted" in first, first  # the first failure is logged at once
        for sock in flood:
            sock.close()
        assert _run_op(port) == 3.0
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
        rest = proc.stderr.read().splitlines()
        assert len(rest) <= 1, rest  # the rest in one line at close, not one per failed accept
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()
