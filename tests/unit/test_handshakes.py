"""The bound on connections in their handshake: whom it ends, and how it logs (no server needed)."""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Iterator

import pytest

from gpu_trace.runtime.server.handshakes import Handshakes

LOG = "gpu_trace.runtime.server.handshakes"

_pairs: list[tuple[socket.socket, socket.socket]] = []


@pytest.fixture(autouse=True)
def _close_pairs() -> Iterator[None]:
    yield
    while _pairs:
        for sock in _pairs.pop():
            sock.close()


def _conn() -> tuple[socket.socket, socket.socket]:
    """(the server's end, the peer's end) of a connection."""
    pair = socket.socketpair()
    _pairs.append(pair)
    pair[1].setblocking(False)
    return pair


def _ended(peer: socket.socket) -> bool:
    """Whether the server's end was shut (the peer reads end of file)."""
    try:
        return peer.recv(1) == b""
    except BlockingIOError:
        return False


def test_at_the_limit_the_busiest_peers_oldest_handshake_ends() -> None:
    hs = Handshakes(limit=4, timeout_s=10)
    client = _conn()
    hs.begin(client[0], "10.0.0.2")  # the oldest, from its own address
    flood = [_conn() for _ in range(3)]
    for server_end, _ in flood:
        hs.begin(server_end, "10.0.0.1")
    newest = _conn()
    hs.begin(newest[0], "10.0.0.1")
    assert [_ended(p) for _, p in flood] == [True, False, False]
    assert not _ended(client[1]) and not _ended(newest[1])
    assert len(hs) == 4 and hs.ended["room"] == 1
    for _ in range(10):  # however many more come from the flooding address
        hs.begin(_conn()[0], "10.0.0.1")
    assert not _ended(client[1])
    assert hs.done(client[0]) and not hs.done(client[0])  # authenticated: out, once


def test_among_peers_with_as_many_the_oldest_handshake_ends() -> None:
    hs = Handshakes(limit=2, timeout_s=10)
    first, second = _conn(), _conn()
    hs.begin(first[0], "b")
    hs.begin(second[0], "a")
    hs.begin(_conn()[0], "c")
    assert _ended(first[1]) and not _ended(second[1])


def test_the_deadline_is_counted_from_the_start() -> None:
    hs = Handshakes(limit=2, timeout_s=7)
    before = time.monotonic()
    deadline = hs.begin(_conn()[0], "a")
    assert before + 7 <= deadline <= time.monotonic() + 7


def test_endings_are_logged_in_bulk(caplog: pytest.LogCaptureFixture) -> None:
    hs = Handshakes(limit=2, timeout_s=10, log_every_s=3600)
    with caplog.at_level(logging.WARNING, logger=LOG):
        for why in ["timeout"] * 5 + ["refused"] * 3:
            hs.failed(why)
        assert len(caplog.records) == 1  # the first at once
        hs.flush()
        hs.flush()  # nothing new: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "1 past the handshake deadline" in lines[0]
    assert "3 refused" in lines[1] and "4 past the handshake deadline" in lines[1]
    assert hs.ended == {"timeout": 5, "refused": 3}


def test_what_is_not_logged_yet_is_logged_when_the_interval_is_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hs = Handshakes(limit=2, timeout_s=10, log_every_s=0.05)
    with caplog.at_level(logging.WARNING, logger=LOG):
        hs.failed("timeout")
        hs.failed("timeout")  # within the interval: held back, then logged by a timer
        deadline = time.monotonic() + 10
        while len(caplog.records) < 2:
            assert time.monotonic() < deadline, "the held-back line never came"
            time.sleep(0.01)
    assert "1 past the handshake deadline" in caplog.records[1].getMessage()


@pytest.mark.parametrize(
    ("limit", "timeout_s"),
    [(0, 10), (-1, 10), (2.5, 10), (True, 10), (2, 0), (2, math.nan), (2, math.inf)],
)
def test_bad_bounds_are_refused(limit: object, timeout_s: float) -> None:
    with pytest.raises(ValueError, match="handshake"):
        Handshakes(limit=limit, timeout_s=timeout_s)  # type: ignore[arg-type]
