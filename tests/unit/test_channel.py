"""The front-worker channel (runtime/channel/): whole typed messages, a file descriptor with one,
anything else refused with a message; and the beacon a dead worker leaves its last op in."""

from __future__ import annotations

import os
import socket

import pytest

from gpu_trace.runtime.channel.beacon import NAME_BYTES, Beacon
from gpu_trace.runtime.channel.messages import (
    MAX_MESSAGE,
    Assign,
    Channel,
    ChannelClosed,
    Ended,
    Report,
    decode,
    encode,
)


def _assign() -> Assign:
    return Assign(
        session=7,
        tenant={"name": "alice", "weight": 2.0},
        client={"host": "h"},
        trace=True,
        binary=True,
        limit_bytes=None,
        capacity_bytes=1 << 30,
        idle_timeout_s=120.0,
        idle_s=None,
        spin_us=200.0,
    )


def test_messages_round_trip_with_a_descriptor() -> None:
    front, theirs = Channel.pair()
    worker = Channel(theirs)
    a, b = socket.socketpair()
    front.send(_assign(), fd=a.fileno())
    msg, fd = worker.recv(5)
    assert msg == _assign() and fd is not None
    with socket.socket(fileno=fd) as passed:  # the same connection, in the other end's hands
        passed.sendall(b"ping")
        assert b.recv(4) == b"ping"
    worker.send(Report({"ops": 3}, 10, 12, 0, "idle", 1))
    msg, fd = front.recv(5)
    assert isinstance(msg, Report) and msg.usage == {"ops": 3} and fd is None
    # a worker that captures GPU activity reports its counts (serve's closing line sums them)
    counts = {"records": 40, "spans": 20, "unattributed": 1, "late": 0, "dropped": 0}
    worker.send(Report({}, 0, 0, 0, "idle", 2, gpu_activity=counts))
    msg, _ = front.recv(5)
    assert isinstance(msg, Report) and msg.gpu_activity == counts
    for s in (front, worker, a, b):
        s.close()


def test_a_closed_end_and_a_silent_one() -> None:
    front, theirs = Channel.pair()
    worker = Channel(theirs)
    with pytest.raises(TimeoutError):
        front.recv(0.05)
    worker.close()
    with pytest.raises(ChannelClosed):
        front.recv(5)
    front.close()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not an object"),
        (b'{"kind": "exec", "code": "x"}', "no known kind"),
        (b'{"kind": "ended", "reason": "x", "extra": 1}', "unknown fields"),
        (b'{"kind": "ended"}', "missing fields"),
    ],
)
def test_anything_but_a_message_is_refused_by_name(body: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode(body)


def test_a_bad_packet_closes_the_descriptor_it_carried() -> None:
    front, theirs = Channel.pair()
    a, b = socket.socketpair()
    before = len(os.listdir("/proc/self/fd"))
    socket.send_fds(theirs, [b'{"kind": "nonsense"}'], [a.fileno()])
    with pytest.raises(ValueError):
        front.recv(5)
    assert len(os.listdir("/proc/self/fd")) == before  # the received copy was closed
    for s in (front, theirs, a, b):
        s.close()


def test_messages_are_bounded() -> None:
    big = Ended("x", "y" * MAX_MESSAGE)
    with pytest.raises(ValueError, match="over"):
        encode(big)


def test_the_beacon_keeps_the_last_op_for_the_other_side() -> None:
    worker = Beacon()
    front = Beacon(os.dup(worker.fd))  # as the front maps the worker's page
    assert front.read() == ""
    worker.mark("aten::mm.out")
    assert front.read() == "aten::mm.out"
    worker.mark("aten::" + "x" * 500)
    assert len(front.read()) == NAME_BYTES
    worker.mark("rt::\x1b[31mred")  # a worker is not trusted: what is read is printable
    assert front.read() == "rt::?[31mred"
    worker.idle()
    assert front.read() == ""
    worker.close()
    front.close()
